"""The profiled cost model and twinserve-validate (sim/cost/profiled/cost_model.py,
calibration/validate/)."""
from __future__ import annotations

import csv
import dataclasses
import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import open_dict

import sim.core.experiment
from policies.types import StepPlan
from calibration.profiler.fit import fit_profile
from sim.cost.profiled.cost_model import ProfiledCostModel, ProfileError
from sim.core.settings import ReplicaSettings
from sim.core.speculation_setup import speculation_setup
from sim.core.experiment import run_experiment
from sim.cost.profiled.step_features import STEP_FEATURES, step_features
from calibration.validate.cli import main, parse_args
from calibration.validate.compare import (DEFAULT_GATES, GATED_BY, METRICS, UNSET,
                                              add_engine_noise, check_gates, compare_summaries,
                                              error_pct, mean_summary, resolve_gates)
from calibration.validate.grid import (GRID_METRICS, grid_markdown, grid_rows, grid_summary,
                                          tabulate)
from calibration.validate.report import read_latencies_ms
from calibration.validate.sweep import expand_sweep, swept_values

from factories import make_cfg

torch.set_num_threads(1)

# Features not named here (the attention-tile ones, which FakePlan cannot have) cost nothing.
COEFFS = {name: 0.0 for name in STEP_FEATURES} | {
    "num_prefill_tokens": 1e-4, "num_prefill_seqs": 2e-4, "sum_squared_prefill_chunks": 1e-7,
    "prefill_attention_work": 5e-8, "num_decode_seqs": 3e-4, "decode_context_tokens": 1e-6,
    "num_blocks_copied": 1e-5, "num_blocks_swapped": 2e-5}


def write_profile(path: Path, intercept=2e-3, coefficients=None, samples=(-0.1, 0.0, 0.2),
                  ranges=None, **changes) -> Path:
    profile = {
        "schema": 1, "metadata": {"device": "test"}, "features": list(STEP_FEATURES),
        "model": {"kind": "linear", "intercept_s": intercept,
                  "coefficients_s": dict(coefficients or COEFFS)},
        "residuals": {"kind": "relative", "samples": list(samples)},
        "feature_ranges": ranges if ranges is not None else
        {name: [0.0, 1e9] for name in STEP_FEATURES},
        "fit": {},
    }
    profile.update(changes)
    path.write_text(json.dumps(profile))
    return path


class FakePlan:
    """The StepPlan aggregates step_features and the profiled cost model read."""

    def __init__(self, prefill_tokens=0, prefill_seqs=0, sq=0, attn=0, decode_seqs=0,
                 decode_ctx=0, copies=0, swaps=0):
        self.num_prefill_tokens, self.num_prefill_seqs = prefill_tokens, prefill_seqs
        self.sum_squared_prefill_chunks, self.prefill_attention_work = sq, attn
        self.num_decode_seqs, self.decode_context_tokens = decode_seqs, decode_ctx
        self.blocks_to_copy = [(0, 1)] * copies
        self.blocks_to_swap_out, self.blocks_to_swap_in = [(0, 1)] * swaps, []
        self.blocks_to_offload, self.blocks_to_load = [], []   # the prefix cache's host tier
        self.seqs, self.num_new_tokens, self.spec_lens = [], [], {}
        self.num_draft_tokens = self.max_draft_len = self.draft_catch_up_tokens = 0


PLAN = FakePlan(prefill_tokens=100, prefill_seqs=2, sq=5000, attn=2000, decode_seqs=8,
                decode_ctx=800, copies=1, swaps=2)


def linear(plan) -> float:
    return 2e-3 + sum(COEFFS[n] * x for n, x in zip(STEP_FEATURES, step_features(plan)))


# ---- error computation and gates ---------------------------------------------------------------

def synthetic_summary(scale: float = 1.0, **changes) -> dict:
    summary = {name: 10.0 * scale for name in METRICS}
    summary.update(changes)
    return summary


def test_error_is_signed_relative_to_the_engine():
    assert error_pct(100.0, 110.0) == pytest.approx(10.0)
    assert error_pct(100.0, 97.0) == pytest.approx(-3.0)
    assert error_pct(0, 0) == 0.0
    assert error_pct(0, 5) is None
    metrics = compare_summaries(synthetic_summary(), synthetic_summary(1.05, num_preemptions=8))
    assert set(metrics) == set(METRICS)
    assert metrics["p99_ttft_ms"] == {"engine": 10.0, "sim": 10.5,
                                      "error_pct": pytest.approx(5.0)}
    assert metrics["num_preemptions"]["error_pct"] == pytest.approx(-20.0)


def test_metric_names_are_the_summary_keys_with_percentiles_from_the_runs():
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p90", "p99"):
            assert f"{stat}_{name}_ms" in METRICS
    for name in ("request_throughput", "output_throughput", "num_preemptions", "peak_kv_blocks",
                 "swap_bytes"):
        assert name in METRICS
    summary = run_experiment(make_cfg("workload.num_requests=30")).summary
    assert set(METRICS) <= set(summary)
    with pytest.raises(ValueError, match="lack"):
        compare_summaries({"mean_ttft_ms": 1.0}, summary)


def test_several_simulator_runs_predict_each_metric_by_its_mean():
    runs = [{"mean_ttft_ms": 10.0, "p99_ttft_ms": 30.0, "wall_time_s": 0.2, "completed": 5},
            {"mean_ttft_ms": 14.0, "p99_ttft_ms": 36.0, "wall_time_s": 0.4, "completed": 5}]
    mean = mean_summary(runs, ("mean_ttft_ms", "p99_ttft_ms"))
    assert mean == {"mean_ttft_ms": 12.0, "p99_ttft_ms": 33.0, "wall_time_s": pytest.approx(0.3),
                    "completed": 5}


def test_latencies_read_back_from_requests_csv_give_the_summary_percentiles(tmp_path):
    result = run_experiment(make_cfg("workload.num_requests=40"), tmp_path)
    latencies = read_latencies_ms(tmp_path / "requests.csv")
    for column, key in (("ttft_ms", "ttft"), ("e2el_ms", "e2el")):
        assert np.mean(latencies[column]) == pytest.approx(result.summary[f"mean_{key}_ms"])
        assert np.percentile(latencies[column], 99) == pytest.approx(result.summary[f"p99_{key}_ms"])


