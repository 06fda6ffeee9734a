"""bench/gpu_check.py and bench/gpu_check.sh without a GPU: the exit statuses and their one
line (no GPU; a GPU that this torch cannot use; TRITON_INTERPRET set; bad arguments), the
version pin check (peft, the LoRA checks' reference, among the pins), a step that overruns its
budget, the budgets and their carry-over, the goals' verdicts (each fails when its goal is
missed), the multi-LoRA kernel check's verdicts on a right and on broken kernels, and the
tie-aware greedy comparison on constructed logits. tests/test_gpu_check_smoke.py runs the whole
check end to end at toy sizes on CPU."""
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
from gpu_check_steps import goals, lora, ties  # noqa: E402

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
                          (["--wheels", str(REPO)], "--wheels DIR goes with --install"),
                          (["--carried", str(REPO)], "--carried needs a folder of wheels")):
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


def test_a_missing_or_wrong_peft_names_its_pin(monkeypatch):
    """peft is a test extra, but the LoRA checks' reference: without it the check does not run
    (it would crash in the engine step), and the one line names its pin."""
    from importlib import metadata
    real_version = metadata.version

    def version(package, found=None):
        if package == "peft":
            if found is None:
                raise metadata.PackageNotFoundError(package)
            return found
        return real_version(package)

    monkeypatch.setattr(metadata, "version", version)
    status, line = gpu_check.environment_problem(smoke=True)
    assert status == gpu_check.EXIT_ENVIRONMENT
    assert line.startswith("no peft; the project needs peft>=0.13,<0.22: pip install "
                           "'peft>=0.13,<0.22'")
    monkeypatch.setattr(metadata, "version", lambda package: version(package, "0.22.1"))
    status, line = gpu_check.environment_problem(smoke=True)
    assert status == gpu_check.EXIT_ENVIRONMENT and line.startswith("peft 0.22.1; the project")


def lora_kernel_rows(monkeypatch, add_lora) -> list[dict]:
    """The rows of the kernels step's multi-LoRA check (smoke sizes, CPU) with `add_lora` in
    place of the Triton launcher."""
    from gpu_check_steps.common import StepReport
    from kernels import triton_ops
    monkeypatch.setattr(triton_ops, "add_lora", add_lora)
    report = StepReport()
    lora.check_lora_kernel(report, smoke=True, device=torch.device("cpu"))
    return report.rows


def test_lora_kernel_check_passes_a_right_kernel_and_fails_broken_ones(monkeypatch):
    """The check's verdicts, with the torch grouped kernel standing in for Triton's: right, it
    passes every dtype and mix; a delta 5 % off, or one added to base-model rows, fails each."""
    from kernels import torch_lora
    rows = lora_kernel_rows(monkeypatch, torch_lora.add_lora)
    assert len(rows) == len(lora.LORA_DTYPES) * len(lora.LORA_MIXES) == 6
    assert all(row["ok"] and row["rel_error"] <= row["tolerance"] for row in rows)
    assert {row["check"].split(",")[0] for row in rows} == {"bf16", "fp16"}

    def scaled_wrong(out, x, lora_a, lora_b, scalings, batch):
        torch_lora.add_lora(out, x, lora_a, lora_b, scalings * 1.05, batch)

    assert not any(row["ok"] for row in lora_kernel_rows(monkeypatch, scaled_wrong))

    def onto_every_row(out, x, lora_a, lora_b, scalings, batch):
        from kernels.lora_batch import LoRABatch
        every = batch.token_slots.clone()
        every[every < 0] = 0   # base-model tokens given adapter 0
        torch_lora.add_lora(out, x, lora_a, lora_b, scalings, LoRABatch.build(every.numpy(),
                                                                               "cpu"))

    broken = lora_kernel_rows(monkeypatch, onto_every_row)
    assert not any(row["ok"] for row in broken[:2] + broken[3:5])  # the mixes with base rows
    assert all("base-model rows CHANGED" in row["value"] for row in broken[:2])


def test_a_step_over_its_budget_is_killed_and_recorded(tmp_path):
    """The driver kills a step at its budget; its result says so, and the check fails."""
    step = gpu_check.Step("kernels", 1, 1, "kernel configurations")
    result = gpu_check.run_step_process(step, smoke=True, out_dir=tmp_path, budget_s=0.5)
    assert result["status"] == "timed out" and "budget" in result["error"]
    assert result["name"] == "kernels" and result["seconds"] < 30


def test_budgets_fit_the_nine_minutes_most_important_first():
    assert sum(step.budget_s for step in gpu_check.STEPS) <= gpu_check.TOTAL_BUDGET_S <= 540
    assert all(step.estimate_s < step.budget_s for step in gpu_check.STEPS)
    assert [step.name for step in gpu_check.STEPS] == [
        "engine", "speculative", "fidelity", "bandwidth", "throughput", "kernels"]


