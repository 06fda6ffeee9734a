"""twinserve-calibrate: fitting cost-model terms to real runs by replay, on runs the simulator
made itself with known terms (so the right answer is known): the GPU cost model's overheads,
the roofline's overhead and efficiency together, the search's ranges and passes, and the
replay's prompts under prefix caching."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from calibration.realrun.calibrate import (BOUNDS, EFFICIENCY_BOUNDS, fit, main,
                                               start_value, term_bounds)
from calibration.realrun.readers import read_run
from calibration.realrun.replay import compose_replay_config, run_requests, simulate
from calibration.realrun.run import make_run

# A small Llama-2-7B on one A100 with the GPU cost model: replays take a few ms.
SETTINGS = ["model=llama-2-7b", "hardware=a100-80gb", "cost_model=gpu", "scheduler=chunked_prefill"]
TRUE_TERMS = {"step_overhead_s": 3.0e-3, "per_sequence_overhead_s": 4.0e-5}


def measured_run(tmp_path: Path, terms: dict[str, float], name: str, rate: float = 6.0,
                 seed: int = 1, extra_overrides: tuple[str, ...] = ()) -> Path:
    """A CSV run: a Poisson workload simulated with `terms` (and `extra_overrides`) set, as if
    measured."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, 80))
    rows = [{"arrival_s": repr(float(t)), "prompt_len": int(p), "output_len": int(o),
             "ttft_s": 0.0, "e2e_s": 0.0}
            for t, p, o in zip(arrivals, rng.integers(50, 600, 80), rng.integers(8, 120, 80))]
    path = tmp_path / f"{name}.csv"
    write_rows(path, rows)
    workload = read_run(path)
    overrides = [*SETTINGS, *(f"cost_model.{k}={v!r}" for k, v in terms.items()),
                 *extra_overrides]
    simulated = simulate(workload, compose_replay_config(workload, overrides))
    for row, request in zip(rows, simulated.requests):
        row["ttft_s"] = repr(request.first_token_time - request.arrival_time)
        row["e2e_s"] = repr(request.finish_time - request.arrival_time)
    write_rows(path, rows)
    return path