def test_gate_passes_within_and_fails_beyond_each_limit():
    engine = synthetic_summary()
    assert check_gates(compare_summaries(engine, synthetic_summary(1.02)), DEFAULT_GATES) == []
    # 4 % off: fails the 3 % mean gate, not the p99 (8 %, 10 %) or preemption (5 %) ones.
    failures = check_gates(compare_summaries(engine, synthetic_summary(1.04)), DEFAULT_GATES)
    failed = {line.split(":")[0] for line in failures}
    assert failed == {n for n, g in GATED_BY.items() if g == "mean_pct"}
    failed = {line.split(":")[0] for line in
              check_gates(compare_summaries(engine, synthetic_summary(1.06)), DEFAULT_GATES)}
    assert "num_preemptions" in failed and "p99_e2el_ms" not in failed
    # p99 TTFT has its own, looser gate.
    sim = dict(engine, p99_ttft_ms=10.9, p99_e2el_ms=10.9)
    failed = {line.split(":")[0] for line in
              check_gates(compare_summaries(engine, sim), DEFAULT_GATES)}
    assert failed == {"p99_e2el_ms"}
    # Engine 0, sim not: an infinite error fails; an ungated metric never fails; a gate can be off.
    sim = dict(engine, num_preemptions=3, peak_kv_blocks=99.0)
    assert check_gates(compare_summaries(dict(engine, num_preemptions=0), sim),
                       DEFAULT_GATES) == ["num_preemptions: inf (gate ±5 %, preemptions_pct)"]
    assert check_gates(compare_summaries(dict(engine, num_preemptions=0), sim),
                       dict(DEFAULT_GATES, preemptions_pct=None)) == []
    # Signed errors are gated on their size: -4 % fails like +4 %.
    failed = check_gates(compare_summaries(engine, dict(engine, mean_ttft_ms=9.6)), DEFAULT_GATES)
    assert failed == ["mean_ttft_ms: -4.000 % (gate ±3 %, mean_pct)"]


def test_gates_come_from_the_command_line_then_the_config_then_the_defaults():
    args = parse_args(["--gate-p99-pct=20", "--gate-preemptions-pct=off", "model=tiny-llama"])
    assert args.overrides == ["model=tiny-llama"] and args.gate_mean_pct is UNSET
    cli = {"mean_pct": args.gate_mean_pct, "p99_pct": args.gate_p99_pct,
           "p99_ttft_pct": args.gate_p99_ttft_pct, "preemptions_pct": args.gate_preemptions_pct}
    assert resolve_gates(cli) == dict(DEFAULT_GATES, p99_pct=20.0, preemptions_pct=None)
    config = {"gate_mean_pct": 1.5, "gate_p99_pct": 50}
    assert resolve_gates(cli, config) == dict(DEFAULT_GATES, mean_pct=1.5, p99_pct=20.0,
                                              preemptions_pct=None)
    with pytest.raises(ValueError, match="gate_mean_pct"):
        resolve_gates({}, {"gate_mean_pct": -1})


# ---- the grid ------------------------------------------------------------------------------------

def test_a_grid_is_every_combination_of_a_hydra_sweep():
    jobs = expand_sweep(["model=tiny-llama", "scheduler=continuous,chunked_prefill",
                         "workload.rate=2,inf", "kv_cache.block_size=range(16,48,16)"])
    assert len(jobs) == 2 * 2 * 2
    assert {tuple(sorted(job)) for job in jobs} == {
        tuple(sorted(["model=tiny-llama", f"scheduler={s}", f"workload.rate={r}",
                      f"kv_cache.block_size={b}"]))
        for s in ("continuous", "chunked_prefill") for r in ("2", "inf") for b in (16, 32)}
    swept = swept_values(jobs)
    assert all(set(values) == {"scheduler", "workload.rate", "kv_cache.block_size"}
               for values in swept)
    assert expand_sweep(["model=tiny-llama", "workload.rate=3"]) == [
        ["model=tiny-llama", "workload.rate=3"]]
    with pytest.raises(ValueError, match="bad override"):
        expand_sweep(["scheduler=[oops"])
    with pytest.raises(ValueError, match="interval"):
        expand_sweep(["workload.rate=interval(1,4)"])
    with pytest.raises(ValueError, match="glob"):
        expand_sweep(["scheduler=glob(*)"])


def test_grid_jobs_come_in_the_order_of_hydras_basic_sweeper():
    """The job numbers of a grid are those a `--multirun` of the same overrides gives: pinned
    from hydra's BasicSweeper.split_arguments (the last swept key varies fastest; a key given
    twice keeps its first place and its last values; fixed values are rewritten as Hydra
    writes them)."""
    jobs = expand_sweep(["model=tiny-llama", "scheduler=continuous,chunked_prefill",
                         "workload.rate=2,inf", "kv_cache.block_size=range(16,48,16)",
                         "workload.with_token_ids=true"])
    assert [job[1:4] for job in jobs] == [
        ["scheduler=continuous", "workload.rate=2", "kv_cache.block_size=16"],
        ["scheduler=continuous", "workload.rate=2", "kv_cache.block_size=32"],
        ["scheduler=continuous", "workload.rate=inf", "kv_cache.block_size=16"],
        ["scheduler=continuous", "workload.rate=inf", "kv_cache.block_size=32"],
        ["scheduler=chunked_prefill", "workload.rate=2", "kv_cache.block_size=16"],
        ["scheduler=chunked_prefill", "workload.rate=2", "kv_cache.block_size=32"],
        ["scheduler=chunked_prefill", "workload.rate=inf", "kv_cache.block_size=16"],
        ["scheduler=chunked_prefill", "workload.rate=inf", "kv_cache.block_size=32"]]
    assert all(job[0] == "model=tiny-llama" and job[4] == "workload.with_token_ids=True"
               for job in jobs)
    assert expand_sweep(["workload.rate=1,2", "scheduler=static,continuous",
                         "workload.rate=3,4,5", "+validate.gate_mean_pct=5",
                         "++workload.prompt_len={dist: uniform, low: 16, high: 256}"]) == [
        ["workload.rate=3", "scheduler=static", "+validate.gate_mean_pct=5",
         "++workload.prompt_len={dist:uniform,low:16,high:256}"],
        ["workload.rate=3", "scheduler=continuous", "+validate.gate_mean_pct=5",
         "++workload.prompt_len={dist:uniform,low:16,high:256}"],
        ["workload.rate=4", "scheduler=static", "+validate.gate_mean_pct=5",
         "++workload.prompt_len={dist:uniform,low:16,high:256}"],
        ["workload.rate=4", "scheduler=continuous", "+validate.gate_mean_pct=5",
         "++workload.prompt_len={dist:uniform,low:16,high:256}"],
        ["workload.rate=5", "scheduler=static", "+validate.gate_mean_pct=5",
         "++workload.prompt_len={dist:uniform,low:16,high:256}"],
        ["workload.rate=5", "scheduler=continuous", "+validate.gate_mean_pct=5",
         "++workload.prompt_len={dist:uniform,low:16,high:256}"]]


