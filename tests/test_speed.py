"""The speed probe (calibration/cpu_noise/speed.py): its factor, the executor that normalises an engine run's
step durations with it, the profiler's normalised samples (a drifting stand-in machine is
recovered as if it had not drifted, also where prefills follow the drift less than decodes, or
follow the prefill probe's own drift), and clear errors for a profile without a usable
reference."""
from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest

from calibration.profiler.fit import fit_profile
from calibration.profiler.grid import make_grid, profile
from policies.types import StepResult
from runtime.step_shapes import build_plan
from calibration.cpu_noise.speed import (EXPONENT_KNOTS, PREFILL_PROBE_POINTS, PROBE_KNOTS,
                                             PROBE_POINT,
                                             SpeedNormalizedExecutor, SpeedProbe, SpeedReference,
                                             check_reference, fit_exponents, load_reference,
                                             normalize_samples, probe_point_spec,
                                             smoothed_factors, take_due_readings)

from factories import (KV_BYTES_PER_TOKEN, decode_plan, features_of, held_out_points, predict,
                       true_cost)

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
    # An interval far below a step's time: the profiler smooths no reading with another.
    return EveryStepProbe(ProbeExecutor(machine), interval_s=1e-12)


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
                                       SpeedReference(PROBE_REFERENCE))
    machine.slowdown = 1.3
    durations = [executor.execute(decode_plan(4, 128)).duration for _ in range(3)]
    assert durations == pytest.approx([0.05] * 3)
    machine.slowdown = 0.8
    assert executor.execute(decode_plan(4, 128)).duration == pytest.approx(0.05)
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
        return StepResult(duration=true_cost(features_of(plan, self.block_size))
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
        features = features_of(build_plan(point), 16)
        assert predict(content, features) == pytest.approx(true_cost(features), rel=0.02)
    reference = prof.speed_reference
    assert reference["point"] == probe_point_spec()
    assert reference["duration_s"] == pytest.approx(PROBE_REFERENCE)    # the median speed
    assert reference["factor_p05"] == pytest.approx(1.0)
    assert reference["factor_p95"] == pytest.approx(1.4)
    loaded = check_reference(json.loads(json.dumps(reference)), "it")
    assert loaded.duration_s == pytest.approx(PROBE_REFERENCE)
    # All its steps drift alike (but the probe sees a switch one step late).
    assert loaded.exponents == pytest.approx((1.0,) * len(EXPONENT_KNOTS), abs=0.1)

    # Without the probe the same machine misfits: some grid point is off by more than 5 %.
    calls[0] = 0
    raw = fit_profile(profile(factory, grid, repeats=3, progress=False, seed=1,
                              kv_bytes_per_token=KV_BYTES_PER_TOKEN).samples)
    errors = [abs(predict(raw, features_of(build_plan(p), 16))
                  / true_cost(features_of(build_plan(p), 16)) - 1) for p in grid]
    assert max(errors) > 0.05


@pytest.mark.parametrize("reference, match", [
    (None, "no speed_reference"),
    ({"point": {}, "duration_s": 1.0}, "another probe shape"),
    ({"point": probe_point_spec(), "duration_s": -1.0}, "positive number"),
    ({"point": probe_point_spec(), "duration_s": "1"}, "positive number"),
    ({"point": probe_point_spec(), "duration_s": 1.0, "exponent_knots": [0, 1],
      "exponents": [1, 1]}, "exponents must be"),
    ({"point": probe_point_spec(), "duration_s": 1.0, "exponent_knots": list(EXPONENT_KNOTS),
      "exponents": [1.0] * (len(EXPONENT_KNOTS) - 1) + [5.0]}, "exponents must be"),
])
def test_unusable_reference_is_a_clear_error(reference, match):
    with pytest.raises(ValueError, match=match):
        check_reference(reference, "profile p.json")


def test_load_reference_reads_a_profile(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"speed_reference": {"point": probe_point_spec(),
                                                    "duration_s": PROBE_REFERENCE}}))
    assert load_reference(path) == SpeedReference(PROBE_REFERENCE)   # exponents 1: an old one
    with pytest.raises(ValueError, match="cannot read profile"):
        load_reference(tmp_path / "missing.json")
    path.write_text(json.dumps({"model": {}}))
    with pytest.raises(ValueError, match="no speed_reference"):
        load_reference(path)



