"""`bash bench/gpu_check.sh --smoke` end to end: every step of the lent-GPU check (engine, with
mixed LoRA adapters and the tiny MoE; speculative decoding; the 7B-shaped fidelity step at a
toy shape; bandwidth; throughput; kernels, with the LoRA kernel) at toy sizes on CPU through
Triton's interpreter, with the goals the interpreter meets (bench/gpu_check_steps/goals.py).
Proves the script runs before a GPU is lent: each step passes, and the files a lent machine
returns are written."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_smoke_runs_every_step_and_writes_the_returned_files(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(OUT=str(tmp_path), PYTHON=sys.executable)
    result = subprocess.run(["bash", "bench/gpu_check.sh", "--smoke"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert results["smoke"] and results["status"] == "passed"
    steps = {step["name"]: step for step in results["steps"]}
    assert list(steps) == ["engine", "speculative", "fidelity", "bandwidth", "throughput",
                           "kernels"]
    assert all(step["status"] == "passed" for step in steps.values())

    def checks(name):
        return [row for row in steps[name]["rows"] if "check" in row]

    # Every drafter, and the swap case, in both dtypes; each compared tie-aware and accepting.
    speculative = checks("speculative")
    assert len(speculative) == 10
    assert all(row["accepted_tokens"] > 0 and row["tokens_compared"] == row["tokens"]
               for row in speculative)
    assert any("lookahead" in row["check"] for row in speculative)
    assert any("Medusa" in row["check"] for row in speculative)
    # Issue 33's engine paths: mixed adapters against HF + PEFT (each adapter changing its
    # prompt's output), the tiny mixture of experts, the LoRA kernel in bf16 and fp16.
    engine = [row["check"] for row in checks("engine")]
    assert [check for check in engine if "multi-LoRA" in check] == [
        "tiny-llama fp32, multi-LoRA (ranks 8/16/64): each adapter changes its prompt's HF + "
        "PEFT output", "tiny-llama fp32, multi-LoRA (ranks 8/16/64): adapters and the base "
        "model in one batch vs HF + PEFT (each adapter alone)"]
    assert engine[-1] == "tiny-moe fp32 (8 experts, 2 per token), continuous"
    lora_kernel = [row for row in checks("kernels") if "multi-LoRA kernel" in row["check"]]
    assert len(lora_kernel) == 6 and all(row["rel_error"] <= row["tolerance"]
                                         for row in lora_kernel)
    # The gated measurements are checks with their goal, not bare records.
    assert any("goal" in row for row in checks("bandwidth"))
    assert [row["check"] for row in checks("throughput")] == ["engine / HF generate"]
    fidelity = checks("fidelity")
    assert fidelity[0]["check"] == "twinserve-profile tiny-llama"
    assert [row["check"] for row in fidelity[1:]] == [
        "validate continuous, inf req/s", "validate chunked_prefill, inf req/s",
        "validate continuous, inf req/s, recompute preemption", "the preemption case preempted"]
    # What a lent machine brings back: the log, the table and its numbers, the profile.
    table = (tmp_path / "fidelity.md").read_text()
    assert table.count("\n| ") == 4 and "gpu model" in table   # header and three jobs
    jobs = json.loads((tmp_path / "fidelity.json").read_text())["jobs"]
    assert all(job["gpu_model"] and job["metrics"]["mean_tpot_ms"]["engine_spread_pct"]
               is not None for job in jobs)
    assert (tmp_path / "tiny-llama.json").is_file()
    assert "gpu_check: all steps passed" in (tmp_path / "gpu_check.log").read_text()
    assert len([path for path in tmp_path.iterdir() if path.is_file()]) <= 8
