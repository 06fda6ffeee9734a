"""Dependencies run one way: policies <- runtime <- simulator and engine side by side, and
calibration (calibration/: profiler, fitting, speed normalisation, validation, real-run replay)
above them all. A module of a lower layer imports nothing of a layer above it, at the top of a
file or inside a function; docs/architecture.md's diagram is what scripts/layers.py draws from
the imports now."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import layers  # noqa: E402  (scripts/layers.py: the same import reading draws the docs' diagram)
from layers import imported_modules  # noqa: E402

# Each package, and the packages above it that it may not import.
FORBIDDEN_ABOVE = {
    "kernels": ("calibration", "vllm_adapter"),
    "policies": ("runtime", "sim", "engine", "calibration", "vllm_adapter"),
    "runtime": ("sim", "engine", "calibration", "vllm_adapter"),
    "sim": ("engine", "calibration", "vllm_adapter"),
    "engine": ("sim", "calibration", "vllm_adapter"),
    # It runs in vLLM's process: policies and runtime only, never a backend of twinserve's own.
    "vllm_adapter": ("sim", "engine", "calibration"),
}


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


def test_the_imports_put_policies_at_the_bottom_runtime_above_and_sim_beside_engine():
    # (vllm_adapter beside them: it hosts policies in vLLM, through runtime's policy configs)
    by_layer = layers.layers(layers.package_imports())
    assert by_layer == [["kernels", "policies"], ["runtime"], ["engine", "sim", "vllm_adapter"],
                        ["calibration"]]


def test_the_architecture_diagram_is_the_one_the_imports_draw_now():
    page = (REPO / "docs" / "architecture.md").read_text()
    assert layers.documented_block(page) == layers.diagram_block(), (
        "docs/architecture.md's layer diagram is stale: "
        "python scripts/layers.py --write docs/architecture.md")


def write_package(repo: Path, package: str, source: str) -> None:
    (repo / package).mkdir()
    (repo / package / "__init__.py").write_text("")
    (repo / package / "module.py").write_text(source)


def test_an_upward_import_that_closes_a_cycle_is_named(tmp_path):
    write_package(tmp_path, "low", "import os\n")
    write_package(tmp_path, "mid", "from low import module\n")
    write_package(tmp_path, "top", "import mid.module\n")
    assert layers.layers(layers.package_imports(tmp_path)) == [["low"], ["mid"], ["top"]]
    (tmp_path / "low" / "module.py").write_text("def f():\n    import top\n")
    with pytest.raises(ValueError, match="low -> top -> mid -> low"):
        layers.layers(layers.package_imports(tmp_path))


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
