"""Workstation boards' measured terms: a board's own compute_efficiency, and the per-second and
saturated-opening measurements of a real vLLM log that bench/real_run_steps.py fits them from."""
from __future__ import annotations

import csv
import dataclasses
import json
import sys
from pathlib import Path

import pytest

from policies.types import StepPlan
from runtime.specs import HardwareSpec
from sim.cost.gpu.cost_model import GPUCostModel

from factories import decode_plan, hardware_spec, model_spec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import real_run_steps  # noqa: E402

TERMS = dict(step_overhead_s=0.0, per_sequence_overhead_s=0.0)


def prefill_plan(tokens: int) -> StepPlan:
    return StepPlan(num_prefill_tokens=tokens, num_prefill_seqs=1,
                    prefill_attention_work=tokens * tokens, prefill_context_tokens=tokens,
                    sum_squared_prefill_chunks=tokens * tokens)


def test_a_boards_compute_efficiency_speeds_its_compute_bound_steps_only():
    board = hardware_spec("rtx-4090")
    plain = GPUCostModel(model_spec("llama-3.1-8b"),
                         dataclasses.replace(board, compute_efficiency=1.0), **TERMS)
    faster = GPUCostModel(model_spec("llama-3.1-8b"),
                          dataclasses.replace(board, compute_efficiency=2.0), **TERMS)
    # A 2,048-token prefill is compute-bound: nearly halved. An 8-sequence decode is not.
    prefill = faster.step_time(prefill_plan(2048)) / plain.step_time(prefill_plan(2048))
    decode = faster.step_time(decode_plan(8, 500)) / plain.step_time(decode_plan(8, 500))
    assert 0.5 < prefill < 0.6
    assert decode > 0.97


def test_compute_efficiency_applies_to_datacenter_boards_and_defaults_to_the_tables():
    # The Vidur tables' path, whose transfer to a board the efficiency scales.
    a100 = hardware_spec("a100-80gb")
    assert a100.compute_efficiency == 1.0
    measured = GPUCostModel(model_spec("llama-3-8b"), a100, kernel_tables="vidur", **TERMS)
    scaled = GPUCostModel(model_spec("llama-3-8b"),
                          dataclasses.replace(a100, compute_efficiency=1.5),
                          kernel_tables="vidur", **TERMS)
    assert scaled.step_time(prefill_plan(2048)) < 0.8 * measured.step_time(prefill_plan(2048))


def test_a_nonpositive_compute_efficiency_is_named():
    fields = dataclasses.asdict(hardware_spec("rtx-4090"))
    with pytest.raises(ValueError, match="compute_efficiency"):
        HardwareSpec(**{**fields, "compute_efficiency": 0.0})


def write_run(folder: Path, requests: list[dict], ticks: list[dict], max_num_seqs: int = 256):
    """A run folder as data/real-runs/llmservingsim/ holds it (the fields the bench reads)."""
    folder.mkdir()
    (folder / "vllm_meta.json").write_text(json.dumps({
        "model": "meta-llama/Llama-3.1-8B", "started_at": "2026-01-01T00:00:00Z",
        "engine_kwargs": {"tensor_parallel_size": 1, "max_num_seqs": max_num_seqs,
                          "max_num_batched_tokens": 2048}}))
    (folder / "config.json").write_text(json.dumps(
        {"nodes": [{"instances": [{"hardware": "RTX4090"}]}]}))
    with open(folder / "vllm_requests.jsonl", "w") as file:
        for r in requests:
            file.write(json.dumps(r) + "\n")
    with open(folder / "vllm_timeseries.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, ["t", "prompt_throughput", "gen_throughput", "running",
                                       "waiting", "kv_cache_pct"])
        writer.writeheader()
        writer.writerows(ticks)


START = 1767225600.0   # 2026-01-01T00:00:00Z, the run's log clock; requests use the same


def request(queued: float, scheduled: float, first: float, last: float, prompt: int = 1000,
            output: int = 101) -> dict:
    return {"input_toks": prompt, "output_toks": output, "arrival_time": START + queued,
            "queued_ts": START + queued, "scheduled_ts": START + scheduled,
            "first_token_ts": START + first, "last_token_ts": START + last}