def test_grid_summary_takes_the_largest_error_over_the_jobs():
    engine = synthetic_summary()
    results = []
    for scale, preemptions in ((1.02, 10.0), (0.95, 10.0), (1.0, 0.0)):
        metrics = compare_summaries(engine, synthetic_summary(scale, num_preemptions=preemptions))
        results.append({"metrics": metrics, "passed": not check_gates(metrics, DEFAULT_GATES),
                        "speedup": 50.0, "engine_wall_time_s": 10.0, "sim_wall_time_s": 0.2})
    summary = grid_summary(results)
    assert summary["max_abs_error_pct"]["mean_ttft_ms"] == pytest.approx(5.0)
    assert summary["mean_abs_error_pct"]["mean_ttft_ms"] == pytest.approx(7.0 / 3)
    assert summary["max_abs_error_pct"]["num_preemptions"] == pytest.approx(100.0)
    # The mean signed error: a bias over the jobs, where errors of both signs cancel.
    assert summary["mean_error_pct"]["mean_ttft_ms"] == pytest.approx(-1.0)
    assert summary["num_passed"] == 1 and summary["num_jobs"] == 3
    assert summary["speedup"] == pytest.approx(50.0)
    swept = [{"workload.rate": r} for r in ("2", "8", "inf")]
    rows = grid_rows(results, swept)
    assert [row["workload.rate"] for row in rows] == ["2", "8", "inf"]
    assert rows[1]["mean_tpot_ms_error_pct"] == pytest.approx(-5.0)
    text = grid_markdown(rows, summary, ["workload.rate"], "twinserve-validate ...")
    lines = [line for line in text.splitlines() if line.startswith("|")]
    assert len(lines) == 2 + 3 + 2  # header, rule, one row per job, the mean and max rows
    assert "-5.00" in lines[3] and lines[-1].startswith("| max")
    assert lines[-2].startswith("| mean") and "-1.00" in lines[-2]
    assert len(lines[-2].split("|")) == len(lines[0].split("|"))
    assert len(lines[0].split("|")) == len(lines[-1].split("|")) == 2 + 1 + len(GRID_METRICS) + 4



def test_tabulate_makes_one_table_of_validations_run_before(tmp_path):
    """--tabulate: repeats of a few workloads, each validated before, in one grid table with the
    mean signed error over them; a directory without a validation.json is a clear error."""
    directories = []
    for index, scale in enumerate((1.02, 1.005, 1.04)):
        # Against engines that ran 10 ms, 10.4 ms and 9.6 ms in three rounds.
        engine = synthetic_summary((1.0, 1.04, 0.96)[index])
        metrics = add_engine_noise(compare_summaries(engine, synthetic_summary(scale)),
                                   [engine, engine], DEFAULT_GATES)
        directory = tmp_path / f"run{index}" / "workload"
        directory.mkdir(parents=True)
        (directory / "validation.json").write_text(json.dumps(
            {"metrics": metrics, "passed": scale < 1.03, "speedup": 20.0,
             "engine_wall_time_s": 4.0, "sim_wall_time_s": 0.2, "gates": DEFAULT_GATES,
             "overrides": ["workload.rate=4"], "profile": "p.json",
             "failures": [] if scale < 1.03 else ["mean_ttft_ms"]}))
        directories.append(directory)
    out = tmp_path / "table"
    assert main(["--tabulate", "--out", str(out), *map(str, directories)]) == 0
    grid = json.loads((out / "grid.json").read_text())
    assert [row["validation"] for row in grid["jobs"]] == [str(d) for d in directories]
    errors = [(scale / engine - 1) * 100 for scale, engine in ((1.02, 1.0), (1.005, 1.04),
                                                                (1.04, 0.96))]
    assert grid["summary"]["mean_error_pct"]["mean_ttft_ms"] == pytest.approx(np.mean(errors))
    assert grid["summary"]["max_abs_error_pct"]["mean_ttft_ms"] == pytest.approx(
        max(map(abs, errors)))
    # One workload in three rounds: the engine's spread over all six of its runs, and each
    # round's verdict against it: +2.0 % within the gate, -3.4 % within the ±4 % spread, +8.3 %
    # outside both.
    (repeats,) = grid["repeats"]
    metric = repeats["metrics"]["mean_ttft_ms"]
    assert repeats["jobs"] == [0, 1, 2] and metric["num_engine_runs"] == 6
    assert metric["errors_pct"] == pytest.approx(errors)
    assert metric["engine_spread_pct"] == pytest.approx(4.0)
    assert metric["verdicts"] == ["within gate", "within engine noise", "outside both"]
    assert list(grid["failures"]) == ["2"]
    markdown = (out / "grid.md").read_text()
    assert "| mean |" in markdown and "run1/workload" in markdown
    assert "| 0, 1, 2 |" in markdown and "±4.00, 2/3)" in markdown
    with open(out / "grid.csv") as file:
        assert len(list(csv.DictReader(file))) == 3
    assert main(["--tabulate", "--out", str(tmp_path / "bad"), str(tmp_path / "missing")]) == 2
    with pytest.raises(ValueError, match="needs the directories"):
        tabulate([], tmp_path / "none", "twinserve-validate --tabulate")