def true_exponent(num_prefill_tokens):
    """The stand-in machine's: decodes follow the probe one for one, long prefills at 0.6."""
    return np.interp(np.log2(1 + np.asarray(num_prefill_tokens, dtype=float)), EXPONENT_KNOTS,
                     (1.0, 1.0, 0.9, 0.7, 0.6, 0.6))


def test_fit_exponents_recovers_how_strongly_each_kind_of_step_follows_the_probe():
    rng = np.random.default_rng(0)
    tokens = rng.choice([0, 16, 64, 256, 1024, 4096], size=3000)
    groups = rng.integers(0, 60, size=3000) * 10 + np.searchsorted([0, 16, 64, 256, 1024], tokens)
    factors = np.exp(rng.normal(0, 0.15, size=3000))
    durations = (0.01 * (1 + groups % 7) * factors ** true_exponent(tokens)
                 * np.exp(rng.normal(0, 0.02, size=3000)))
    exponents = fit_exponents(tokens, factors, durations, groups)
    assert exponents == pytest.approx((1.0, 1.0, 0.9, 0.7, 0.6, 0.6), abs=0.05)
    # A knot without data takes its neighbours' value: here only decodes and 16-token
    # prefills were seen.
    seen = tokens <= 16
    exponents = fit_exponents(tokens[seen], factors[seen], durations[seen], groups[seen])
    assert exponents[:2] == pytest.approx((1.0, 1.0), abs=0.05)
    assert exponents[2:] == pytest.approx((exponents[1],) * 4, abs=0.01)


def test_normalised_executor_divides_by_the_factor_to_the_steps_exponent():
    machine = Machine()
    reference = SpeedReference(PROBE_REFERENCE, (1.0, 1.0, 0.9, 0.7, 0.6, 0.6))
    executor = SpeedNormalizedExecutor(ConstantStep(machine, 0.05), probe_on(machine), reference)
    machine.slowdown = 1.5
    prefill = build_plan(PROBE_POINT.__class__(0, "prefill", 16, prefills=((255, 0),)))
    assert reference.exponent(255) == pytest.approx(0.7)
    assert executor.execute(prefill).duration == pytest.approx(0.05 * 1.5 / 1.5 ** 0.7)
    assert executor.execute(decode_plan(4, 128)).duration == pytest.approx(0.05)


def test_smoothed_factor_is_the_median_of_the_readings_within_the_window():
    probe = SpeedProbe(ProbeExecutor(Machine()), interval_s=1.0)
    probe.readings = [1.0, 1.0, 5.0, 1.0, 2.0, 2.0, 2.0]
    probe.times = [0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0]   # 3.5 intervals either side
    assert smoothed_factors(np.asarray(probe.readings), probe).tolist() == [
        1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0]


class PartlyDriftingStandIn(DriftingStandIn):
    """Slows a step by the machine's slowdown to its true_exponent (drifting smoothly)."""

    def execute(self, plan):
        self.calls[0] += 1
        self.machine.slowdown = 1.0 + 0.3 * math.sin(self.calls[0] / 40)
        features = features_of(plan, self.block_size)
        return StepResult(duration=true_cost(features)
                          * self.machine.slowdown ** true_exponent(plan.num_prefill_tokens))


