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


# The hand-off between a prefill and a decode pool: runtime/handoff.py's alone.
HANDOFF_CALLS = ("take_handoffs", "admit_transfer", "finish_transfer")


def handoff_calls(source: str) -> list[str]:
    """The scheduler hand-off methods a source calls itself (`x.take_handoffs()`, ...)."""
    return [node.func.attr for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in HANDOFF_CALLS]


@pytest.mark.parametrize("package", ["sim", "engine"])
def test_both_backends_hand_off_through_the_runtime(package):
    """Neither backend takes, admits or lands a hand-off by calling a scheduler itself: both
    call runtime/handoff.py, so the two pools' hand-off is written once."""
    offenders = [f"{path.relative_to(REPO)}: {call}"
                 for path in sorted((REPO / package).rglob("*.py"))
                 for call in handoff_calls(path.read_text())]
    assert offenders == []


def test_a_hand_off_call_is_caught():
    source = ("def admit(decode, request):\n"
              "    if decode.scheduler.admit_transfer(request, 0.0):\n"
              "        decode.scheduler.finish_transfer(request, 0.0)\n"
              "take_handoffs = None\n")
    assert handoff_calls(source) == ["admit_transfer", "finish_transfer"]
