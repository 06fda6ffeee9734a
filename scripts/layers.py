"""Draw the repository's packages by layer from their imports.

Every top-level package's modules are read with ast; package A stands above package B when a
module of A imports B. A package's layer is one above the highest package it imports, so the
packages that import no other stand at the bottom.

    python scripts/layers.py                              # the text diagram
    python scripts/layers.py --mermaid                    # the same as a mermaid flowchart
    python scripts/layers.py --write docs/architecture.md # replace the diagram between the markers
    python scripts/layers.py --check docs/architecture.md # exit 1 if the diagram there is stale
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BEGIN = "<!-- scripts/layers.py: begin -->"
END = "<!-- scripts/layers.py: end -->"


def imported_modules(source: str) -> list[str]:
    """Every module a source names in an import statement or a literal importlib.import_module
    / __import__ call (relative imports stay inside their package and are left out)."""
    modules = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            modules.append(node.module or "")
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name)
                       and node.func.id in ("import_module", "__import__")))):
            modules.append(node.args[0].value)
    return modules


def packages(repo: Path = REPO) -> list[str]:
    """The top-level packages that hold code: a folder with __init__.py and another module."""
    return sorted(path.parent.name for path in repo.glob("*/__init__.py")
                  if any(module.name != "__init__.py" for module in path.parent.rglob("*.py")))


def subfolders(package: str, repo: Path = REPO) -> list[str]:
    """The package's first-level folders that hold Python modules."""
    return sorted(folder.name for folder in (repo / package).iterdir()
                  if folder.is_dir() and not folder.name.startswith((".", "__"))
                  and any(folder.rglob("*.py")))


def package_imports(repo: Path = REPO) -> dict[str, set[str]]:
    """For each package, the other packages its modules import."""
    names = packages(repo)
    return {package: {module.split(".")[0]
                      for path in (repo / package).rglob("*.py")
                      for module in imported_modules(path.read_text())
                      if module.split(".")[0] in names} - {package}
            for package in names}


def layers(imports: dict[str, set[str]]) -> list[list[str]]:
    """The packages by layer, bottom first: each one layer above the highest package it imports.
    An import cycle between packages has no layering and raises, naming the cycle."""
    layer_of: dict[str, int] = {}

    def place(package: str, path: tuple[str, ...]) -> int:
        if package in path:
            cycle = " -> ".join(path[path.index(package):] + (package,))
            raise ValueError(f"packages import each other in a cycle: {cycle}")
        if package not in layer_of:
            layer_of[package] = 1 + max((place(dependency, path + (package,))
                                         for dependency in sorted(imports[package])), default=-1)
        return layer_of[package]

    for package in sorted(imports):
        place(package, ())
    return [sorted(p for p in layer_of if layer_of[p] == layer)
            for layer in range(max(layer_of.values(), default=-1) + 1)]


def text_diagram(imports: dict[str, set[str]], repo: Path = REPO) -> str:
    """The layers top first, each package with its folders, then every package's imports."""
    def box(package: str) -> str:
        folders = subfolders(package, repo)
        return f"{package}/" + (f" ({', '.join(folders)})" if folders else "")

    rows = ["    ".join(box(package) for package in layer)
            for layer in reversed(layers(imports))]
    width = max(len(package) for package in imports)
    edges = [f"  {package:<{width}} -> {', '.join(sorted(imports[package]))}"
             for package in sorted(imports) if imports[package]]
    return "\n".join(["\n    v imports\n".join(rows), "",
                      "what each package imports (drawn from the code by scripts/layers.py):",
                      *edges])


def mermaid_diagram(imports: dict[str, set[str]]) -> str:
    """A mermaid flowchart, bottom to top: one row of nodes per layer, an arrow per import."""
    lines = ["flowchart BT"]
    for number, layer in enumerate(layers(imports)):
        lines.append(f"  subgraph layer{number}[layer {number}]")
        lines += [f"    {package}[{package}/]" for package in layer]
        lines.append("  end")
    lines += [f"  {package} --> {dependency}"
              for package in sorted(imports) for dependency in sorted(imports[package])]
    return "\n".join(lines)


def diagram_block(repo: Path = REPO) -> str:
    """What stands between the markers in a docs page: the text diagram in a fenced block."""
    return f"{BEGIN}\n```text\n{text_diagram(package_imports(repo), repo)}\n```\n{END}"


def documented_block(page: str, page_name: str = "the page") -> str:
    """The diagram between the markers of a page's text; raises, naming the markers, if absent."""
    if BEGIN not in page or END not in page:
        raise ValueError(f"{page_name} has no {BEGIN} ... {END} markers")
    return page[page.index(BEGIN):page.index(END) + len(END)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mermaid", action="store_true", help="print a mermaid flowchart")
    parser.add_argument("--write", type=Path, metavar="PAGE",
                        help="replace the diagram between the markers of this docs page")
    parser.add_argument("--check", type=Path, metavar="PAGE",
                        help="exit 1 if this docs page's diagram differs from the imports")
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as error:
        print(f"scripts/layers.py: {error}", file=sys.stderr)
        return 1


def run(args: argparse.Namespace) -> int:
    """Print, write or check the diagram as the arguments ask."""
    if args.write or args.check:
        page_path = args.write or args.check
        page = page_path.read_text()
        documented = documented_block(page, str(page_path))
        current = diagram_block()
        if args.check:
            if documented != current:
                print(f"{page_path}: the layer diagram is stale; run "
                      f"python scripts/layers.py --write {page_path}", file=sys.stderr)
                return 1
            return 0
        page_path.write_text(page.replace(documented, current))
        return 0
    imports = package_imports()
    print(mermaid_diagram(imports) if args.mermaid else text_diagram(imports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