def test_profiler_recovers_the_cost_where_prefills_drift_less_than_the_probe():
    machine, calls = Machine(), [0]

    def factory(block_size, num_blocks, num_host_blocks):
        return PartlyDriftingStandIn(machine, block_size, calls)

    prof = profile(factory, make_grid((16,)), repeats=3, progress=False, seed=1,
                   kv_bytes_per_token=KV_BYTES_PER_TOKEN, speed_probe=probe_on(machine))
    content = fit_profile(prof.samples)
    median_slowdown = prof.speed_reference["duration_s"] / PROBE_REFERENCE   # the profile's speed
    for point in held_out_points():
        if point.block_size == 16:
            plan = build_plan(point)
            features = features_of(plan, 16)
            expected = true_cost(features) * median_slowdown ** true_exponent(
                plan.num_prefill_tokens)
            assert predict(content, features) == pytest.approx(expected, rel=0.02)
    # The grid's prefills reach 1536 tokens: every knot up to 1024 has data.
    assert prof.speed_reference["exponents"][:5] == pytest.approx((1.0, 1.0, 0.9, 0.7, 0.6),
                                                                  abs=0.05)



def test_profile_exponents_are_relative_to_decodes_so_reading_noise_cancels():
    """Noisy probe readings flatten every fitted exponent alike; decodes follow the probe (a
    decode) one for one, so dividing by theirs gives back the prefills' own."""
    rng = np.random.default_rng(1)
    probe = SpeedProbe(ProbeExecutor(Machine()), interval_s=1.0)
    speed = np.exp(0.15 * np.sin(np.arange(3000) / 25))
    probe.readings = list(PROBE_REFERENCE * speed * np.exp(rng.normal(0, 0.08, 3000)))
    probe.times = list(np.arange(3000.0))
    probed = []
    for reading in range(3000):
        tokens = int(rng.choice([0, 16, 64, 256, 1024]))
        group = reading % 50 * 5 + [0, 16, 64, 256, 1024].index(tokens)
        duration = 0.01 * (1 + group % 3) * speed[reading] ** float(true_exponent(tokens))
        probed.append(({"num_prefill_tokens": tokens, "duration_s": duration}, reading, group))
    reference = normalize_samples(probed, probe)
    assert reference["exponents"][:5] == pytest.approx((1.0, 1.0, 0.9, 0.7, 0.6), abs=0.06)
    normalised = [sample["duration_s"] / (0.01 * (1 + group % 3)) for sample, _, group in probed]
    assert np.median(normalised) == pytest.approx(1.0, abs=0.03)


def test_a_run_that_cannot_show_the_decodes_following_the_probe_keeps_the_plain_factor():
    probe = SpeedProbe(ProbeExecutor(Machine()), interval_s=1.0)
    probe.readings = [PROBE_REFERENCE * f for f in (1.0, 1.2, 0.9, 1.1)]
    probe.times = [0.0, 10.0, 20.0, 30.0]
    # Decode durations that move against the probe: no exponent to learn from them.
    probed = [({"num_prefill_tokens": 0, "duration_s": 0.01 / f}, reading, 0)
              for reading, f in enumerate((1.0, 1.2, 0.9, 1.1))]
    assert normalize_samples(probed, probe)["exponents"] == [1.0] * len(EXPONENT_KNOTS)


PREFILL_PROBE_REFERENCES = (0.006, 0.022)   # the stand-in prefill probes' durations at speed 1


class TwoSpeedMachine(Machine):
    """A machine on which a step's per-token work drifts on its own: a step with prompt tokens
    slows by `prefill_slowdown` ** (its share of per-token work, growing with its prompt)."""

    def __init__(self):
        super().__init__()
        self.prefill_slowdown = 1.0

    def slowdown_of(self, plan) -> float:
        tokens = plan.num_prefill_tokens
        if tokens == 0:
            return self.slowdown
        share = min(math.log2(1 + tokens) / math.log2(257), 1.0)
        return self.slowdown ** (1 - share) * self.prefill_slowdown ** share


class TwoProbeExecutor:
    """Times any probe's plan at its reference duration x the machine's slowdown for it."""

    def __init__(self, machine: TwoSpeedMachine):
        self.machine = machine

    def execute(self, plan):
        reference = dict(zip((32, 256), PREFILL_PROBE_REFERENCES)).get(plan.num_prefill_tokens,
                                                                        PROBE_REFERENCE)
        return StepResult(duration=reference * self.machine.slowdown_of(plan))


