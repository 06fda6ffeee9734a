"""The speed probe (engine/speed.py): its factor, the executor that normalises an engine run's
step durations with it, the profiler's normalised samples (a drifting stand-in machine is
recovered as if it had not drifted), and clear errors for a profile without a usable reference."""
from __future__ import annotations

import json
import time

import pytest

from engine.profiler import build_plan, fit_profile, make_grid, predict, profile
from engine.speed import (PROBE_POINT, SpeedNormalizedExecutor, SpeedProbe, check_reference,
                          load_reference, probe_point_spec)
from policies.types import StepResult
from sim.step_features import step_features
from tests.test_profiler import KV_BYTES_PER_TOKEN, held_out_points, tiling, true_cost

PROBE_REFERENCE = 0.004   # the stand-in probe step's duration at speed 1


class Machine:
    """A shared machine whose speed the test sets (a factor on every step's duration)."""

    def __init__(self):
        self.slowdown = 1.0


class ProbeExecutor:
    """Times the probe plan at PROBE_REFERENCE x the machine's slowdown."""

    def __init__(self, machine: Machine):
        self.machine = machine

    def execute(self, plan):
        assert len(plan.seqs) == len(PROBE_POINT.decodes)
        return StepResult(duration=PROBE_REFERENCE * self.machine.slowdown)


class EveryStepProbe(SpeedProbe):
    def due(self) -> bool:   # a reading before every step, whatever the clock says
        return True


def probe_on(machine: Machine) -> SpeedProbe:
    return EveryStepProbe(ProbeExecutor(machine))


def test_probe_times_the_probe_point_and_keeps_every_reading():
    machine = Machine()
    probe = probe_on(machine)
    assert probe.measure() == pytest.approx(PROBE_REFERENCE)
    machine.slowdown = 3.0
    probe.measure()
    probe.measure()
    assert probe.readings == pytest.approx([PROBE_REFERENCE, 3 * PROBE_REFERENCE,
                                            3 * PROBE_REFERENCE])
    assert probe.reference() == pytest.approx(3 * PROBE_REFERENCE)   # the median


class ConstantStep:
    acceptance_stats = "the engine's"

    def __init__(self, machine, duration):
        self.machine = machine
        self.duration = duration

    def execute(self, plan):
        return StepResult(duration=self.duration * self.machine.slowdown)


def test_normalised_executor_times_steps_at_the_reference_speed():
    machine = Machine()
    executor = SpeedNormalizedExecutor(ConstantStep(machine, 0.05), probe_on(machine),
                                       PROBE_REFERENCE)
    machine.slowdown = 1.3
    durations = [executor.execute(None).duration for _ in range(3)]
    assert durations == pytest.approx([0.05] * 3)
    machine.slowdown = 0.8
    assert executor.execute(None).duration == pytest.approx(0.05)
    summary = executor.speed_summary()
    assert summary["speed_probes"] == 4 and summary["speed_factor_median"] == pytest.approx(1.3)
    assert summary["speed_factor_p05"] == pytest.approx(0.8 + 0.15 * (1.3 - 0.8))  # numpy's
    assert executor.acceptance_stats == "the engine's"       # the rest is the engine executor's


def test_probe_waits_its_interval_and_ten_times_its_own_duration():
    probe = SpeedProbe(ProbeExecutor(Machine()), interval_s=3600)
    assert probe.due()
    probe.measure()
    assert not probe.due() and len(probe.readings) == 1

    class Slow(ProbeExecutor):
        def execute(self, plan):
            time.sleep(0.02)
            return super().execute(plan)

    probe = SpeedProbe(Slow(Machine()), interval_s=1e-9)
    probe.measure()
    assert not probe.due()          # 0.02 s of probing: the next waits >= 0.2 s
    with pytest.raises(ValueError, match="interval"):
        SpeedProbe(ProbeExecutor(Machine()), interval_s=0)


class DriftingStandIn:
    """The profiler's known linear cost, on a machine that runs 40 % slow for 30 % of the calls."""

    def __init__(self, machine, block_size, calls):
        self.machine = machine
        self.block_size = block_size
        self.calls = calls

    def execute(self, plan):
        self.calls[0] += 1
        self.machine.slowdown = 1.4 if self.calls[0] % 100 >= 70 else 1.0
        return StepResult(duration=true_cost(step_features(plan, tiling(self.block_size)))
                          * self.machine.slowdown)


def test_profiler_normalises_a_drifting_machine_back_to_its_median_speed():
    machine, calls = Machine(), [0]

    def factory(block_size, num_blocks, num_host_blocks):
        return DriftingStandIn(machine, block_size, calls)

    grid = make_grid((16,))
    probe = probe_on(machine)
    prof = profile(factory, grid, repeats=3, progress=False, seed=1,
                   kv_bytes_per_token=KV_BYTES_PER_TOKEN, speed_probe=probe)
    slow = [s for s in prof.samples if s["raw_duration_s"] > s["duration_s"] * 1.2]
    assert slow, "the stand-in drifted"
    content = fit_profile(prof.samples)
    for point in held_out_points():
        if point.block_size != 16:
            continue
        features = step_features(build_plan(point), tiling(16))
        assert predict(content, features) == pytest.approx(true_cost(features), rel=0.02)
    reference = prof.speed_reference
    assert reference["point"] == probe_point_spec()
    assert reference["duration_s"] == pytest.approx(PROBE_REFERENCE)    # the median speed
    assert reference["factor_p05"] == pytest.approx(1.0)
    assert reference["factor_p95"] == pytest.approx(1.4)
    assert check_reference(json.loads(json.dumps(reference)), "it") == pytest.approx(
        PROBE_REFERENCE)

    # Without the probe the same machine misfits: some grid point is off by more than 5 %.
    calls[0] = 0
    raw = fit_profile(profile(factory, grid, repeats=3, progress=False, seed=1,
                              kv_bytes_per_token=KV_BYTES_PER_TOKEN).samples)
    errors = [abs(predict(raw, step_features(build_plan(p), tiling(16)))
                  / true_cost(step_features(build_plan(p), tiling(16))) - 1) for p in grid]
    assert max(errors) > 0.05


@pytest.mark.parametrize("reference, match", [
    (None, "no speed_reference"),
    ({"point": {}, "duration_s": 1.0}, "another probe shape"),
    ({"point": probe_point_spec(), "duration_s": -1.0}, "positive number"),
    ({"point": probe_point_spec(), "duration_s": "1"}, "positive number"),
])
def test_unusable_reference_is_a_clear_error(reference, match):
    with pytest.raises(ValueError, match=match):
        check_reference(reference, "profile p.json")


def test_load_reference_reads_a_profile(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"speed_reference": {"point": probe_point_spec(),
                                                    "duration_s": PROBE_REFERENCE}}))
    assert load_reference(path) == PROBE_REFERENCE
    with pytest.raises(ValueError, match="cannot read profile"):
        load_reference(tmp_path / "missing.json")
    path.write_text(json.dumps({"model": {}}))
    with pytest.raises(ValueError, match="no speed_reference"):
        load_reference(path)