def tick(t: float, running: int, waiting: int = 0, gen: float = 500.0, prompt: float = 0.0,
         kv: float = 50.0) -> dict:
    return {"t": t, "prompt_throughput": prompt, "gen_throughput": gen, "running": running,
            "waiting": waiting, "kv_cache_pct": kv}


def test_a_decode_second_counts_the_logs_running_not_the_preempted(tmp_path):
    # Ten requests decode from 0 to 20 s by their first and last tokens, but the log says only
    # six ran in seconds 5-10 (four were preempted and waited): the step is 6 / tokens a second.
    requests = [request(0, 0, 0, 20) for _ in range(10)]
    ticks = [tick(t, 10, gen=500) for t in range(1, 5)]
    ticks += [tick(t, 6, waiting=4, gen=300, kv=99) for t in range(5, 11)]
    write_run(tmp_path / "run", requests, ticks)
    model = real_run_steps.cost_model_of(tmp_path / "run", {})
    rows = {row["t"]: row for row in real_run_steps.seconds(tmp_path / "run", model)}
    assert rows[3.0]["decodes"] == 10 and rows[3.0]["real_step_ms"] == pytest.approx(20.0)
    assert rows[7.0]["decodes"] == 6 and rows[7.0]["real_step_ms"] == pytest.approx(20.0)


def test_a_seconds_prompt_tokens_go_into_as_many_steps_as_it_had_prompts(tmp_path):
    # Ten requests decode all along; one more prompt of 1,000 tokens got its first token in the
    # third second: of that second's 50 steps one carried the prompt, 49 were decodes only.
    requests = [request(0, 0, 0, 20) for _ in range(10)] + [request(2.1, 2.2, 2.5, 20)]
    ticks = [tick(t, 10, gen=500, prompt=1000.0 if t == 3 else 0.0) for t in range(1, 5)]
    write_run(tmp_path / "run", requests, ticks)
    model = real_run_steps.cost_model_of(tmp_path / "run", {})
    row = {row["t"]: row for row in real_run_steps.seconds(tmp_path / "run", model)}[3.0]
    context = row["context"]
    prompt = StepPlan(num_decode_seqs=10, decode_context_tokens=context, num_prefill_tokens=1000,
                      num_prefill_seqs=1,
                      prefill_attention_work=1000 * (1000 + real_run_steps.PREFILL_CONTEXT),
                      prefill_context_tokens=1000 + real_run_steps.PREFILL_CONTEXT,
                      sum_squared_prefill_chunks=1000 * 1000)
    decodes = StepPlan(num_decode_seqs=10, decode_context_tokens=context)
    assert row["busy_s"] == pytest.approx(model.step_time(prompt) + 49 * model.step_time(decodes))


def backlog_run(folder: Path, pressure_at: float | None = None, spacing: float = 0.2) -> Path:
    """Requests of 2,000 prompt tokens queued at once, each waiting to be scheduled, prefilled
    `spacing` seconds apart (10,000 prompt tokens a second at 0.2 s)."""
    requests = [request(0.0, spacing * i + spacing / 2, spacing * (i + 1), 30.0, prompt=2000)
                for i in range(12)]
    ticks = [tick(t, 12, waiting=1, prompt=10000, kv=99.0 if pressure_at and t >= pressure_at
                  else 50.0) for t in range(1, 4)]
    folder.mkdir(parents=True, exist_ok=True)
    write_run(folder / "run", requests, ticks)
    return folder / "run"


def test_the_saturated_opening_is_the_backlogs_prompt_rate(tmp_path):
    window = real_run_steps.saturated_prefill(backlog_run(tmp_path))
    # Requests 1-11 got their first tokens 0.2 s apart after request 0's: 11 prompts in 2.2 s.
    assert window["seconds"] == pytest.approx(2.2)
    assert window["prompt_tokens"] == 11 * 2000
    assert window["token_budget"] == 2048


