"""Dependencies run one way: policies <- runtime <- simulator and engine side by side, and
calibration (calibration/: profiler, fitting, speed normalisation, validation, real-run replay)
above them all. A module of a
lower layer imports nothing of a layer above it, at the top of a file or inside a function."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Each package, and the packages above it that it may not import.
FORBIDDEN_ABOVE = {
    "kernels": ("calibration",),
    "policies": ("runtime", "sim", "engine", "calibration"),
    "runtime": ("sim", "engine", "calibration"),
    "sim": ("engine", "calibration"),
    "engine": ("sim", "calibration"),
}


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


def upward_imports(package: str, source: str) -> list[str]:
    return [module for module in imported_modules(source)
            if module.split(".")[0] in FORBIDDEN_ABOVE[package]]


@pytest.mark.parametrize("package", sorted(FORBIDDEN_ABOVE))
def test_no_module_imports_a_layer_above_its_own(package):
    offenders = [f"{path.relative_to(REPO)}: {module}"
                 for path in sorted((REPO / package).rglob("*.py"))
                 for module in upward_imports(package, path.read_text())]
    assert offenders == []


def test_every_kind_of_upward_import_is_caught():
    source = ("import calibration.validate\n"
              "def f():\n"
              "    from calibration.cpu_noise.speed import SpeedProbe\n"
              "    importlib.import_module('calibration.profiler.cli')\n"
              "from . import sibling\n"
              "import calibrationish\n")
    assert upward_imports("engine", source) == ["calibration.validate",
                                                "calibration.cpu_noise.speed",
                                                "calibration.profiler.cli"]