def probes_on(machine: TwoSpeedMachine) -> tuple[SpeedProbe, tuple[SpeedProbe, ...]]:
    return (EveryStepProbe(TwoProbeExecutor(machine), interval_s=1e-12),
            tuple(EveryStepProbe(TwoProbeExecutor(machine), interval_s=1e-12, point=point)
                  for point in PREFILL_PROBE_POINTS))


def prompt_plan(tokens: int):
    return build_plan(PROBE_POINT.__class__(0, "prefill", 16, prefills=((tokens, 0),)))


def test_prefill_probes_read_only_before_steps_with_prompt_tokens():
    probe, prefill_probes = probes_on(TwoSpeedMachine())
    assert take_due_readings(decode_plan(4, 128), probe, prefill_probes)
    assert [len(p.readings) for p in (probe, *prefill_probes)] == [1, 0, 0]
    assert take_due_readings(prompt_plan(100), probe, prefill_probes)
    assert [len(p.readings) for p in (probe, *prefill_probes)] == [2, 1, 1]
    assert [p.readings[0] for p in prefill_probes] == pytest.approx(PREFILL_PROBE_REFERENCES)
    # Not due: no reading, even before a prompt step.
    machine = TwoSpeedMachine()
    quiet = SpeedProbe(TwoProbeExecutor(machine), interval_s=3600)
    quiet_prefill = tuple(SpeedProbe(TwoProbeExecutor(machine), interval_s=3600, point=point)
                          for point in PREFILL_PROBE_POINTS)
    assert take_due_readings(prompt_plan(100), quiet, quiet_prefill)
    assert not take_due_readings(prompt_plan(100), quiet, quiet_prefill)


def test_normalised_executor_interpolates_the_probes_by_the_steps_prompt_tokens():
    machine = TwoSpeedMachine()
    reference = SpeedReference(PROBE_REFERENCE, prefill_durations_s=PREFILL_PROBE_REFERENCES)
    probe, prefill_probes = probes_on(machine)
    executor = SpeedNormalizedExecutor(ConstantStep(machine, 0.05), probe, reference,
                                       prefill_probes)
    machine.slowdown, machine.prefill_slowdown = 0.8, 1.1
    # The step's own duration drifts with the decode speed; the probes read 0.8 (decodes),
    # 0.8 ** (1 - s) * 1.1 ** s (32 tokens, s = log2(33) / log2(257)) and 1.1 (256 tokens).
    assert executor.execute(decode_plan(4, 128)).duration == pytest.approx(0.05)
    short = math.log2(33) / math.log2(257)
    for tokens in (1, 15, 32, 100, 256, 1000):
        # Any prompt step follows the prefill probes alone: flat below 32 and above 256 tokens.
        position = math.log2(1 + tokens)
        log_factor = np.interp(position, PROBE_KNOTS,
                               [(1 - short) * math.log(0.8) + short * math.log(1.1),
                                math.log(1.1)])
        assert executor.execute(prompt_plan(tokens)).duration == pytest.approx(
            0.05 * 0.8 / math.exp(log_factor))
    summary = executor.speed_summary()
    assert summary["prefill_speed_factor_medians"] == pytest.approx(
        [0.8 ** (1 - short) * 1.1 ** short, 1.1])
    assert summary["prefill_speed_probes"] == 12 and summary["speed_probes"] == 7
    with pytest.raises(ValueError, match="needs as many prefill probes"):
        SpeedNormalizedExecutor(ConstantStep(machine, 0.05), probe, reference)
    with pytest.raises(ValueError, match="needs as many prefill probes"):
        SpeedNormalizedExecutor(ConstantStep(machine, 0.05), probe,
                                SpeedReference(PROBE_REFERENCE), prefill_probes)


