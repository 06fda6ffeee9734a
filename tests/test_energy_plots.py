"""The energy axis of a run's plots and of the sweep report: each step's power from the traced
meter against the power model by hand, the power-over-time series and its area, power.png in a
run's outputs (and not where there is no energy), and the report's energy metrics."""
from __future__ import annotations

import json

import numpy as np
import pytest

from sim.core.energy.meter import EnergyMeter
from sim.core.energy.power import UtilisationPowerModel
from sim.core.energy.trace import TracedEnergyMeter, power_over_time, step_power_w
from sim.cost.work import ModelStepWork
from sim.core.experiment import run_experiment
from runtime.metrics import STEP_COLUMNS
from sim.tools.plots import joules_text, plot_power, power_panel_meters
from sim.tools.report import default_metrics, write_report
from sim.tools.report_labels import metric_heading, metric_label
from sim.tools.run_outputs import write_run_outputs
from sim.tools.sweep_jobs import load_jobs
from tests.factories import decode_plan, hardware_spec, make_cfg, model_spec
from tests.test_energy import reference_decode_work

COLUMN = {name: index for index, name in enumerate(STEP_COLUMNS)}


def step_rows(replica_id: int, starts: list[float], durations: list[float]) -> np.ndarray:
    """Step rows (STEP_COLUMNS) of one replica: only who ran them, when and how long is set."""
    rows = np.zeros((len(starts), len(STEP_COLUMNS)))
    rows[:, COLUMN["replica_id"]] = replica_id
    rows[:, COLUMN["start_time"]], rows[:, COLUMN["duration"]] = starts, durations
    return rows


def hand_power_w(hardware, flops: float, bytes_moved: float, seconds: float) -> float:
    """docs/energy.md: P = P_idle + (P_max - P_idle) min(1, u_compute / 0.55 + 0.7 u_memory)."""
    utilisation = (flops / (seconds * hardware.peak_flops) / 0.55
                   + 0.7 * bytes_moved / (seconds * hardware.memory_bandwidth))
    return hardware.idle_power_w + (hardware.max_power_w - hardware.idle_power_w) * min(
        1.0, utilisation)


def test_each_steps_power_is_the_power_model_over_its_work():
    """A decode step, a run of two repeated steps (each a token longer) and a step too
    short for its bytes (the board at its limit), against the model by hand."""
    model, hardware = model_spec("llama-2-7b"), hardware_spec("a100-80gb")
    meter = TracedEnergyMeter(UtilisationPowerModel(hardware), ModelStepWork(model))
    meter.add_step(decode_plan(4, 200), 0.02)
    meter.add_repeated_steps(decode_plan(2, 100), [0.01, 0.011])
    meter.add_step(decode_plan(1, 50), 0.003)
    steps = step_rows(0, [0.0, 0.02, 0.03, 0.041], [0.02, 0.01, 0.011, 0.003])
    expected = [hand_power_w(hardware, *reference_decode_work(model, seqs, context), seconds)
                for seqs, context, seconds in [(4, 200, 0.02), (2, 100, 0.01), (2, 101, 0.011),
                                               (1, 50, 0.003)]]
    assert expected[-1] == hardware.max_power_w and expected[0] < hardware.max_power_w
    np.testing.assert_allclose(step_power_w(steps, STEP_COLUMNS, {0: meter}), expected,
                               rtol=1e-12)


def test_the_replicas_boards_each_draw_and_an_untraced_replica_has_no_power():
    model, hardware = model_spec("llama-2-7b"), hardware_spec("a100-80gb")
    one, two = (TracedEnergyMeter(UtilisationPowerModel(hardware), ModelStepWork(model), boards)
                for boards in (1, 2))
    for meter in (one, two):
        meter.add_step(decode_plan(8, 300), 0.015)
    steps = np.vstack([step_rows(0, [0.0], [0.015]), step_rows(1, [0.0], [0.015]),
                       step_rows(2, [0.0], [0.015])])
    untraced = EnergyMeter(UtilisationPowerModel(hardware), ModelStepWork(model))
    power = step_power_w(steps, STEP_COLUMNS, {0: one, 1: two, 2: untraced})
    assert power[1] == pytest.approx(2 * power[0]) and np.isnan(power[2])
    with pytest.raises(ValueError, match="2 step rows for 1 metered steps"):
        step_power_w(step_rows(0, [0.0, 0.1], [0.015, 0.015]), STEP_COLUMNS, {0: one})


