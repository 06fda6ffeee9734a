"""bench/gpu_check.py and bench/gpu_check.sh without a GPU: the exit statuses and their one
line (no GPU; a GPU that this torch cannot use; TRITON_INTERPRET set; bad arguments), the
version pin check, and a step that overruns its budget. The steps themselves run on CPU in
`python bench/gpu_check.py --smoke` (Triton's interpreter), on a GPU in the lent-GPU check."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import gpu_check  # noqa: E402

needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU paths")


def run(command, path_prefix=None, **env):
    environment = {key: value for key, value in os.environ.items()
                   if key != "TRITON_INTERPRET"}
    environment.update(env)
    if path_prefix is not None:
        environment["PATH"] = f"{path_prefix}{os.pathsep}{environment['PATH']}"
    return subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture
def fake_nvidia_smi(tmp_path):
    """A PATH folder whose nvidia-smi lists a GPU, as on a machine whose torch cannot use it."""
    script = tmp_path / "nvidia-smi"
    script.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-0)'\n")
    script.chmod(0o755)
    return tmp_path


@needs_no_gpu
def test_no_gpu_exits_with_its_own_status(tmp_path):
    if gpu_check.gpu_present():
        pytest.skip("nvidia-smi finds a GPU here")
    for command in ([sys.executable, "bench/gpu_check.py", "--out", str(tmp_path)],
                    ["bash", "bench/gpu_check.sh"]):
        result = run(command)
        assert result.returncode == gpu_check.EXIT_NO_GPU == 3, result.stdout + result.stderr
        assert result.stdout.strip() == ("gpu_check: no GPU here, nothing checked (nvidia-smi "
                                         "finds none)")


@needs_no_gpu
def test_a_gpu_this_torch_cannot_use_fails_naming_the_install(fake_nvidia_smi, tmp_path):
    result = run([sys.executable, "bench/gpu_check.py", "--out", str(tmp_path)],
                 path_prefix=fake_nvidia_smi)
    assert result.returncode == gpu_check.EXIT_ENVIRONMENT == 2
    line = result.stdout.strip()
    assert len(line.splitlines()) == 1
    if torch.version.cuda is None:
        assert "CPU build" in line and "download.pytorch.org/whl/cu130" in line
    assert "bench/gpu_check.sh --install" in line
    interpret = run([sys.executable, "bench/gpu_check.py", "--out", str(tmp_path)],
                    path_prefix=fake_nvidia_smi, TRITON_INTERPRET="1")
    assert interpret.returncode == 2 and "TRITON_INTERPRET is set" in interpret.stdout


def test_shell_arguments():
    for args, message in ((["--bogus"], "unknown argument '--bogus'"),
                          (["--install", "--wheels", "/no/such/folder"],
                           "--wheels needs a folder of wheels"),
                          (["--wheels", str(REPO)], "--wheels DIR goes with --install")):
        result = run(["bash", "bench/gpu_check.sh", *args])
        assert result.returncode == 2 and message in result.stdout, result.stdout
    assert run(["bash", "bench/gpu_check.sh", "--help"]).returncode == 0


def test_version_pins_come_from_pyproject():
    requirement = gpu_check.pinned_requirement("transformers")
    assert requirement.startswith("transformers>=")
    assert gpu_check.satisfies("5.24.0", ">=5.24,<5.25")
    assert not gpu_check.satisfies("5.17.0", ">=5.24,<5.25")
    assert not gpu_check.satisfies("5.25.1", ">=5.24,<5.25")
    assert gpu_check.satisfies("2.11.0+cu130", ">=2.4")


def test_a_step_over_its_budget_is_killed_and_recorded(tmp_path):
    """The driver kills a step at its budget; its result says so, and the check fails."""
    step = gpu_check.Step("kernels", 1, "kernel configurations")
    result = gpu_check.run_step_process(step, smoke=True, out_dir=tmp_path, budget_s=0.5)
    assert result["status"] == "timed out" and "budget" in result["error"]
    assert result["name"] == "kernels" and result["seconds"] < 30


def test_budgets_fit_the_nine_minutes():
    assert sum(step.budget_s for step in gpu_check.STEPS) <= gpu_check.TOTAL_BUDGET_S <= 540
    assert {step.name for step in gpu_check.STEPS} == {
        "kernels", "engine", "bandwidth", "throughput", "fidelity"}