class TwoSpeedStandIn(DriftingStandIn):
    """The profiler's known linear cost on a machine whose decodes and per-token work drift
    apart: decodes faster in the middle of the run, per-token work slower at its end."""

    def execute(self, plan):
        self.calls[0] += 1
        phase = self.calls[0] % 300
        self.machine.slowdown = 0.7 if 100 <= phase < 200 else 1.0
        self.machine.prefill_slowdown = 1.3 if phase >= 200 else 1.0
        return StepResult(duration=true_cost(features_of(plan, self.block_size))
                          * self.machine.slowdown_of(plan))


def test_profiler_with_prefill_probes_recovers_costs_where_prompts_drift_on_their_own():
    machine, calls = TwoSpeedMachine(), [0]

    def factory(block_size, num_blocks, num_host_blocks):
        return TwoSpeedStandIn(machine, block_size, calls)

    probe, prefill_probes = probes_on(machine)
    prof = profile(factory, make_grid((16,)), repeats=3, progress=False, seed=1,
                   kv_bytes_per_token=KV_BYTES_PER_TOKEN, speed_probe=probe,
                   prefill_probes=prefill_probes)
    content = fit_profile(prof.samples)
    for point in held_out_points():
        if point.block_size == 16:
            features = features_of(build_plan(point), 16)
            assert predict(content, features) == pytest.approx(true_cost(features), rel=0.02)
    reference = prof.speed_reference
    assert reference["prefill_points"] == [probe_point_spec(p) for p in PREFILL_PROBE_POINTS]
    assert reference["prefill_durations_s"] == pytest.approx(PREFILL_PROBE_REFERENCES)
    assert reference["prefill_factor_p95"][1] == pytest.approx(1.3)
    loaded = check_reference(json.loads(json.dumps(reference)), "it")
    assert loaded.prefill_durations_s == pytest.approx(PREFILL_PROBE_REFERENCES)
    assert loaded.exponents == (1.0,) * len(EXPONENT_KNOTS)   # the prefill probes replace them

    # With the decode probe alone the same machine misfits some prompt step by more than 5 %.
    calls[0] = 0
    decode_only = fit_profile(profile(factory, make_grid((16,)), repeats=3, progress=False,
                                      seed=1, kv_bytes_per_token=KV_BYTES_PER_TOKEN,
                                      speed_probe=probes_on(machine)[0]).samples)
    errors = [abs(predict(decode_only, features_of(build_plan(p), 16))
                  / true_cost(features_of(build_plan(p), 16)) - 1) for p in held_out_points()
              if p.block_size == 16]
    assert max(errors) > 0.05
    with pytest.raises(ValueError, match="need the .decode. speed probe"):
        profile(factory, make_grid((16,)), repeats=1, progress=False,
                kv_bytes_per_token=KV_BYTES_PER_TOKEN, prefill_probes=prefill_probes)


@pytest.mark.parametrize("prefill, match", [
    ({"prefill_points": [probe_point_spec()] * 2, "prefill_durations_s": [0.01, 0.02]},
     "other shapes"),
    ({"prefill_points": [probe_point_spec(p) for p in PREFILL_PROBE_POINTS][:1],
      "prefill_durations_s": [0.01]}, "other shapes"),
    ({"prefill_points": [probe_point_spec(p) for p in PREFILL_PROBE_POINTS],
      "prefill_durations_s": [0.01, 0]}, "prefill_durations_s must be"),
    ({"prefill_points": [probe_point_spec(p) for p in PREFILL_PROBE_POINTS],
      "prefill_durations_s": [True, 0.02]}, "prefill_durations_s must be"),
    ({"prefill_points": [probe_point_spec(p) for p in PREFILL_PROBE_POINTS],
      "prefill_durations_s": 0.01}, "prefill_durations_s must be"),
])
def test_unusable_prefill_reference_is_a_clear_error(prefill, match):
    with pytest.raises(ValueError, match=match):
        check_reference({"point": probe_point_spec(), "duration_s": 1.0, **prefill}, "p.json")
