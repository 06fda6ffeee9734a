"""twinserve-calibrate's fit: terms recovered from a run the simulator made with known terms,
efficiencies searched as shares, and a run whose file names a model that only the command line
resolves."""
from __future__ import annotations

import numpy as np
import pytest

from sim.calibration.realrun.calibrate import (BOUNDS, EFFICIENCY_BOUNDS, fit, main,
                                               start_value, term_bounds)
from sim.calibration.realrun.replay import compose_replay_config, simulate
from sim.calibration.realrun.run import make_run

# tiny-llama on the CPU spec's roofline: O(100) requests replay in well under a second.
OVERRIDES = ["model=tiny-llama", "hardware=cpu", "cost_model=roofline",
             "scheduler=chunked_prefill", "kv_cache.num_blocks=2048"]
# What bench/vllm_cpu_loop.py fits: a step overhead (from TPOT) and a compute efficiency (from
# TTFT) above the 0.1 that bounds the overheads' search.
TRUE_TERMS = {"step_overhead_s": 3e-3, "compute_efficiency": 0.3}


def measured_run(terms: dict[str, float]):
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
    config = compose_replay_config(workload, OVERRIDES)
    for term, value in terms.items():
        config.cost_model[term] = value
    requests = sorted(simulate(workload, config).requests, key=lambda r: r.request_id)
    return run_with(np.array([r.first_token_time - r.arrival_time for r in requests]),
                    np.array([r.finish_time - r.arrival_time for r in requests]))


FIT_METRICS = ("mean_tpot_ms", "median_tpot_ms", "mean_ttft_ms", "median_ttft_ms")


@pytest.fixture(scope="module")
def run():
    return measured_run(TRUE_TERMS)


def test_fit_recovers_the_terms_a_run_was_made_with(run):
    fitted, loss, _ = fit([run], OVERRIDES, tuple(TRUE_TERMS), FIT_METRICS)
    assert loss < 1e-4
    for term, value in TRUE_TERMS.items():
        assert fitted[term] == pytest.approx(value, rel=0.05), term


def test_two_passes_stop_short_in_the_terms_trade_off(run):
    """Overhead and efficiency trade off in TTFT: coordinate passes walk the valley slowly, so
    the default searches until a pass improves nothing."""
    _, loss, replays = fit([run], OVERRIDES, tuple(TRUE_TERMS), FIT_METRICS, passes=2)
    _, converged_loss, converged_replays = fit([run], OVERRIDES, tuple(TRUE_TERMS), FIT_METRICS)
    assert loss > 10 * converged_loss and replays < converged_replays


def test_bad_passes_is_named(capsys):
    assert main(["--real", "nothing.json", "--passes", "0", *OVERRIDES]) == 2
    assert "--passes must be >= 1, got 0" in capsys.readouterr().out


def test_efficiencies_are_searched_as_shares_and_overheads_as_seconds():
    assert term_bounds("compute_efficiency") == term_bounds("memory_efficiency") == (
        EFFICIENCY_BOUNDS) == (1e-3, 1.0)
    assert term_bounds("step_overhead_s") == BOUNDS
    assert start_value("compute_efficiency", 0.55) == 0.55
    assert start_value("compute_efficiency", 3.0) == 1.0
    assert start_value("step_overhead_s", 0.0) == pytest.approx(1e-6)
    assert start_value("step_overhead_s", 0.5) == pytest.approx(0.01)