def test_power_over_time_idles_between_steps_and_its_area_is_the_meters_joules():
    model, hardware = model_spec("llama-2-7b"), hardware_spec("a100-80gb")
    meter = TracedEnergyMeter(UtilisationPowerModel(hardware), ModelStepWork(model), 2)
    starts, durations = [1.0, 1.02, 1.5], [0.02, 0.03, 0.01]   # back to back, then 0.45 s idle
    for duration in durations:
        meter.add_step(decode_plan(8, 300), duration)
    idle_replica = TracedEnergyMeter(UtilisationPowerModel(hardware), ModelStepWork(model))
    series = power_over_time(step_rows(3, starts, durations), STEP_COLUMNS,
                             {3: meter, 4: idle_replica})   # (4 ran no step: no points)
    idle_w = 2 * hardware.idle_power_w
    assert series[:, 0].tolist() == [3.0] * 5
    assert series[:, 1].tolist() == [1.0, 1.02, 1.05, 1.5, 1.51]
    assert series[2, 2] == series[4, 2] == idle_w and series[3, 2] > idle_w
    # steps-post: each value holds until the next point; the area to the last step's end.
    area = float(np.sum(np.diff(series[:, 1]) * series[:-1, 2]))
    assert area == pytest.approx(meter.busy_j + idle_w * 0.45, rel=1e-9)


def test_a_plotted_run_writes_power_png_and_keeps_the_plain_meters_joules(tmp_path):
    """Two replicas whose decode steps run as repeated steps: the traced meters' joules are bit
    for bit the plain meters', and each replica's rows pair with its metered steps."""
    cfg = make_cfg("workload.num_requests=40", "workload.rate=8", "cluster.num_replicas=2",
                   "cost_model=roofline")
    plain = run_experiment(cfg, plots=False)
    plotted = run_experiment(cfg, tmp_path, plots=True)
    assert all(type(replica.recorder.energy) is EnergyMeter for replica in plain.replicas)
    for key in ("energy_j", "energy_per_replica", "joules_per_output_token"):
        assert plotted.summary[key] == plain.summary[key], key
    assert (tmp_path / "power.png").read_bytes().startswith(b"\x89PNG")
    steps = plotted.metrics.step_array()
    meters = {replica.replica_id: replica.recorder.energy for replica in plotted.replicas}
    written = write_run_outputs(tmp_path / "again", plotted.metrics, plotted.requests,
                                plotted.summary, energy_meters=meters)
    assert [path.name for path in written][-2:] == ["batch_size.png", "power.png"]
    power = step_power_w(steps, STEP_COLUMNS, meters)
    assert np.isfinite(power).all()
    for replica_id, meter in meters.items():
        rows = steps[:, COLUMN["replica_id"]] == replica_id
        joules = np.sum(power[rows] * steps[rows, COLUMN["duration"]])
        assert joules == pytest.approx(meter.busy_j, rel=1e-9)


def test_an_engine_run_plots_the_model_over_its_measured_steps(tmp_path):
    """backend=engine: the steps' durations are measured, their power modelled (no power
    reading); every row pairs with a metered step."""
    import torch
    torch.set_num_threads(1)
    result = run_experiment(make_cfg(
        "backend=engine", "model=tiny-llama", "hardware=cpu", "workload.num_requests=3",
        "workload.rate=inf", "workload.with_token_ids=true",
        "++workload.prompt_len={dist: fixed, value: 16}",
        "++workload.output_len={dist: fixed, value: 4}", "kv_cache.block_size=4"), tmp_path)
    assert result.summary["energy_model"].startswith("modelled, not measured")
    meter = result.replicas[0].recorder.energy
    power = step_power_w(result.metrics.step_array(), STEP_COLUMNS, {0: meter})
    assert len(power) == len(meter.step_joules) > 0 and np.isfinite(power).all()
    assert (tmp_path / "power.png").is_file()


