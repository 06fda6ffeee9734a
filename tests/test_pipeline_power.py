"""The power plot's curve of a pipelined replica (sim/core/energy/trace.py,
TracedStagesEnergyMeter): the sum over its stages of each stage's power, by hand on two steps
through two stages of a tiny cost model, and its area against the replica's energy in a run's
summary."""
from __future__ import annotations

import numpy as np
import pytest

from factories import hardware_spec, make_cfg, model_spec
from policies.types import Request, StepPlan
from sim.core import pipelined_replica
from sim.core.energy.stages import StagesEnergyMeter
from sim.core.energy.trace import TracedStagesEnergyMeter, power_over_time
from sim.core.executor import SimExecutor
from sim.core.experiment import run_experiment
from runtime.metrics import STEP_COLUMNS
from sim.cost.pipeline import PipelineCostModel
from sim.tools.plots import power_panel_meters
from tests.test_energy_plots import hand_power_w


class TinyStage:
    """A stage's cost model: `seconds_per_token` of every token, no overhead, no LM head; its
    work `flops_per_token` per token and `bytes_per_step` a step."""

    def __init__(self, model, seconds_per_token: float, flops_per_token: float,
                 bytes_per_step: float):
        self.model = model
        self.seconds_per_token, self.flops_per_token = seconds_per_token, flops_per_token
        self.bytes_per_step = bytes_per_step
        self.step_overhead_s = self.per_sequence_overhead_s = 0.0

    def lm_head_kernels_s(self, num_rows: int) -> float:
        return 0.0

    def _tokens(self, plan: StepPlan) -> int:
        return plan.num_prefill_tokens + plan.num_decode_seqs

    def step_time(self, plan: StepPlan) -> float:
        return self.seconds_per_token * self._tokens(plan)

    def step_work(self, plan: StepPlan) -> tuple[float, float]:
        return self.flops_per_token * self._tokens(plan), self.bytes_per_step


def curve_area_j(series: np.ndarray, idle_w: float, span_start: float, span_end: float) -> float:
    """The area under a replica's steps-post curve (time, W) over the run's span: its idle draw
    before its first point and after its last."""
    times, watts = series[:, 0], series[:, 1]
    return float(np.sum(np.diff(times) * watts[:-1]) + idle_w * (times[0] - span_start)
                 + idle_w * (span_end - times[-1]))


def test_two_steps_through_two_stages_by_hand(tmp_path, monkeypatch):
    """Two 100-token prompts at once on two engines, stages of 10 ms and 6 ms (tp = 2): step A
    on stage 0 over [0, 10] ms, stage 1 over [10, 16]; step B on stage 0 over [10, 20], stage 1
    over [20, 26]. The replica draws stage 0's busy power and stage 1's idle, then both busy,
    then stage 0 busy, then stage 1 busy, then both idle; its area is the summary's energy."""
    model, hardware = model_spec("llama-2-7b"), hardware_spec("a100-80gb")
    stages = [TinyStage(model, 1e-4, 1e10, 2e9), TinyStage(model, 6e-5, 5e9, 1e9)]

    def tiny_executor(*args, **kwargs):
        return SimExecutor(PipelineCostModel(stages, [0.0], 0.0, "none (test)"))

    monkeypatch.setattr(pipelined_replica, "build_replica_executor", tiny_executor)
    requests = [Request(request_id=i, arrival_time=0.0, prompt_len=100, output_len=1)
                for i in range(2)]
    result = run_experiment(make_cfg("cluster.pipeline_parallel_size=2",
                                     "cluster.tensor_parallel_size=2",
                                     "cluster.frontend_latency_s=0"),
                            tmp_path, plots=True, requests=requests)
    replica, = result.replicas
    meter = replica.recorder.energy
    assert isinstance(meter, TracedStagesEnergyMeter)
    series = power_over_time(result.metrics.step_array(), STEP_COLUMNS, {0: meter})
    busy = [2 * hand_power_w(hardware, 1e12, 2e9, 0.010),
            2 * hand_power_w(hardware, 5e11, 1e9, 0.006)]
    idle = 2 * hardware.idle_power_w
    assert idle < busy[1] < busy[0] < 2 * hardware.max_power_w
    assert series[:, 0].tolist() == [0.0] * 5
    np.testing.assert_allclose(series[:, 1], [0.0, 0.010, 0.016, 0.020, 0.026], atol=1e-15)
    np.testing.assert_allclose(series[:, 2], [busy[0] + idle, busy[0] + busy[1],
                                              busy[0] + idle, idle + busy[1], 2 * idle],
                               rtol=1e-12)
    energy = (2 * busy[0] * 0.010 + idle * 0.006) + (2 * busy[1] * 0.006 + idle * 0.014)
    assert result.summary["duration_s"] == pytest.approx(0.026, rel=1e-12)
    assert result.summary["energy_per_replica"]["0"]["energy_j"] == pytest.approx(energy,
                                                                                   rel=1e-12)
    assert curve_area_j(series[:, 1:], 2 * idle, 0.0, 0.026) == pytest.approx(energy, rel=1e-12)
    assert (tmp_path / "power.png").is_file()


def test_each_pipelined_replicas_area_is_its_energy_and_runs_without_plots_keep_no_trace(
        tmp_path):
    """Two replicas of three stages, steps overlapping and idle between (and before the second
    replica's first step): the area under each replica's curve over the run's span is its
    energy_per_replica; the traced stages' joules are bit for bit the plain ones'; a run that
    writes no plots keeps plain meters and no stage timeline."""
    cfg = make_cfg("cost_model=roofline", "cluster.pipeline_parallel_size=3",
                   "cluster.num_replicas=2", "workload.num_requests=40", "workload.rate=6")
    plain = run_experiment(cfg, plots=False)
    plotted = run_experiment(cfg, tmp_path, plots=True)
    for replica in plain.replicas:
        assert type(replica.recorder.energy) is StagesEnergyMeter
        assert replica.lanes[0].driver.timing.stages.timeline is None
    for key in ("energy_j", "energy_per_replica"):
        assert plotted.summary[key] == plain.summary[key], key
    meters = {replica.replica_id: replica.recorder.energy for replica in plotted.replicas}
    assert power_panel_meters(meters, plotted.summary) == meters
    series = power_over_time(plotted.metrics.step_array(), STEP_COLUMNS, meters)
    span_start = min(request.arrival_time for request in plotted.requests)
    span_end = span_start + plotted.summary["duration_s"]
    starts = []
    for replica_id, meter in meters.items():
        curve = series[series[:, 0] == replica_id, 1:]
        idle = meter.num_boards * meter.power_model.idle_power_w
        assert curve[0, 0] >= span_start and curve[-1, 1] == pytest.approx(idle, rel=1e-12)
        starts.append(curve[0, 0])
        # Two stages at work at once somewhere: above one stage's busy power plus two idle.
        one_stage_max = meter.stages[0].num_boards * hardware_spec("a100-80gb").max_power_w
        assert curve[:, 1].max() > one_stage_max + 2 * idle / 3
        energy = plotted.summary["energy_per_replica"][str(replica_id)]["energy_j"]
        assert curve_area_j(curve, idle, span_start, span_end) == pytest.approx(energy, rel=1e-9)
    assert max(starts) > span_start
    assert (tmp_path / "power.png").is_file()