def write_rows(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def test_fit_recovers_the_terms_a_run_was_made_with(tmp_path):
    run = read_run(measured_run(tmp_path, TRUE_TERMS, "made"))
    per_sequence = f"cost_model.per_sequence_overhead_s={TRUE_TERMS['per_sequence_overhead_s']}"
    fitted, loss, num_replays = fit([run], [*SETTINGS, per_sequence], terms=("step_overhead_s",))
    # Started three orders of magnitude away (the config's value).
    assert fitted["step_overhead_s"] == pytest.approx(TRUE_TERMS["step_overhead_s"], rel=0.03)
    assert loss < 1e-4 and 10 < num_replays < 100
    # Both terms free: one run's TPOT does not tell them apart, but whatever the pair, the run
    # is reproduced.
    both, loss, _ = fit([run], SETTINGS, terms=tuple(TRUE_TERMS))
    assert loss < 1e-3 and both["step_overhead_s"] == pytest.approx(3e-3, rel=0.2)


def test_a_term_that_moves_no_metric_fails_the_fit_naming_it(tmp_path, capsys):
    """The front end's latency adds to TTFT only: fitted to TPOT it cannot move, and the
    command says so and exits 1 instead of printing a fit."""
    run = measured_run(tmp_path, TRUE_TERMS, "made")
    out = tmp_path / "profile.json"
    assert main(["--real", str(run), "--terms", "cluster.frontend_latency_s", "--out", str(out),
                 *SETTINGS, *(f"cost_model.{k}={v!r}" for k, v in TRUE_TERMS.items())]) == 1
    printed = capsys.readouterr().out
    assert "cluster.frontend_latency_s stayed at its start value" in printed
    assert "move none of the metrics mean_tpot_ms, median_tpot_ms" in printed
    assert "GPUCostModel" in printed and not out.exists()


def test_a_term_the_runs_want_beyond_its_bound_fails_the_fit_naming_it(tmp_path, capsys):
    run = measured_run(tmp_path, {**TRUE_TERMS, "step_overhead_s": 0.4}, "slow")
    per_sequence = f"cost_model.per_sequence_overhead_s={TRUE_TERMS['per_sequence_overhead_s']}"
    assert main(["--real", str(run), "--terms", "step_overhead_s", *SETTINGS, per_sequence]) == 1
    assert "ended on its search's bound 0.1" in capsys.readouterr().out


def test_cli_reports_held_out_runs_and_writes_the_profile(tmp_path, capsys):
    fit_on = measured_run(tmp_path, TRUE_TERMS, "fit", rate=5.0, seed=2)
    held_out = measured_run(tmp_path, TRUE_TERMS, "held", rate=9.0, seed=3)
    out = tmp_path / "profile.json"
    assert main(["--real", str(fit_on), "--held-out", str(held_out), "--terms",
                 "step_overhead_s", "--out", str(out), *SETTINGS,
                 f"cost_model.per_sequence_overhead_s={TRUE_TERMS['per_sequence_overhead_s']}"]) == 0
    profile = json.loads(out.read_text())
    assert profile["terms"]["step_overhead_s"] == pytest.approx(3.0e-3, rel=0.05)
    (held_stage,) = profile["held_out"]["held"]
    # Made with the same terms: the held-out run is predicted as it was made.
    assert abs(held_stage["error_pct"]["mean_tpot_ms"]) < 2.0
    assert "held out" in capsys.readouterr().out


def test_a_term_the_cost_model_lacks_is_named(tmp_path, capsys):
    run = measured_run(tmp_path, TRUE_TERMS, "made")
    assert main(["--real", str(run), "--terms", "no_such_term", *SETTINGS]) == 2
    assert "no_such_term" in capsys.readouterr().out


def test_replayed_prompts_are_distinct_and_reproducible(tmp_path):
    run = read_run(measured_run(tmp_path, TRUE_TERMS, "made"))
    first, again = run_requests(run, 32000), run_requests(run, 32000)
    assert [r.prompt_token_ids for r in first] == [r.prompt_token_ids for r in again]
    assert all(len(r.prompt_token_ids) == r.prompt_len for r in first)
    assert len({tuple(r.prompt_token_ids[:8]) for r in first}) == len(first)
    assert all(r.prompt_token_ids is None for r in run_requests(run))


def test_prefix_caching_lets_a_preempted_request_reuse_its_prompt(tmp_path):
    """A replay of a run with prefix caching on: a request preempted for recompute finds its own
    prompt blocks again, so the replay computes fewer prompt tokens than without the cache."""
    run = read_run(measured_run(tmp_path, TRUE_TERMS, "made", rate=30.0))
    tight = [*SETTINGS, "kv_cache.num_blocks=400"]
    computed = {}
    for caching in (False, True):
        config = compose_replay_config(run, [*tight, f"kv_cache.enable_prefix_caching={caching}"])
        result = simulate(run, config)
        assert result.summary["num_preemptions"] > 0
        computed[caching] = result.summary["total_input_tokens"], sum(
            row[5] for row in result.metrics.step_rows)   # num_prefill_tokens
    assert computed[True][0] == computed[False][0]
    assert computed[True][1] < computed[False][1]


# tiny-llama on the CPU spec's roofline: O(100) requests replay in well under a second.
ROOFLINE_OVERRIDES = ["model=tiny-llama", "hardware=cpu", "cost_model=roofline",
             "scheduler=chunked_prefill", "kv_cache.num_blocks=2048"]
# What bench/vllm_cpu_loop.py fits: a step overhead (from TPOT) and a compute efficiency (from
# TTFT) above the 0.1 that bounds the overheads' search.
ROOFLINE_TERMS = {"step_overhead_s": 3e-3, "compute_efficiency": 0.3}


def measured_two_load_run(terms: dict[str, float]):
    """A run 'measured' on the simulator with `terms`: two Poisson loads of tiny-llama-sized
    requests; its file records the model as a name no conf/model hf_repo matches."""
    rng = np.random.default_rng(0)
    light = np.cumsum(rng.exponential(1 / 2.0, 40))
    arrivals = np.concatenate([light, light[-1] + 1.0 + np.cumsum(rng.exponential(1 / 16.0, 80))])
    prompts, outputs = rng.integers(16, 400, arrivals.size), rng.integers(8, 120, arrivals.size)

    def run_with(ttft, e2e):
        return make_run(name="measured", source="test", where="test", arrival_s=arrivals,
                        prompt_len=prompts, output_len=outputs, ttft_s=ttft, e2e_s=e2e,
                        engine_settings={"model": "tiny-llama", "hardware": "cpu"})

    workload = run_with(np.zeros(arrivals.size), np.zeros(arrivals.size))
    config = compose_replay_config(workload, ROOFLINE_OVERRIDES)
    for term, value in terms.items():
        config.cost_model[term] = value
    requests = sorted(simulate(workload, config).requests, key=lambda r: r.request_id)
    return run_with(np.array([r.first_token_time - r.arrival_time for r in requests]),
                    np.array([r.finish_time - r.arrival_time for r in requests]))


FIT_METRICS = ("mean_tpot_ms", "median_tpot_ms", "mean_ttft_ms", "median_ttft_ms")


@pytest.fixture(scope="module")
def roofline_run():
    return measured_two_load_run(ROOFLINE_TERMS)


def test_fit_recovers_an_overhead_and_an_efficiency_together(roofline_run):
    fitted, loss, _ = fit([roofline_run], ROOFLINE_OVERRIDES, tuple(ROOFLINE_TERMS), FIT_METRICS)
    assert loss < 1e-4
    for term, value in ROOFLINE_TERMS.items():
        assert fitted[term] == pytest.approx(value, rel=0.05), term


def test_two_passes_stop_short_in_the_terms_trade_off(roofline_run):
    """Overhead and efficiency trade off in TTFT: coordinate passes walk the valley slowly, so
    the default searches until a pass improves nothing."""
    _, loss, replays = fit([roofline_run], ROOFLINE_OVERRIDES, tuple(ROOFLINE_TERMS), FIT_METRICS, passes=2)
    _, converged_loss, converged_replays = fit([roofline_run], ROOFLINE_OVERRIDES, tuple(ROOFLINE_TERMS), FIT_METRICS)
    assert loss > 10 * converged_loss and replays < converged_replays


def test_bad_passes_is_named(capsys):
    assert main(["--real", "nothing.json", "--passes", "0", *ROOFLINE_OVERRIDES]) == 2
    assert "--passes must be >= 1, got 0" in capsys.readouterr().out


def test_efficiencies_are_searched_as_shares_and_overheads_as_seconds():
    assert term_bounds("compute_efficiency") == term_bounds("memory_efficiency") == (
        EFFICIENCY_BOUNDS) == (1e-3, 1.0)
    assert term_bounds("step_overhead_s") == BOUNDS
    assert start_value("compute_efficiency", 0.55) == 0.55
    assert start_value("compute_efficiency", 3.0) == 1.0
    assert start_value("step_overhead_s", 0.0) == pytest.approx(1e-6)
    assert start_value("step_overhead_s", 0.5) == pytest.approx(0.01)
    # A workstation board's share is relative to the measured boards': it may exceed 1.
    assert term_bounds("workstation_bandwidth_efficiency") == (0.25, 4.0)