def test_runs_without_energy_plot_without_the_power_panel(tmp_path):
    """A hardware spec without board power (energy 0) and meters that kept no steps: no
    power.png, the other plots as before."""
    run_experiment(make_cfg("workload.num_requests=10", "hardware.idle_power_w=0",
                            "hardware.max_power_w=0"), tmp_path, plots=True)
    assert (tmp_path / "batch_size.png").is_file() and not (tmp_path / "power.png").exists()
    hardware, model = hardware_spec("a100-80gb"), model_spec("llama-2-7b")
    plain = EnergyMeter(UtilisationPowerModel(hardware), ModelStepWork(model))
    assert power_panel_meters({0: plain}, {"energy_j": 5.0}) == {}
    assert power_panel_meters(None, None) == {}


def test_the_legend_gives_each_replicas_joules_and_the_title_the_runs():
    """A prefill replica's tokens are its decode replica's: it says so rather than 0 J/tok."""
    import matplotlib.pyplot as plt
    model, hardware = model_spec("llama-2-7b"), hardware_spec("a100-80gb")
    meters = {0: TracedEnergyMeter(UtilisationPowerModel(hardware), ModelStepWork(model)),
              1: TracedEnergyMeter(UtilisationPowerModel(hardware), ModelStepWork(model))}
    for meter in meters.values():
        meter.add_step(decode_plan(8, 300), 0.015)
    summary = {"energy_j": 2500.0, "joules_per_output_token": 0.25, "energy_per_replica": {
        "0": {"energy_j": 900.0, "joules_per_output_token": 0.0},
        "1": {"energy_j": 1600.0, "joules_per_output_token": 0.16}}}
    steps = np.vstack([step_rows(0, [0.0], [0.015]), step_rows(1, [0.0], [0.015])])
    figure, ax = plt.subplots()
    plot_power(ax, steps, STEP_COLUMNS, meters, summary, {0: "prefill 0", 1: "decode 1"})
    assert ax.get_title() == "Board power (modelled): 2.5 kJ, 0.25 J per output token"
    assert [text.get_text() for text in ax.get_legend().get_texts()] == [
        "prefill 0: 900 J, no output tokens", "decode 1: 1.6 kJ, 0.16 J/tok",
        f"idle draw ({hardware.idle_power_w:,.0f} W)"]
    plt.close(figure)


def write_job(sweep_dir, name: str, rate: float, summary: dict) -> None:
    job = sweep_dir / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(f"- workload.rate={rate}\n")
    (job / "summary.json").write_text(json.dumps(summary))


LATENCIES = {"completed": 10, "request_throughput": 1.0, "p99_ttft_ms": 2.0, "p99_tpot_ms": 3.0}


def test_the_report_plots_energy_metrics_and_shows_tokens_per_joule_by_default(tmp_path):
    for job, rate in enumerate([2, 4]):
        write_job(tmp_path, str(job), rate, {
            **LATENCIES, "tokens_per_joule": rate * 1.5, "joules_per_output_token": 1 / rate,
            "energy_per_pool": {"decode": {"tokens_per_joule": rate * 2.0}}})
    assert default_metrics(load_jobs(tmp_path))[-1] == "tokens_per_joule"
    write_report(tmp_path, metrics=["tokens_per_joule", "joules_per_output_token",
                                    "energy_per_pool.decode.tokens_per_joule"])
    assert (tmp_path / "throughput_vs_load.png").stat().st_size > 10_000
    assert metric_label("joules_per_output_token") == "energy per output token (J, modelled)"
    assert metric_label("energy_per_pool.decode.tokens_per_joule") == (
        "output tokens per joule (modelled), pool decode")
    assert metric_heading("energy_per_replica.1.joules_per_output_token") == "replica 1 J/tok"


def test_a_sweep_without_energy_keeps_the_three_default_panels(tmp_path):
    """Summaries written before energy was modelled, or on hardware without power figures."""
    write_job(tmp_path, "0", 2, LATENCIES)
    write_job(tmp_path, "1", 4, {**LATENCIES, "tokens_per_joule": 0.0})
    assert default_metrics(load_jobs(tmp_path)) == [
        "request_throughput", "p99_ttft_ms", "p99_tpot_ms"]
    write_report(tmp_path)
    assert (tmp_path / "throughput_vs_load.png").is_file()


def test_joules_read_in_their_unit():
    assert [joules_text(value) for value in (0.138, 35_790.0, 2.5e7)] == [
        "0.138 J", "35.8 kJ", "25 MJ"]