def test_unused_budget_carries_to_the_next_step():
    steps = [gpu_check.Step("a", 5, 10, ""), gpu_check.Step("b", 5, 20, ""),
             gpu_check.Step("c", 5, 30, "")]
    assert gpu_check.step_budget(steps, elapsed_s=0, done=0, smoke=False) == 10
    assert gpu_check.step_budget(steps, elapsed_s=4, done=1, smoke=False) == 26
    assert gpu_check.step_budget(steps, elapsed_s=40, done=2, smoke=False) == 20
    assert gpu_check.step_budget(steps, elapsed_s=40, done=2, smoke=True) == \
        gpu_check.SMOKE_BUDGET_S


def test_goals_fail_when_missed_and_say_by_how_much():
    assert goals.GPU_GOALS.decode_bandwidth_share == 0.80
    assert goals.GPU_GOALS.engine_vs_hf == 2.0 and goals.GPU_GOALS.validation_gates
    assert goals.goals_for(smoke=False) is goals.GPU_GOALS
    assert goals.bandwidth_verdict(0.81, 0.80)[0]
    met, text = goals.bandwidth_verdict(0.57, 0.80)
    assert not met and "short of the 80% goal by 23 points" in text
    assert goals.throughput_verdict(2.1, 2.0)[0]
    met, text = goals.throughput_verdict(1.61, 2.0)
    assert not met and "short of the 2.0x goal by 0.39x" in text
    assert goals.validation_verdict([]) == (True, "gates met")
    met, text = goals.validation_verdict(["mean_ttft_ms: +7.0 % (gate ±3 %)", "p99: x"])
    assert not met and "mean_ttft_ms" in text and "+1 more" in text


def test_tie_resolution_is_two_units_in_the_last_place():
    assert ties.tie_resolution("bfloat16", 10.0) == 0.125      # 2 * 2^-7 * 8
    assert ties.tie_resolution("bfloat16", -10.0) == 0.125
    assert ties.tie_resolution("bfloat16", 0.3) == 2 * 2.0 ** -7
    assert ties.tie_resolution("float32", 10.0) == 2 * 2.0 ** -23 * 8
    with pytest.raises(ValueError, match="dtype must be one of"):
        ties.tie_resolution("int8", 1.0)


def constructed_logits(winners, gaps, vocab=8, top=10.0):
    """Logits whose argmax at position i is winners[i], the runner-up gaps[i] below it."""
    logits = torch.full((len(winners), vocab), top - 5.0)
    for position, (winner, gap) in enumerate(zip(winners, gaps)):
        logits[position, winner] = top
        logits[position, (winner + 1) % vocab] = top - gap
    return logits


def test_tie_aware_comparison_on_constructed_logits():
    expected = [3, 1, 4, 1, 5, 2, 6, 5]
    clear = [1.0] * len(expected)
    gaps, tops = ties.gaps_and_tops(constructed_logits(expected, clear))
    assert gaps == pytest.approx(clear) and tops == pytest.approx([10.0] * 8)
    same = ties.compare_prompt(expected, expected, gaps, tops, "bfloat16")
    assert same.ok and same.compared == 8 and same.parted_at is None
    # Parting at a clear gap fails, in any dtype.
    other = expected[:6] + [0, 0]
    parted = ties.compare_prompt(other, expected, gaps, tops, "bfloat16")
    assert not parted.ok and parted.parted_at == 6 and parted.compared == 6
    # Parting where the reference's top two are 0.05 apart at |logit| 10: a tie in bf16
    # (resolution 0.125), not in fp32.
    near = [1.0] * 6 + [0.05, 1.0]
    gaps, tops = ties.gaps_and_tops(constructed_logits(expected, near))
    at_tie = ties.compare_prompt(other, expected, gaps, tops, "bfloat16")
    assert at_tie.ok and at_tie.near_tie and at_tie.compared == 6
    assert not ties.compare_prompt(other, expected, gaps, tops, "float32").ok
    # A shorter output is a difference, never a tie.
    assert not ties.compare_prompt(expected[:5], expected, gaps, tops, "bfloat16").ok


def test_a_run_must_compare_most_tokens():
    expected = [[3, 1, 4, 1, 5, 2, 6, 5]] * 2
    early_tie = [0.05] + [1.0] * 7
    gaps, tops = ties.gaps_and_tops(constructed_logits(expected[0], early_tie))
    parted_early = [0] + expected[0][1:]
    # One prompt identical, one parted at a tie at position 0: 8 of 16 compared, under 75 %.
    run = ties.compare_run([expected[0], parted_early], expected, [gaps] * 2, [tops] * 2,
                           "bfloat16")
    assert all(p.ok for p in run.prompts) and run.share == 0.5 and not run.ok
    assert "under the 75% that must be compared" in run.summary()
    late_tie = [1.0] * 6 + [0.05, 1.0]
    gaps, tops = ties.gaps_and_tops(constructed_logits(expected[0], late_tie))
    parted_late = expected[0][:6] + [0, 0]
    run = ties.compare_run([expected[0], parted_late], expected, [gaps] * 2, [tops] * 2,
                           "bfloat16")
    assert run.ok and run.compared == 14 and "prompt 1 at 6 (near tie" in run.summary()