def test_the_saturated_opening_ends_before_kv_pressure(tmp_path):
    # From tick 3 (the second 2-3 s) the cache is under pressure: only first tokens before 2 s,
    # the ninth request's at 1.8 s the last.
    window = real_run_steps.saturated_prefill(backlog_run(tmp_path, pressure_at=3))
    assert window["seconds"] == pytest.approx(1.6)
    assert window["prompt_tokens"] == 8 * 2000


def test_no_saturated_opening_without_a_backlog(tmp_path):
    requests = [request(0.5 * i, 0.5 * i, 0.5 * i + 0.1, 30.0) for i in range(12)]
    write_run(tmp_path / "run", requests, [tick(t, 5) for t in range(1, 4)])
    assert real_run_steps.saturated_prefill(tmp_path / "run") is None


def test_the_fitted_compute_efficiency_reproduces_the_opening(tmp_path):
    folder = backlog_run(tmp_path / "slow")
    window = real_run_steps.saturated_prefill(folder)
    fitted = real_run_steps.fitted_compute_efficiency(folder, {})
    model = real_run_steps.cost_model_of(folder, {}, compute_efficiency=fitted)
    assert real_run_steps.predicted_saturated_s(window, model) == pytest.approx(
        window["seconds"], rel=1e-3)
    # The same backlog computed in three quarters of the time needs a higher share.
    faster = real_run_steps.fitted_compute_efficiency(
        backlog_run(tmp_path / "fast", spacing=0.15), {})
    assert faster > 1.2 * fitted


def test_a_prefix_cached_log_without_cached_counts_measures_no_compute(tmp_path, capsys):
    folder = backlog_run(tmp_path)
    assert real_run_steps.uncomputed_prompts(folder) is None
    meta = json.loads((folder / "vllm_meta.json").read_text())
    meta["kv_cache"] = {"enable_prefix_caching": True}
    (folder / "vllm_meta.json").write_text(json.dumps(meta))
    assert "include cache hits" in real_run_steps.uncomputed_prompts(folder)
    real_run_steps.main([str(folder), "--fit-compute"])
    assert "compute_efficiency not measurable: prefix caching was on" in capsys.readouterr().out
    real_run_steps.main([str(folder), "--fit-compute", "--count-cached-prompts"])
    assert "saturated opening 2.20 s" in capsys.readouterr().out
    rows = [json.loads(line) for line in (folder / "vllm_requests.jsonl").open()]
    (folder / "vllm_requests.jsonl").write_text(
        "".join(json.dumps({**r, "num_cached_tokens": 0}) + "\n" for r in rows))
    assert real_run_steps.uncomputed_prompts(folder) is None


def test_the_opening_counts_only_the_prompt_tokens_the_prefix_cache_did_not_serve(tmp_path):
    # Requests 1-11 start with 100 of request 0's 125 blocks: 1,600 of their 2,000 tokens
    # were served by the prefix cache (its workload file's hash_ids say so).
    folder = backlog_run(tmp_path)
    meta = json.loads((folder / "vllm_meta.json").read_text())
    meta.update(kv_cache={"enable_prefix_caching": True}, dataset_path="workloads/w.jsonl")
    (folder / "vllm_meta.json").write_text(json.dumps(meta))
    shared = list(range(100))
    (tmp_path / "w.jsonl").write_text("".join(
        json.dumps({"input_toks": 2000, "output_toks": 101, "arrival_time_ns": 0,
                    "hash_ids": shared + [1000 * (i + 1) + k for k in range(25)]}) + "\n"
        for i in range(12)))
    assert real_run_steps.uncomputed_prompts(folder) is None
    window = real_run_steps.saturated_prefill(folder)
    assert window["prompt_tokens"] == 11 * 400
    assert window["cached_prompt_tokens"] == 11 * 1600


def test_describe_names_a_boards_compute_efficiency():
    board = hardware_spec("rtx-4090")
    assert "compute_efficiency 1.86" in GPUCostModel(
        model_spec("llama-3.1-8b"), dataclasses.replace(board, compute_efficiency=1.86),
        **TERMS).describe()["linear"]
    assert "compute_efficiency" not in GPUCostModel(
        model_spec("llama-3.1-8b"), dataclasses.replace(board, compute_efficiency=1.0),
        **TERMS).describe()["linear"]
