"""cluster.frontend_latency_s, the serving front end's per-request latency: every request reaches
the engine that long after it was sent, so its TTFT and E2E grow by exactly the latency and
nothing else moves; 0 (the default) changes nothing; twinserve-calibrate recovers a planted
value from TTFT."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from calibration.realrun.calibrate import fit, main
from sim.cost.terms_file import read_terms_file
from calibration.realrun.readers import read_run
from runtime.policy_config import CONF_DIR
from sim.core.experiment import run_experiment
from tests.test_calibrate import SETTINGS, TRUE_TERMS, measured_run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import vllm_nightly_check  # noqa: E402

torch.set_num_threads(1)
# tiny-llama on the CPU spec's roofline: a few dozen requests run in well under a second.
TINY = ["progress=false", "model=tiny-llama", "hardware=cpu", "cost_model=roofline",
        "kv_cache.num_blocks=2048", "workload.num_requests=40", "seed=3"]


def run(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=[*TINY, *overrides])
    return run_experiment(cfg, plots=False)


def latencies(result) -> np.ndarray:
    """Per request (by id): TTFT, E2E and the time from first to last token, in seconds."""
    requests = sorted(result.requests, key=lambda r: r.request_id)
    return np.array([(r.first_token_time - r.arrival_time, r.finish_time - r.arrival_time,
                      r.finish_time - r.first_token_time) for r in requests])


@pytest.mark.parametrize("rate", [0.2, 40.0], ids=["idle", "loaded"])
def test_every_request_waits_exactly_the_latency_more(rate):
    """Idle (one request at a time) and loaded (a queue): the latency shifts every request's
    whole life, so TTFT and E2E grow by it and the decode times stay as they were."""
    latency = 0.0375
    base = latencies(run(f"workload.rate={rate}"))
    shifted = latencies(run(f"workload.rate={rate}", f"cluster.frontend_latency_s={latency}"))
    np.testing.assert_allclose(shifted[:, :2] - base[:, :2], latency, rtol=0, atol=1e-9)
    np.testing.assert_allclose(shifted[:, 2], base[:, 2], rtol=0, atol=1e-9)


def test_zero_by_default_and_requests_reach_the_engine_when_sent():
    result = run()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        assert compose("config").cluster.frontend_latency_s == 0.0
    first_arrival = min(r.arrival_time for r in result.requests)
    assert result.metrics.step_rows[0][1] == first_arrival   # start_time of the first step
    later = run("cluster.frontend_latency_s=0.25")
    assert later.metrics.step_rows[0][1] == pytest.approx(first_arrival + 0.25, abs=1e-12)


@pytest.mark.parametrize("value", ["-0.01", "inf", "'soon'"])
def test_a_bad_latency_is_named(value):
    with pytest.raises(ValueError, match=r"cluster\.frontend_latency_s must be"):
        run(f"cluster.frontend_latency_s={value}")


PLANTED = 0.03


def test_calibrate_recovers_a_planted_latency_from_ttft(tmp_path):
    """A run made with the latency planted (and the step overhead known): the latency alone
    fitted to the TTFTs comes back; TPOT would not see it."""
    made = {**TRUE_TERMS}
    path = measured_run(tmp_path, made, "made",
                        extra_overrides=[f"cluster.frontend_latency_s={PLANTED}"])
    known = [*SETTINGS, *(f"cost_model.{k}={v!r}" for k, v in made.items())]
    fitted, loss, _ = fit([read_run(path)], known, terms=("cluster.frontend_latency_s",),
                          metrics=("mean_ttft_ms", "median_ttft_ms"))
    assert fitted["cluster.frontend_latency_s"] == pytest.approx(PLANTED, rel=0.02)
    assert loss < 1e-4


def test_calibrate_cli_fits_the_latency_beside_a_cost_model_term(tmp_path):
    path = measured_run(tmp_path, TRUE_TERMS, "made",
                        extra_overrides=[f"cluster.frontend_latency_s={PLANTED}"])
    out = tmp_path / "profile.json"
    assert main(["--real", str(path), "--terms", "step_overhead_s,cluster.frontend_latency_s",
                 "--metrics", "mean_tpot_ms,median_tpot_ms,mean_ttft_ms,median_ttft_ms",
                 "--out", str(out), *SETTINGS,
                 f"cost_model.per_sequence_overhead_s={TRUE_TERMS['per_sequence_overhead_s']}"]
                ) == 0
    profile = json.loads(out.read_text())
    assert profile["config"]["cluster.frontend_latency_s"] == pytest.approx(PLANTED, rel=0.05)
    # The file loads as cost_model.terms_file: the whole config key is kept apart from its terms.
    assert read_terms_file(str(out), profile["cost_model"], ("step_overhead_s",)) == (
        profile["terms"])
    assert profile["terms"]["step_overhead_s"] == pytest.approx(
        TRUE_TERMS["step_overhead_s"], rel=0.05)
    (stage,) = profile["fit"]["made"]
    assert abs(stage["error_pct"]["mean_ttft_ms"]) < 2.0


def test_a_dotted_term_the_config_lacks_is_named(tmp_path, capsys):
    path = measured_run(tmp_path, TRUE_TERMS, "made")
    assert main(["--real", str(path), "--terms", "cluster.no_such_latency_s", *SETTINGS]) == 2
    assert "cluster.no_such_latency_s" in capsys.readouterr().out


def test_nightly_check_fits_the_latency_that_closes_a_rows_ttft_gap(tmp_path):
    """bench/vllm_nightly_check.py's closed form: a row whose real mean TTFT is the replay's plus
    25 ms gets 25 ms, and the replay with it reproduces the row's mean TTFT."""
    (row,) = [row for row in vllm_nightly_check.nightly_rows("vllm_055")
              if row["Test name"] == "vllm_055_llama8B_tp1_sharegpt_qps_2"]
    settings = ["cost_model.step_overhead_s=0.0017"]
    replayed = vllm_nightly_check.mean_metric(row, "mean_ttft_ms", 1, settings, tmp_path)
    planted = {**row, "Mean TTFT (ms)": replayed + 25.0}
    latency = vllm_nightly_check.fit_frontend_latency(planted, 1, settings)
    assert latency == pytest.approx(0.025, abs=1e-9)
    with_latency = vllm_nightly_check.mean_metric(
        row, "mean_ttft_ms", 1, [*settings, f"cluster.frontend_latency_s={latency!r}"], tmp_path)
    assert with_latency == pytest.approx(planted["Mean TTFT (ms)"], abs=1e-6)
