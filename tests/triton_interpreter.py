"""Triton tests without a GPU: where this process cannot run the kernels, run them in a fresh one.

Without CUDA, Triton runs only in its interpreter, which must be chosen before triton is first
imported (kernels/triton_ops.py). When a test process imported triton earlier without it
(transformers does, through torch._dynamo: plain `pytest`, or a machine with nvidia-smi and a
CPU torch, where `make test` sets no TRITON_INTERPRET), the Triton tests re-run in a fresh
pytest process with TRITON_INTERPRET=1 and pass or fail by its outcome, instead of skipping.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RERUN = "TWINSERVE_TRITON_RERUN"   # set in the fresh process: it must not start another


def triton_unavailable() -> str | None:
    """Why the Triton kernels cannot run in this process, or None when they can."""
    try:
        from kernels import triton_ops
    except ImportError as error:
        return f"triton does not import: {error}"
    return triton_ops.UNAVAILABLE_REASON


def run_pytest_under_interpreter(*pytest_args: str, timeout: float = 600) -> None:
    """pytest with `pytest_args` in a fresh process under TRITON_INTERPRET=1, serially; fails
    the calling test with the child's output unless it passed something and skipped nothing
    (a skip there would be the same silent hole again)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1", **{RERUN: "1"},
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist",
         "-rs", *pytest_args], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=timeout)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0 and " passed" in summary and "skipped" not in summary, (
        result.stdout[-4000:] + result.stderr[-2000:])


def ran_in_fresh_process(request: pytest.FixtureRequest) -> bool:
    """For a test that needs the Triton kernels: False when they run in this process (the test
    goes on); else the test re-runs alone in a fresh process under the interpreter, and True
    once it passed there (the caller returns)."""
    reason = triton_unavailable()
    if reason is None:
        return False
    if os.environ.get(RERUN) == "1":
        pytest.fail(f"the Triton kernels cannot run even in a fresh interpreter process: {reason}")
    run_pytest_under_interpreter(request.node.nodeid)
    return True
