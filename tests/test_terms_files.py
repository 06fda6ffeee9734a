"""Fitted terms files name the cost model they were fitted on and load into it
(sim/cost/terms_file.py): the roofline and the profiled model take `cost_model.terms_file`, a
file of another cost model is refused in one line, twinserve-calibrate names the cost model that
ran; a twinserve CPU run replays on its model's shipped profile (calibration/realrun/settings.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest

import sim.core.say_once as say_once_module
from calibration.realrun.calibrate import (DEFAULT_METRICS, DEFAULT_TERMS, PROFILED_METRICS,
                                           PROFILED_TERMS, parse_args, terms_and_metrics)
from calibration.realrun.calibrate import main as calibrate
from calibration.realrun.run import make_run
from calibration.realrun.replay import replay
from calibration.realrun.settings import settings_overrides
from sim.core.experiment import run_experiment
from sim.cost.roofline import RooflineCostModel
from sim.cost.profiled.cost_model import ProfiledCostModel

from factories import decode_plan, make_cfg

CPU_RUN = ("model=tiny-llama", "hardware=cpu", "workload.num_requests=5")
PROFILE = "profiles/cpu/tiny-llama.json"


def terms_file(path, cost_model: str | None, **terms):
    path.write_text(json.dumps({"terms": terms, **({"cost_model": cost_model}
                                                   if cost_model else {})}))
    return path


def cost_model_of(*overrides):
    return run_experiment(make_cfg(*CPU_RUN, *overrides), plots=False).replicas[0].executor.cost_model


def test_the_roofline_takes_a_terms_file_fitted_on_it(tmp_path, monkeypatch):
    monkeypatch.setattr(say_once_module, "_SAID", set())
    path = terms_file(tmp_path / "fit.json", "roofline", step_overhead_s=0.02,
                      compute_efficiency=0.3)
    named = cost_model_of("cost_model=roofline", f"cost_model.terms_file={path}")
    assert named.step_overhead_s == 0.02 and named.compute_efficiency == 0.3
    # The default GPU model falls back to the roofline on a CPU and carries the file into it.
    fell_back = cost_model_of(f"cost_model.terms_file={path}")
    assert type(fell_back) is RooflineCostModel and fell_back.compute_efficiency == 0.3


def test_a_file_of_another_cost_model_is_refused_in_one_line(tmp_path):
    path = terms_file(tmp_path / "fit.json", "gpu", step_overhead_s=0.02)
    with pytest.raises(ValueError) as refused:
        cost_model_of("cost_model=roofline", f"cost_model.terms_file={path}")
    message = str(refused.value)
    assert message.startswith(f"cost_model.terms_file={path}: fitted on cost_model=gpu")
    assert "cost_model=roofline" in message and "\n" not in message
    roofline_file = terms_file(tmp_path / "roofline.json", "roofline", step_overhead_s=0.02)
    with pytest.raises(ValueError, match="fitted on cost_model=roofline, not on this run's "
                                         "cost_model=profiled"):
        cost_model_of("cost_model=profiled", f"cost_model.profile={PROFILE}",
                      f"cost_model.terms_file={roofline_file}")


def test_the_profiled_model_scales_its_steps_and_adds_a_servers_overheads(tmp_path):
    plan = decode_plan(4, 100)
    plain = ProfiledCostModel(PROFILE, sample_residuals=False, block_size=16)
    path = terms_file(tmp_path / "fit.json", "profiled", step_time_scale=2.0,
                      step_overhead_s=0.001, per_sequence_overhead_s=0.0005)
    served = ProfiledCostModel(PROFILE, sample_residuals=False, block_size=16,
                               terms_file=str(path))
    assert served.step_time(plan) == pytest.approx(2 * plain.step_time(plan) + 0.001 + 4 * 0.0005)


def cpu_run(engine: str | None, model: str = "tiny-llama"):
    arrivals = np.arange(12) * 0.5
    settings = {"model": model, "hardware": "cpu", **({"engine": engine} if engine else {})}
    return make_run(name="served", source="test", where="test", arrival_s=arrivals,
                    prompt_len=np.full(12, 64), output_len=np.full(12, 16),
                    ttft_s=np.full(12, 0.03), e2e_s=np.full(12, 0.12), engine_settings=settings)


def test_a_twinserve_cpu_run_replays_on_its_models_profile():
    assert replay(cpu_run("twinserve"))["cost_model"] == "ProfiledCostModel"
    assert replay(cpu_run(None))["cost_model"] == "RooflineCostModel"   # (not the engine's run)
    assert replay(cpu_run("twinserve"), ["cost_model=roofline"])["cost_model"] == "RooflineCostModel"
    # A model without a shipped profile: one line says what to give.
    _, provenance = settings_overrides({"engine": "twinserve", "model": "llama-2-7b",
                                        "hardware": "cpu"}, [], "run")
    assert "no profiles/cpu/llama-2-7b.json" in provenance["cost_model"]["source"]
    assert "cost_model=profiled cost_model.profile=" in provenance["cost_model"]["source"]


def test_calibrate_fits_the_profiled_models_own_terms_by_default():
    """On the profiled model (a twinserve CPU run's) the speed and the front end's latency, to
    TPOT and TTFT; on the others the overheads, to TPOT; --terms alone keeps TPOT."""
    def chosen(run, *argv):
        return terms_and_metrics(parse_args(["--real", "run.json", *argv]), [run])

    assert chosen(cpu_run("twinserve")) == (PROFILED_TERMS, PROFILED_METRICS)
    assert chosen(cpu_run(None)) == (DEFAULT_TERMS, DEFAULT_METRICS)
    assert chosen(cpu_run("twinserve"), "--terms", "step_time_scale") == (
        ("step_time_scale",), DEFAULT_METRICS)


def test_calibrate_names_the_cost_model_that_ran_in_its_file(tmp_path, monkeypatch):
    """Fitted with the default (GPU) cost model on a CPU run, the roofline ran: the file says
    roofline and loads into cost_model=roofline."""
    monkeypatch.setattr(say_once_module, "_SAID", set())
    rows = ["arrival_s,prompt_len,output_len,ttft_s,e2e_s"] + [
        f"{0.5 * i},64,16,0.03,{0.03 + 15 * 0.004}" for i in range(12)]
    run = tmp_path / "run.csv"
    run.write_text("\n".join(rows) + "\n")
    out = tmp_path / "fit.json"
    assert calibrate(["--real", str(run), "--terms", "step_overhead_s", "--out", str(out),
                      "model=tiny-llama", "hardware=cpu"]) == 0
    fitted = json.loads(out.read_text())
    assert fitted["cost_model"] == "roofline" and fitted["config"] == {}
    model = cost_model_of("cost_model=roofline", f"cost_model.terms_file={out}")
    assert model.step_overhead_s == pytest.approx(fitted["terms"]["step_overhead_s"])