# ---- the profiled cost model -------------------------------------------------------------------

def test_mean_prediction_is_the_linear_function(tmp_path):
    model = ProfiledCostModel(str(write_profile(tmp_path / "p.json")), sample_residuals=False)
    assert model.step_time(PLAN) == pytest.approx(linear(PLAN), rel=1e-12)
    assert model.step_time(FakePlan(decode_seqs=1, decode_ctx=10)) == pytest.approx(
        2e-3 + 3e-4 + 1e-5, rel=1e-12)
    assert model.step_time(FakePlan()) == 0.0
    # Never negative, even where a fit's intercept is.
    negative = ProfiledCostModel(str(write_profile(tmp_path / "n.json", intercept=-1.0)),
                                 sample_residuals=False)
    assert negative.step_time(PLAN) == 0.0


def test_residuals_are_drawn_from_the_profile_seeded(tmp_path):
    samples = (-0.2, 0.1, 0.5)
    path = str(write_profile(tmp_path / "p.json", samples=samples))
    draws = [ProfiledCostModel(path, seed=3).step_time(PLAN)]
    model = ProfiledCostModel(path, seed=3)
    times = np.array([model.step_time(PLAN) for _ in range(3000)])
    assert times[0] == draws[0]
    ratios = times / linear(PLAN) - 1
    assert set(np.round(ratios, 9)) == set(samples)
    assert ratios.mean() == pytest.approx(np.mean(samples), abs=0.02)
    again = ProfiledCostModel(path, seed=3)
    assert [again.step_time(PLAN) for _ in range(3000)] == times.tolist()
    other = ProfiledCostModel(path, seed=4)
    assert [other.step_time(PLAN) for _ in range(3000)] != times.tolist()


def test_out_of_range_extrapolates_and_warns_once(tmp_path, caplog):
    ranges = {name: [0.0, 10.0] for name in STEP_FEATURES}
    ranges["decode_context_tokens"] = [0.0, 100.0]
    path = str(write_profile(tmp_path / "p.json", ranges=ranges))
    model = ProfiledCostModel(path, sample_residuals=False)
    inside = FakePlan(decode_seqs=2, decode_ctx=50)
    outside = FakePlan(decode_seqs=2, decode_ctx=5000)
    with caplog.at_level(logging.WARNING, logger="sim.cost.profiled.cost_model"):
        model.step_time(inside)
        assert not caplog.records
        for _ in range(5):
            assert model.step_time(outside) == pytest.approx(linear(outside), rel=1e-12)
    (record,) = caplog.records
    assert "decode_context_tokens" in record.getMessage() and "[0, 100]" in record.getMessage()


@pytest.mark.parametrize("change, match", [
    ({"schema": 2}, "schema"),
    ({"features": list(STEP_FEATURES[:-1])}, "features"),
    ({"features": list(reversed(STEP_FEATURES))}, "features"),
    ({"model": {"kind": "mlp"}}, "linear"),
    ({"model": {"kind": "linear", "intercept_s": 0.0, "coefficients_s": {"x": 1.0}}},
     "coefficients_s"),
    ({"residuals": {"kind": "relative", "samples": [-1.5]}}, "residual"),
])
def test_bad_profile_is_a_clear_error(tmp_path, change, match):
    with pytest.raises(ProfileError, match=match):
        ProfiledCostModel(str(write_profile(tmp_path / "p.json", **change)))


