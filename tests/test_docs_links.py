"""Every relative link in README.md and docs/*.md leads to a file that exists and, where it names
a section, to a heading of that page (GitHub's anchors), so moving a section cannot strand a link."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: str) -> set[str]:
    """GitHub's anchors of a page: each heading lower-cased, punctuation dropped, spaces to
    hyphens; and explicit <a id="..."> targets."""
    headings = re.findall(r"^#+ (.+)$", page, flags=re.MULTILINE)
    return ({re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
             for heading in headings} | set(re.findall(r'<a id="([^"]+)"', page)))


def prose(page: str) -> str:
    """The page without its fenced code blocks, whose brackets are code, not links."""
    return re.sub(r"^```.*?^```", "", page, flags=re.MULTILINE | re.DOTALL)


def broken_links(path: Path, root: Path = REPO) -> list[str]:
    broken = []
    for target in LINK.findall(prose(path.read_text())):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file, _, anchor = target.partition("#")
        destination = (path.parent / file) if file else path
        if not destination.exists():
            broken.append(f"{path.relative_to(root)}: {target} (no such file)")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(
                destination.read_text()):
            broken.append(f"{path.relative_to(root)}: {target} (no such section)")
    return broken


def test_every_docs_link_leads_to_a_file_and_section_that_exist():
    assert [link for page in PAGES for link in broken_links(page)] == []


def test_the_docs_index_lists_every_docs_page():
    index = (REPO / "docs" / "README.md").read_text()
    listed = set(LINK.findall(index))
    assert [page.name for page in PAGES[1:]
            if page.name != "README.md" and page.name not in listed] == []


def test_a_moved_section_is_a_broken_link(tmp_path):
    (tmp_path / "a.md").write_text("# A\n\n## Long runs (2026-12-07 08:37–08:51)\n")
    (tmp_path / "b.md").write_text("[ok](a.md#long-runs-2026-12-07-08370851) [gone](a.md#pools)"
                                   " [none](c.md)\n```\n[code](not-a-link.md)\n```\n")
    assert broken_links(tmp_path / "b.md", root=tmp_path) == [
        "b.md: a.md#pools (no such section)", "b.md: c.md (no such file)"]
