"""The project's packages import one way: no module of runtime/, sim/, engine/, policies/,
kernels/ or vllm_adapter/ is reachable from itself by imports (at the top of a file or inside a
function; imports under `if TYPE_CHECKING:` never run and do not count)."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("runtime", "sim", "engine", "policies", "kernels", "vllm_adapter")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking_block(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
            or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(nodes):
    """The Import and ImportFrom nodes in `nodes` and below, but not in `if TYPE_CHECKING:`."""
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif _is_type_checking_block(node):
            yield from _imports(node.orelse)
        else:
            yield from _imports(ast.iter_child_nodes(node))


def imported_names(path: Path, name: str) -> set[str]:
    """Every dotted name `path` (module `name`) imports: `from a.b import c` gives a.b and a.b.c
    (c may be a module); relative imports are resolved."""
    names = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in _imports(ast.parse(path.read_text()).body):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
            base = ".".join(anchor + ([base] if base else []))
        names.add(base)
        names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """module -> the project's modules it imports."""
    paths = {module_name(path): path for package in PACKAGES
             for path in sorted((REPO / package).rglob("*.py"))}
    return {name: {imported for imported in imported_names(path, name)
                   if imported in paths and imported != name}
            for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of `graph` as [a, b, ..., a], or [] when it has none (depth-first search)."""
    state: dict[str, str] = {}   # module -> "open" while on the search's path, then "done"
    for root in sorted(graph):
        if root in state:
            continue
        path, pending = [root], [iter(sorted(graph[root]))]
        state[root] = "open"
        while pending:
            following = next(pending[-1], None)
            if following is None:
                state[path.pop()] = "done"
                pending.pop()
            elif state.get(following) == "open":
                return path[path.index(following):] + [following]
            elif following not in state:
                state[following] = "open"
                path.append(following)
                pending.append(iter(sorted(graph[following])))
    return []


def test_find_cycle_finds_one_and_only_one_that_is_there():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set(), "d": {"d"}}) == ["d", "d"]


def test_imported_names_resolve_relative_imports_and_skip_type_checking(tmp_path):
    path = tmp_path / "mod.py"
    path.write_text("from typing import TYPE_CHECKING\nfrom . import sibling\n"
                    "from ..up import thing\nif TYPE_CHECKING:\n    import only_for_types\n"
                    "else:\n    import at_run_time\ndef f():\n    import inside\n")
    names = imported_names(path, "pkg.sub.mod")
    assert {"pkg.sub.sibling", "pkg.up.thing", "at_run_time", "inside"} <= names
    assert "only_for_types" not in names


def test_the_packages_import_each_other_without_a_cycle():
    graph = import_graph()
    assert "runtime.metrics" in graph["runtime.step"]   # (the walk sees the imports)
    cycle = find_cycle(graph)
    assert not cycle, " -> ".join(cycle)