def test_missing_profile_is_a_clear_error(tmp_path):
    with pytest.raises(ProfileError, match="no such file"):
        ProfiledCostModel(str(tmp_path / "nope.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ProfileError, match="JSON"):
        ProfiledCostModel(str(tmp_path / "bad.json"))


def test_twinserve_runs_with_the_profiled_cost_model(tmp_path):
    path = write_profile(tmp_path / "p.json")
    overrides = ("cost_model=profiled", f"cost_model.profile={path}", "workload.num_requests=50")
    first = run_experiment(make_cfg(*overrides), tmp_path / "run")
    assert first.summary["completed"] == 50 and first.summary["mean_tpot_ms"] > 0
    assert (tmp_path / "run" / "summary.json").exists()
    again = run_experiment(make_cfg(*overrides)).summary
    assert again["mean_ttft_ms"] == first.summary["mean_ttft_ms"]
    reseeded = run_experiment(make_cfg(*overrides, "seed=1")).summary
    assert reseeded["mean_ttft_ms"] != first.summary["mean_ttft_ms"]


# ---- end to end on the tiny Llama --------------------------------------------------------------

TINY = ["model=tiny-llama", "hardware=cpu", "workload.with_token_ids=true",
        "++workload.prompt_len={dist: uniform, low: 8, high: 64}",
        "++workload.output_len={dist: uniform, low: 4, high: 16}",
        "kv_cache.num_blocks=24", "kv_cache.block_size=4"]


def fit_profile_on_engine_steps(tmp_path: Path, monkeypatch) -> Path:
    """A profile fitted (by the profiler's fit) on the steps of an engine run of a DIFFERENT seed and
    workload than the validated one: the simulator never sees the validated run's measurements."""
    rows: list[tuple[tuple[float, ...], float]] = []
    original = sim.core.experiment.build_replica_executor

    class Recording:
        def __init__(self, inner):
            self.inner = inner

        def execute(self, plan: StepPlan):
            result = self.inner.execute(plan)
            rows.append((step_features(plan), result.duration))
            return result

        def __getattr__(self, name):
            return getattr(self.inner, name)

    with monkeypatch.context() as patch:
        patch.setattr(sim.core.experiment, "build_replica_executor",
                      lambda *args, **kwargs: Recording(original(*args, **kwargs)))
        # Busier than the validated run (more requests, faster, a bigger pool): the fit covers
        # the batch sizes the validated run reaches instead of extrapolating to them.
        run_experiment(make_cfg("backend=engine", *TINY, "seed=123", "workload.num_requests=32",
                                "workload.rate=80", "kv_cache.num_blocks=64"))
    samples = [dict(zip(STEP_FEATURES, features), duration_s=duration)
               for features, duration in rows if any(features) and duration > 0]
    profile = fit_profile(samples, metadata={"device_type": "cpu", "threads": 1,
                                             "torch_version": torch.__version__})
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(profile))
    return path


# Wall-clock accuracy is measured by `make validate-grid` (the machine's load decides it); gate
# logic is tested on fixed numbers above and on simulator stand-ins below. The end-to-end runs
# on the real engine, a profile fitted seconds before on the same machine, keep loose gates
# that a broken profile, cost model or clock still fails (a simulator 5x too slow; 5x too fast
# is asserted beside them). Measured on 2 shared cores at load 10: over four single runs,
# |error| up to 39 % on means and 42 % on p99s, one run past 60 %; 42 % on mean TPOT and 54 %
# on p99 TPOT in the chunked-prefill grid job; in CI on 2026-12-07 (the other test worker busy)
# median TTFT +199 % with mean TPOT +15 %: a median of 12 requests' TTFTs is one request's
# queueing.
LOOSE_GATES = ["--gate-mean-pct=400", "--gate-p99-pct=400", "--gate-p99-ttft-pct=400",
               "--gate-preemptions-pct=off"]
# The grid test checks the grid's table, not the fit: its jobs of six requests (a p99 is one
# request's time) came out +136 % on p99 TTFT at load in CI, so it gates nothing.
NO_GATES = ["--gate-mean-pct=off", "--gate-p99-pct=off", "--gate-p99-ttft-pct=off",
            "--gate-preemptions-pct=off"]


def test_small_validate_on_the_tiny_llama(tmp_path, monkeypatch, capsys):
    profile = fit_profile_on_engine_steps(tmp_path, monkeypatch)
    # Fitted on one sample per step shape, the profile has no spread of its own: give it some,
    # so that the simulator's runs draw different step times.
    content = json.loads(profile.read_text())
    content["residuals"]["samples"] = [-0.1, 0.0, 0.1]
    profile.write_text(json.dumps(content))
    overrides = [*TINY, "workload.num_requests=12", "workload.rate=20", f"--profile={profile}"]
    assert main([*overrides, f"--out={tmp_path / 'loose'}", "--sim-runs=3", *LOOSE_GATES]) == 0
    result = json.loads((tmp_path / "loose" / "validation.json").read_text())
    assert set(result["metrics"]) == set(METRICS)
    for values in result["metrics"].values():
        assert set(values) == {"engine", "sim", "error_pct"}
    # Three simulator runs of the same workload with their own draws; the prediction is their
    # mean.
    assert result["sim_runs"] == 3 and result["sim_seeds"] == [0, 1, 2]
    sims = [json.loads((tmp_path / "loose" / folder / "summary.json").read_text())
            for folder in ("sim", "sim-run1", "sim-run2")]
    tpots = [summary["mean_tpot_ms"] for summary in sims]
    assert len(set(tpots)) == 3
    assert result["metrics"]["mean_tpot_ms"]["sim"] == pytest.approx(np.mean(tpots))
    prompts = [[row["prompt_len"] for row in csv.DictReader(
        open(tmp_path / "loose" / folder / "requests.csv"))] for folder in ("sim", "sim-run2")]
    assert prompts[0] == prompts[1]
    assert result["completed"] == {"engine": 12, "sim": 12}
    assert result["engine_conditions"]["threads"] == 1
    # A profile without a speed reference: the engine's steps are timed as measured.
    assert result["engine_conditions"]["clock"] == "wall"
    assert result["speedup"] > 1 and result["failures"] == []
    assert result["gates"] == {"mean_pct": 400.0, "p99_pct": 400.0, "p99_ttft_pct": 400.0,
                               "preemptions_pct": None}
    for name in ("mean_ttft_ms", "mean_tpot_ms", "mean_e2el_ms", "request_throughput"):
        assert abs(result["metrics"][name]["error_pct"]) <= 400, name   # what the gate claims
    for name in ("mean_tpot_ms", "mean_e2el_ms"):   # nor 5x too fast
        assert result["metrics"][name]["sim"] >= result["metrics"][name]["engine"] / 5, name
    preemptions = result["metrics"]["num_preemptions"]
    assert (preemptions["error_pct"] is None) == (preemptions["engine"] == 0 != preemptions["sim"])
    ttft = result["metrics"]["mean_ttft_ms"]
    assert ttft["error_pct"] == pytest.approx((ttft["sim"] - ttft["engine"]) / ttft["engine"] * 100)
    for name in ("validation.md", "validation_cdf.png", "engine/summary.json",
                 "sim/requests.csv"):
        assert (tmp_path / "loose" / name).exists()
    assert "mean_ttft_ms" in (tmp_path / "loose" / "validation.md").read_text()

    tight = ["--gate-mean-pct=0.0001", "--gate-p99-pct=0.0001", "--gate-p99-ttft-pct=0.0001",
             "--gate-preemptions-pct=0.0001"]
    assert main([*overrides, f"--out={tmp_path / 'tight'}", *tight]) == 1
    assert "gate failed" in capsys.readouterr().err
    assert json.loads((tmp_path / "tight" / "validation.json").read_text())["failures"]


def engine_replaced_by_scaled_simulator(monkeypatch, time_factor: float) -> None:
    """The "engine" of a validation becomes the simulator with the same profile, every step
    taking `time_factor` times the profile's time: a backend with a known bias."""
    engine_replaced_by_noisy_scaled_simulator(monkeypatch, [time_factor])


# The simulator 10 % slow against its engine (the engine's steps / 1.1) is +10 % on every
# latency and -9.1 % on throughput; the engine 10 % slow is -9.1 % on latencies, +10 % on
# throughput.
@pytest.mark.parametrize("engine_time_factor", [1 / 1.1, 1.1])
def test_validation_reports_a_known_bias_of_the_engine(tmp_path, monkeypatch, capsys,
                                                       engine_time_factor):
    engine_replaced_by_scaled_simulator(monkeypatch, engine_time_factor)
    # No residual spread: both sides take the profile's mean step time, so with every request
    # arriving at t = 0 they schedule the same steps and only the clock differs.
    profile = write_profile(tmp_path / "p.json", samples=(0.0,))
    out = tmp_path / "biased"
    assert main([*TINY, "workload.num_requests=12", "workload.rate=inf", f"--profile={profile}",
                 f"--out={out}", "--sim-runs=1"]) == 1
    assert "gate failed" in capsys.readouterr().err
    result = json.loads((out / "validation.json").read_text())
    metrics = result["metrics"]
    latency_bias = (1 / engine_time_factor - 1) * 100
    throughput_bias = (engine_time_factor - 1) * 100
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p99"):
            assert metrics[f"{stat}_{name}_ms"]["error_pct"] == pytest.approx(latency_bias,
                                                                           abs=0.5), name
    for name in ("request_throughput", "output_throughput"):
        assert metrics[name]["error_pct"] == pytest.approx(throughput_bias, abs=0.5), name
    # Counts do not depend on the clock: the same steps on both sides.
    assert metrics["num_preemptions"]["engine"] > 0
    for name in ("num_preemptions", "peak_kv_blocks"):
        assert metrics[name]["error_pct"] == 0.0, name
    assert result["completed"] == {"engine": 12, "sim": 12}
    failed = {line.split(":")[0] for line in result["failures"]}
    assert {"mean_ttft_ms", "mean_tpot_ms", "mean_e2el_ms", "request_throughput"} <= failed
    assert "num_preemptions" not in failed


def add_speed_reference(profile: Path) -> None:
    """The profile's speed reference, measured as the profiler does (cpu_noise/speed.py)."""
    from calibration.cpu_noise.engine_timing import build_speed_probe
    from engine.builder import executor_builder
    from engine.model_loader import load_model
    from calibration.cpu_noise.speed import normalize_samples

    device = torch.device("cpu")
    probe = build_speed_probe(executor_builder(load_model("tiny-llama", device, None, 0), device))
    for _ in range(3):
        probe.measure()
    content = json.loads(profile.read_text())
    content["speed_reference"] = normalize_samples([], probe)
    profile.write_text(json.dumps(content))


def test_validation_grid_runs_every_job_and_writes_one_table(tmp_path, monkeypatch):
    profile = fit_profile_on_engine_steps(tmp_path, monkeypatch)
    add_speed_reference(profile)   # the engine's steps are timed at the profile's speed
    assert main([*TINY, "workload.num_requests=6", "workload.rate=20",
                 "scheduler=continuous,chunked_prefill", f"--profile={profile}",
                 f"--out={tmp_path / 'grid'}", *NO_GATES]) == 0
    grid = json.loads((tmp_path / "grid" / "grid.json").read_text())
    assert grid["summary"]["num_jobs"] == 2
    assert [job["scheduler"] for job in grid["jobs"]] == ["continuous", "chunked_prefill"]
    jobs = [json.loads((tmp_path / "grid" / str(job) / "validation.json").read_text())
            for job in (0, 1)]
    assert [job["overrides"][-2] for job in jobs] == ["scheduler=continuous",
                                                      "scheduler=chunked_prefill"]
    # The grid's table holds each job's own errors, and its worst error is theirs.
    for row, job in zip(grid["jobs"], jobs):
        for name in GRID_METRICS:
            assert row[f"{name}_error_pct"] == job["metrics"][name]["error_pct"], name
        assert row["speedup"] == job["speedup"]
    for name in METRICS:
        errors = [job["metrics"][name]["error_pct"] for job in jobs]
        assert grid["summary"]["max_abs_error_pct"][name] == max(
            math.inf if error is None else abs(error) for error in errors), name
    with open(tmp_path / "grid" / "grid.csv") as file:
        assert len(file.read().strip().splitlines()) == 1 + 2
    assert "chunked_prefill" in (tmp_path / "grid" / "grid.md").read_text()
    job = json.loads((tmp_path / "grid" / "0" / "validation.json").read_text())
    conditions = job["engine_conditions"]
    assert conditions["clock"] == "profile speed" and conditions["speed_probes"] >= 1
    assert 0 < conditions["speed_factor_p05"] <= conditions["speed_factor_p95"]
    engine = json.loads((tmp_path / "grid" / "0" / "engine" / "summary.json").read_text())
    assert engine["speed_probes"] == conditions["speed_probes"]
    assert "profile's machine speed" in (tmp_path / "grid" / "0" / "validation.md").read_text()
    assert all(job["speed_factor"] > 0 for job in grid["jobs"])


def test_validate_bad_input_exits_2(tmp_path, capsys):
    assert main([*TINY, f"--out={tmp_path}"]) == 2  # no profile
    assert "profile" in capsys.readouterr().err
    assert main([*TINY, f"--profile={tmp_path / 'missing.json'}", f"--out={tmp_path}"]) == 2
    assert "no such file" in capsys.readouterr().err
    profile = write_profile(tmp_path / "p.json")
    assert main([*TINY, "backend=sim", f"--profile={profile}", f"--out={tmp_path}"]) == 2
    assert main(["model=no-such-model", f"--profile={profile}", f"--out={tmp_path}"]) == 2
    assert main([*TINY, "+validate.gate_mean_pct=-1", f"--profile={profile}",
                 f"--out={tmp_path}"]) == 2
    assert "gate_mean_pct" in capsys.readouterr().err
    assert main([*TINY, "--sim-runs=0", f"--profile={profile}", f"--out={tmp_path}"]) == 2
    assert "sim_runs must be an integer >= 1" in capsys.readouterr().err
    bad = write_profile(tmp_path / "bad.json", schema=7)
    assert main([*TINY, f"--profile={bad}", f"--out={tmp_path}"]) == 2
    assert "schema" in capsys.readouterr().err


# ---- the engine's noise: --engine-repeats ------------------------------------------------------

def engine_replaced_by_noisy_scaled_simulator(monkeypatch, time_factors: list[float]) -> list:
    """The "engine" of a validation becomes the simulator with the same profile, each engine
    run (repeat) taking the next of `time_factors` (cycled) times the profile's step time: an
    engine whose timing differs from run to run. Returns the factors the runs took, in order."""
    import itertools

    original = sim.core.experiment.build_replica_executor
    factors = itertools.cycle(time_factors)
    taken: list[float] = []

    class Scaled:
        runs_repeated_steps = False   # as an engine: every step runs (and is scaled) on its own

        def __init__(self, inner, factor):
            self.inner, self.factor = inner, factor

        def execute(self, plan: StepPlan):
            result = self.inner.execute(plan)
            return dataclasses.replace(result, duration=result.duration * self.factor)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    def build(cfg, *args, **kwargs):
        if cfg.backend.name != "engine":
            return original(cfg, *args, **kwargs)
        as_sim = cfg.copy()
        with open_dict(as_sim):
            as_sim.backend = {"name": "sim"}
        taken.append(next(factors))
        # The engine's speculation setup leaves the drafting to it: the simulator's draws.
        args = [dataclasses.replace(arg, speculation=speculation_setup(as_sim))
                if isinstance(arg, ReplicaSettings) else arg for arg in args]
        return Scaled(original(as_sim, *args, **kwargs), taken[-1])

    monkeypatch.setattr(sim.core.experiment, "build_replica_executor", build)
    return taken


NOISY = [*TINY, "workload.num_requests=12", "workload.rate=inf", "--sim-runs=1"]


def hand_spread(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return (max(values) - min(values)) / 2 / abs(mean) * 100


def hand_verdict(error, gate, spread) -> str:
    if gate is None:
        return "ungated"
    if error is None or abs(error) > gate:
        return "within engine noise" if error is not None and (
            spread is None or abs(error) <= spread) else "outside both"
    return "within gate"


def check_noise_report(out: Path, factors: list[float]) -> dict:
    """validation.json of an `--engine-repeats 3` run against the three engine runs' own
    summaries: the engine's value is their mean, the spread and the verdict computed by hand."""
    result = json.loads((out / "validation.json").read_text())
    assert result["engine_repeats"] == 3
    runs = [json.loads((out / folder / "summary.json").read_text())
            for folder in ("engine", "engine-run1", "engine-run2")]
    # The repeats differ (each took its own factor), the workload does not.
    assert len({run["mean_ttft_ms"] for run in runs}) == 3
    assert {run["completed"] for run in runs} == {12}
    sim_summary = json.loads((out / "sim" / "summary.json").read_text())
    gates = result["gates"]
    for name, values in result["metrics"].items():
        repeats = [run[name] for run in runs]
        assert values["engine_runs"] == repeats, name
        assert values["engine"] == pytest.approx(np.mean(repeats)), name
        assert values["sim"] == pytest.approx(sim_summary[name]), name
        assert values["error_pct"] == pytest.approx(error_pct(np.mean(repeats), sim_summary[name]))
        if np.mean(repeats) == 0:
            assert values["engine_spread_pct"] == 0.0 and set(repeats) == {0}, name
        else:
            assert values["engine_spread_pct"] == pytest.approx(hand_spread(repeats)), name
        gate = gates[GATED_BY[name]] if name in GATED_BY else None
        assert values["verdict"] == hand_verdict(values["error_pct"], gate,
                                                 values["engine_spread_pct"]), name
    # Latencies scale with each repeat's factor: the engine's mean TPOT is the mean factor's.
    tpot = result["metrics"]["mean_tpot_ms"]
    assert tpot["engine"] == pytest.approx(sim_summary["mean_tpot_ms"] * np.mean(factors),
                                           rel=1e-6)
    assert tpot["engine_spread_pct"] == pytest.approx(
        (max(factors) - min(factors)) / 2 / np.mean(factors) * 100, rel=1e-6)
    # The gates alone decide: every metric outside its gate (noise or not) is a failure.
    failed = {line.split(":")[0] for line in result["failures"]}
    assert failed == {name for name, values in result["metrics"].items()
                      if values["verdict"] in ("within engine noise", "outside both")}
    assert result["passed"] == (not failed)
    return result


def test_engine_repeats_report_the_engines_noise_beside_every_error(tmp_path, monkeypatch,
                                                                    capsys):
    profile = write_profile(tmp_path / "p.json", samples=(0.0,))
    # An engine whose runs take 1.00, 1.06 and 0.97 times the profile's step times: its mean is
    # 1.01 (latency error -0.99 %), its spread ±4.46 %.
    factors = [1.00, 1.06, 0.97]
    taken = engine_replaced_by_noisy_scaled_simulator(monkeypatch, factors)
    out = tmp_path / "noisy"
    # Means/medians gated at 0.5 %: outside the gate, within the engine's noise; p99s at 2 %:
    # within the gate; the preemption count's error is 0: within its gate.
    assert main([*NOISY, f"--profile={profile}", f"--out={out}", "--engine-repeats", "3",
                 "--gate-mean-pct=0.5", "--gate-p99-pct=2", "--gate-p99-ttft-pct=2"]) == 1
    assert taken == factors
    err = capsys.readouterr().err
    assert "mean_tpot_ms" in err and "within engine noise" in err
    result = check_noise_report(out, factors)
    verdicts = {name: values["verdict"] for name, values in result["metrics"].items()}
    assert verdicts["mean_tpot_ms"] == verdicts["mean_ttft_ms"] == "within engine noise"
    assert verdicts["request_throughput"] == "within engine noise"
    assert verdicts["p99_tpot_ms"] == verdicts["p99_ttft_ms"] == "within gate"
    assert verdicts["num_preemptions"] == "within gate"
    assert verdicts["peak_kv_blocks"] == verdicts["p90_ttft_ms"] == "ungated"
    assert result["metrics"]["mean_tpot_ms"]["error_pct"] == pytest.approx(
        (1 / 1.01 - 1) * 100, abs=0.01)
    markdown = (out / "validation.md").read_text()
    assert "| metric | engine | sim | error % | engine spread % | verdict | gate |" in markdown
    row = next(line for line in markdown.splitlines() if line.startswith("| mean_tpot_ms |"))
    assert "within engine noise" in row and "±4.46" in row
    # An engine slower in every repeat (1.10, 1.16, 1.07): the error (-9.9 %) is outside both
    # the 3 % gate and the engine's spread (±4.05 %).
    biased = [1.10, 1.16, 1.07]
    taken = engine_replaced_by_noisy_scaled_simulator(monkeypatch, biased)
    out = tmp_path / "biased"
    assert main([*NOISY, f"--profile={profile}", f"--out={out}", "--engine-repeats=3"]) == 1
    assert taken == biased
    result = check_noise_report(out, biased)
    assert result["metrics"]["mean_tpot_ms"]["verdict"] == "outside both"
    assert result["metrics"]["request_throughput"]["verdict"] == "outside both"
    assert "within engine noise" not in capsys.readouterr().err


def test_one_engine_repeat_keeps_todays_validation(tmp_path, monkeypatch):
    """An engine 2 % slower than the profile: every latency's error is -1.96 %, the
    throughputs' +2 %, within the default gates (3 % on means, 8 % and 10 % on p99s)."""
    profile = write_profile(tmp_path / "p.json", samples=(0.0,))
    engine_replaced_by_noisy_scaled_simulator(monkeypatch, [1.02])
    default, once = tmp_path / "default", tmp_path / "once"
    assert main([*NOISY, f"--profile={profile}", f"--out={default}"]) == 0
    assert main([*NOISY, f"--profile={profile}", f"--out={once}", "--engine-repeats=1"]) == 0
    results = [json.loads((path / "validation.json").read_text()) for path in (default, once)]
    metrics = results[0]["metrics"]
    assert results[0]["gates"] == DEFAULT_GATES and results[0]["passed"]
    for name in ("mean_ttft_ms", "mean_tpot_ms", "p99_e2el_ms"):
        assert metrics[name]["error_pct"] == pytest.approx((1 / 1.02 - 1) * 100, abs=0.05), name
    assert metrics["output_throughput"]["error_pct"] == pytest.approx(2.0, abs=0.05)
    assert set(results[0]) == set(results[1])
    assert "engine_repeats" not in results[0]
    assert results[0]["metrics"] == results[1]["metrics"]
    engine = json.loads((once / "engine" / "summary.json").read_text())
    for name, values in results[1]["metrics"].items():
        assert set(values) == {"engine", "sim", "error_pct"}
        assert values["engine"] == engine[name] and type(values["engine"]) is type(engine[name])
    assert not (once / "engine-run1").exists()
    assert "verdict" not in (once / "validation.md").read_text()
    assert "| metric | engine | sim | error % | gate |" in (once / "validation.md").read_text()


@pytest.mark.parametrize("bad", [["--engine-repeats=0"], ["--engine-repeats", "-1"],
                                 ["--engine-repeats=x"], ["--engine-repeats=2.5"]])
def test_a_bad_engine_repeats_is_one_clear_line(tmp_path, capsys, bad):
    profile = write_profile(tmp_path / "p.json")
    assert main([*TINY, *bad, f"--profile={profile}", f"--out={tmp_path / 'out'}"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "--engine-repeats" in lines[0] and \
        "integer >= 1" in lines[0], captured.err
    assert not (tmp_path / "out").exists()


def test_spread_and_verdict_definitions():
    from calibration.validate.compare import spread_pct, verdict

    assert spread_pct([10.0, 10.6, 9.7]) == pytest.approx(0.45 / (30.3 / 3) * 100)
    assert spread_pct([5.0]) == 0.0 and spread_pct([0, 0, 0]) == 0.0
    assert spread_pct([-1.0, 1.0]) is None
    assert verdict(2.0, 3.0, 1.0) == "within gate"
    assert verdict(-3.0, 3.0, 0.0) == "within gate"
    assert verdict(-4.0, 3.0, 5.0) == "within engine noise"
    assert verdict(4.0, 3.0, 4.0) == "within engine noise"
    assert verdict(4.0, 3.0, 3.9) == "outside both"
    assert verdict(None, 3.0, 50.0) == "outside both"
    assert verdict(4.0, 3.0, None) == "within engine noise"
    assert verdict(4.0, None, 1.0) == "ungated"


def test_validation_grid_carries_spread_and_verdict_with_engine_repeats(tmp_path, monkeypatch):
    profile = write_profile(tmp_path / "p.json", samples=(0.0,))
    engine_replaced_by_noisy_scaled_simulator(monkeypatch, [1.00, 1.06, 0.97])
    out = tmp_path / "grid"
    assert main([*TINY, "workload.num_requests=8", "workload.rate=inf", "--sim-runs=1",
                 "scheduler=continuous,chunked_prefill", f"--profile={profile}", f"--out={out}",
                 "--engine-repeats=3", "--gate-mean-pct=0.5", "--gate-p99-pct=off",
                 "--gate-p99-ttft-pct=off", "--gate-preemptions-pct=off"]) == 1
    grid = json.loads((out / "grid.json").read_text())
    with open(out / "grid.csv", newline="") as file:
        csv_rows = list(csv.DictReader(file))
    markdown = (out / "grid.md").read_text()
    for row, csv_row in zip(grid["jobs"], csv_rows):
        job = json.loads((out / str(row["job"]) / "validation.json").read_text())
        assert job["engine_repeats"] == 3
        for name in GRID_METRICS:
            metric = job["metrics"][name]
            assert row[f"{name}_engine_spread_pct"] == metric["engine_spread_pct"], name
            assert row[f"{name}_verdict"] == csv_row[f"{name}_verdict"] == metric["verdict"]
            assert float(csv_row[f"{name}_engine_spread_pct"]) == pytest.approx(
                metric["engine_spread_pct"])
        assert row["mean_tpot_ms_verdict"] == "within engine noise"
        assert row["p99_tpot_ms_verdict"] == "ungated"
    job_lines = [line for line in markdown.splitlines() if line.startswith("| 0 ")]
    assert job_lines and "±4.46, noise)" in job_lines[0]
    # Without repeats the grid's rows carry no such columns.
    results = [{"metrics": compare_summaries(synthetic_summary(), synthetic_summary(1.02)),
                "passed": True, "speedup": 1.0}]
    assert not any(key.endswith(("_verdict", "_engine_spread_pct"))
                   for key in grid_rows(results, [{}])[0])
