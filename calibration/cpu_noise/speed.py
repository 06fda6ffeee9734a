"""Speed normalisation: on a shared machine every step shape slows down and speeds up together
from one moment to the next, so timings taken minutes apart compare only at one machine speed.

A probe times one small fixed step every `interval_s`; its duration over a reference duration is
the machine's speed factor, and a step slows down by factor ** exponent (fitted per prefill-token
class: compute-bound steps follow the probe less than decodes). Prefill probes (32 and 256-token
prompts) run only before steps with prompt tokens, since a decode probe's reading depends on what
ran before it; with them a step's slowdown is interpolated between their factors instead.

The profiler divides each sample by its slowdown against the run's median (its profile's
`speed_reference`); an engine run given that reference does the same to every step
(`SpeedNormalizedExecutor`), so that both are timed at the profile's machine speed.
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from pathlib import Path

import numpy as np

from runtime.step_shapes import GridPoint, build_plan

# Small and quick, so that probing often costs little: a decode batch of 4 over 128 tokens.
PROBE_POINT = GridPoint(0, "decode", 16, decodes=(128,) * 4)
# Lone prompts, short and long: how a light load's arriving prompts run.
PREFILL_PROBE_POINTS = (GridPoint(0, "prefill", 16, prefills=((32, 0),)),
                        GridPoint(0, "prefill", 16, prefills=((256, 0),)))
# Where each prefill probe's factor holds: log2(1 + its prompt tokens); a step with prompt tokens
# has its slowdown interpolated between them, flat beyond.
PROBE_KNOTS = tuple(math.log2(1 + point.prefills[0][0]) for point in PREFILL_PROBE_POINTS)
PROBE_POOL_BLOCKS = max(point.num_blocks_needed() for point in (PROBE_POINT, *PREFILL_PROBE_POINTS))
DEFAULT_INTERVAL_S = 0.05   # often: the machine's slow phases can last a tenth of a second
# The prefill probes cost ~7 decode probes and only run before prompt steps: less often.
DEFAULT_PREFILL_INTERVAL_S = 0.3
MAX_PROBE_SHARE = 0.1   # probes wait at least 10x their own duration: at most ~10 % more time
# Where the speed exponent is fitted: log2(1 + the step's prefill tokens) of 0 (decodes only),
# ~16, 64, 256, 1024 and 4096 tokens; linear in between, flat beyond.
EXPONENT_KNOTS = (0.0, 4.0, 6.0, 8.0, 10.0, 12.0)
# The profiler's factor for a sample: the median of the readings within this many intervals
# either side (a single reading carries a few % of noise).
SMOOTHING_INTERVALS = 3.5
# Each exponent is pulled toward its neighbours with the weight of this many typical samples, so
# a knot with little data follows the ones around it.
EXPONENT_PRIOR_SAMPLES = 5
# The decodes' fitted exponent below which the run cannot tell how steps follow the probe (the
# probe's own noise flattens every fitted exponent).
MIN_DECODE_EXPONENT = 0.3


def probe_point_spec(point: GridPoint = PROBE_POINT) -> dict:
    """A probe shape as a profile's JSON records it (a reference only holds for it)."""
    return json.loads(json.dumps(dataclasses.asdict(point)))


def _is_probe_point(recorded, point: GridPoint = PROBE_POINT) -> bool:
    """Whether a recorded probe shape is `point`; a GridPoint field it lacks (added since) had
    its default value."""
    if not isinstance(recorded, dict):
        return False
    defaults = json.loads(json.dumps({field.name: field.default
                                      for field in dataclasses.fields(GridPoint)
                                      if field.default is not dataclasses.MISSING}))
    return {**defaults, **recorded} == probe_point_spec(point)


class SpeedProbe:
    """Times `point` on `executor` (with a pool of its own) when a reading is due."""

    def __init__(self, executor, interval_s: float = DEFAULT_INTERVAL_S, seed: int = 0,
                 point: GridPoint = PROBE_POINT):
        if not interval_s > 0:
            raise ValueError(f"the speed probe's interval must be > 0 s, got {interval_s!r}")
        self.executor = executor
        self.point = point
        self.plan = build_plan(point, np.random.default_rng(seed), PROBE_POOL_BLOCKS, 0)
        self.interval_s = interval_s
        self.readings: list[float] = []   # the probe step's duration, per reading
        self.times: list[float] = []      # when each reading was taken (perf_counter, s)
        self.probe_time_s = 0.0           # wall time spent probing
        self._next = -math.inf
        for _ in range(3):                # untimed: the first runs pay one-time costs
            executor.execute(self.plan)

    def due(self) -> bool:
        return time.perf_counter() >= self._next

    def measure(self) -> float:
        start = time.perf_counter()
        duration = float(self.executor.execute(self.plan).duration)
        end = time.perf_counter()
        self.probe_time_s += end - start
        self._next = end + max(self.interval_s, (end - start) / MAX_PROBE_SHARE)
        self.readings.append(duration)
        self.times.append(start)
        return duration

    def reference(self) -> float:
        """The probe step's median duration over every reading."""
        if not self.readings:
            raise ValueError("the speed probe has no readings")
        return statistics.median(self.readings)


def take_due_readings(plan, probe: SpeedProbe, prefill_probes: tuple[SpeedProbe, ...] = ()
                      ) -> bool:
    """Before running `plan`: the decode probe's reading when due, and each prefill probe's when
    due and `plan` has prompt tokens (so that no decode-only step follows a probe's prompt).
    Whether any reading was taken."""
    measured = probe.due()
    if measured:
        probe.measure()
    if plan.num_prefill_tokens > 0:
        for prefill_probe in prefill_probes:
            if prefill_probe.due():
                prefill_probe.measure()
                measured = True
    return measured


@dataclasses.dataclass(frozen=True)
class SpeedReference:
    """A profile's speed reference: the probe step's duration at the profile's machine speed,
    and how strongly a step follows the probe (an exponent at each of EXPONENT_KNOTS)."""

    duration_s: float
    exponents: tuple[float, ...] = (1.0,) * len(EXPONENT_KNOTS)
    # The prefill probes' (PREFILL_PROBE_POINTS), where the profile had them: then they, not
    # the exponents, say how a prompt step follows the machine.
    prefill_durations_s: tuple[float, ...] = ()

    def exponent(self, num_prefill_tokens: float) -> float:
        return float(np.interp(math.log2(1 + num_prefill_tokens), EXPONENT_KNOTS,
                               self.exponents))

    def slowdown(self, factor: float, num_prefill_tokens: float,
                 prefill_factors: tuple[float, ...] = ()) -> float:
        """How much slower than at the reference speed a step with this many prefill tokens runs
        while the probes read these factors."""
        if not self.prefill_durations_s:
            return factor ** self.exponent(num_prefill_tokens)
        if num_prefill_tokens == 0:
            return factor
        # A step with any prompt follows the prefill probes, never the decode probe's context.
        logs = [math.log(f) for f in prefill_factors]
        return math.exp(float(np.interp(math.log2(1 + num_prefill_tokens), PROBE_KNOTS, logs)))


def smoothed_factors(factors: np.ndarray, probe: SpeedProbe) -> np.ndarray:
    """Each reading's factor smoothed as the median within SMOOTHING_INTERVALS probe intervals
    of it (centred, since the profiler normalises after the run)."""
    times = np.asarray(probe.times)
    half_window = SMOOTHING_INTERVALS * probe.interval_s
    lows = np.searchsorted(times, times - half_window, side="left")
    highs = np.searchsorted(times, times + half_window, side="right")
    return np.array([np.median(factors[low:high]) for low, high in zip(lows, highs)])


def fit_exponents(num_prefill_tokens, factors, durations, groups) -> tuple[float, ...]:
    """The exponents at EXPONENT_KNOTS of duration ~ factor ** exponent(prefill tokens): least
    squares on logs centred within each group (so each point's own cost cancels), piecewise
    linear, each knot pulled toward its neighbours where its data are few."""
    _, group_of = np.unique(np.asarray(groups), return_inverse=True)
    group_sizes = np.bincount(group_of)

    def centred(values):
        logs = np.log(np.asarray(values, dtype=float))
        return logs - (np.bincount(group_of, logs) / group_sizes)[group_of]

    x, y = centred(factors), centred(durations)
    position = np.log2(1 + np.asarray(num_prefill_tokens, dtype=float))
    weights = np.stack([np.interp(position, EXPONENT_KNOTS, np.eye(len(EXPONENT_KNOTS))[knot])
                        for knot in range(len(EXPONENT_KNOTS))], axis=1)
    design = x[:, None] * weights
    prior = EXPONENT_PRIOR_SAMPLES * max(float(np.mean(x * x)), 1e-12)
    differences = np.diff(np.eye(len(EXPONENT_KNOTS)), axis=0)
    # Each knot is pulled toward its neighbours (a knot without data takes theirs) and, faintly,
    # toward 1 (so that no data at all gives the plain factor).
    gram = (design.T @ design + prior * differences.T @ differences
            + 1e-3 * prior * np.eye(len(EXPONENT_KNOTS)))
    exponents = np.linalg.solve(gram, design.T @ y + 1e-3 * prior)
    return tuple(float(e) for e in np.clip(exponents, 0.0, 2.0))


def normalize_samples(probed: list[tuple[dict, int, int]], probe: SpeedProbe,
                      prefill_probes: tuple[SpeedProbe, ...] = (),
                      prefill_readings: list[tuple[int, ...]] | None = None) -> dict:
    """Divide each sample's duration_s by its slowdown at the smoothed factor of the reading
    before it (keeping raw_duration_s and speed_factor), after fitting the exponents on them;
    returns the profile's `speed_reference`. With prefill probes their factors replace the
    exponents."""
    reference = probe.reference()
    raw_factors = np.asarray(probe.readings) / reference
    factors = smoothed_factors(raw_factors, probe)
    for sample, reading, _ in probed:
        sample["raw_duration_s"] = sample["duration_s"]
        sample["speed_factor"] = float(factors[reading])
    speed = SpeedReference(reference)   # the plain factor, unless the run shows better
    prefill, prefill_factors = {}, [()] * len(probed)
    if prefill_probes:
        references = [prefill_probe.reference() for prefill_probe in prefill_probes]
        raw = [np.asarray(prefill_probe.readings) / reference
               for prefill_probe, reference in zip(prefill_probes, references)]
        smoothed = [smoothed_factors(factors, prefill_probe)
                    for factors, prefill_probe in zip(raw, prefill_probes)]
        # A decode-only step before the first prompt step has no prefill reading, nor needs one.
        prefill_factors = [tuple(float(factors[max(reading, 0)])
                                 for factors, reading in zip(smoothed, readings, strict=True))
                           for readings in prefill_readings]
        speed = SpeedReference(reference, prefill_durations_s=tuple(references))
        prefill = {"prefill_points": [probe_point_spec(p.point) for p in prefill_probes],
                   "prefill_durations_s": references,
                   "prefill_interval_s": prefill_probes[0].interval_s,
                   "prefill_num_readings": [len(factors) for factors in raw],
                   "prefill_factor_p05": [float(np.percentile(f, 5)) for f in raw],
                   "prefill_factor_p95": [float(np.percentile(f, 95)) for f in raw]}
    elif probed:
        fitted = fit_exponents([s["num_prefill_tokens"] for s, _, _ in probed],
                               [s["speed_factor"] for s, _, _ in probed],
                               [s["raw_duration_s"] for s, _, _ in probed],
                               [group for _, _, group in probed])
        # Relative to decodes, which follow the probe one for one, since the factor's noise
        # flattens every fitted exponent by the same ratio; a run too steady to show it keeps the
        # plain factor.
        if fitted[0] >= MIN_DECODE_EXPONENT:
            speed = SpeedReference(reference, tuple(min(exponent / fitted[0], 2.0)
                                                    for exponent in fitted))
    for (sample, _, _), factors in zip(probed, prefill_factors, strict=True):
        sample["duration_s"] = sample["raw_duration_s"] / speed.slowdown(
            sample["speed_factor"], sample["num_prefill_tokens"], factors)
    return {"point": probe_point_spec(), "duration_s": reference,
            "interval_s": probe.interval_s, "num_readings": len(raw_factors),
            "factor_p05": float(np.percentile(raw_factors, 5)),
            "factor_p95": float(np.percentile(raw_factors, 95)),
            "exponent_knots": list(EXPONENT_KNOTS), "exponents": list(speed.exponents),
            **prefill}


def load_reference(profile_path) -> SpeedReference:
    """The speed reference of a profile JSON file."""
    try:
        content = json.loads(Path(profile_path).read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"backend.speed_reference: cannot read profile {profile_path!r}: "
                         f"{error}") from None
    return check_reference(content.get("speed_reference"), f"profile {profile_path}")


def check_reference(reference: dict | None, source: str) -> SpeedReference:
    """A profile's `speed_reference` (exponents 1 where it has none: before they were fitted),
    or a clear error."""
    if not reference:
        raise ValueError(f"{source} has no speed_reference: re-take it with twinserve-profile "
                         f"(its speed probe is on by default), or run without "
                         f"backend.speed_reference")
    if not _is_probe_point(reference.get("point")):
        raise ValueError(f"{source}: its speed_reference was taken on another probe shape than "
                         f"calibration/cpu_noise/speed.py's PROBE_POINT; re-take the "
                         f"profile")
    duration = reference.get("duration_s")
    if isinstance(duration, bool) or not isinstance(duration, (int, float)) or not duration > 0:
        raise ValueError(f"{source}: speed_reference.duration_s must be a positive number of "
                         f"seconds, got {duration!r}")
    prefill_durations = ()
    if "prefill_durations_s" in reference:
        prefill_durations = reference["prefill_durations_s"]
        points = reference.get("prefill_points")
        if (not isinstance(points, list) or len(points) != len(PREFILL_PROBE_POINTS)
                or not all(_is_probe_point(recorded, point)
                           for recorded, point in zip(points, PREFILL_PROBE_POINTS))):
            raise ValueError(f"{source}: its speed_reference's prefill probes were taken on other "
                             f"shapes than calibration/cpu_noise/speed.py's "
                             f"PREFILL_PROBE_POINTS; re-take the profile")
        if (not isinstance(prefill_durations, list)
                or len(prefill_durations) != len(PREFILL_PROBE_POINTS)
                or not all(not isinstance(d, bool) and isinstance(d, (int, float)) and d > 0
                           for d in prefill_durations)):
            raise ValueError(f"{source}: speed_reference.prefill_durations_s must be "
                             f"{len(PREFILL_PROBE_POINTS)} positive numbers of seconds, got "
                             f"{prefill_durations!r}")
        prefill_durations = tuple(float(d) for d in prefill_durations)
    exponents = reference.get("exponents")
    if exponents is None:
        return SpeedReference(float(duration), prefill_durations_s=prefill_durations)
    if (reference.get("exponent_knots") != list(EXPONENT_KNOTS)
            or len(exponents) != len(EXPONENT_KNOTS)
            or not all(isinstance(e, (int, float)) and 0 <= e <= 2 for e in exponents)):
        raise ValueError(f"{source}: speed_reference.exponents must be {len(EXPONENT_KNOTS)} "
                         f"numbers in [0, 2] at exponent_knots {list(EXPONENT_KNOTS)}, got "
                         f"{exponents!r} at {reference.get('exponent_knots')!r}; re-take the "
                         f"profile")
    return SpeedReference(float(duration), tuple(float(e) for e in exponents), prefill_durations)


class SpeedNormalizedExecutor:
    """An executor wrapper whose step durations are divided by their slowdown at the machine's
    latest speed factors against `reference` (a profile's), so that the run's clock runs at the
    profile's machine speed."""

    def __init__(self, executor, probe: SpeedProbe, reference: SpeedReference,
                 prefill_probes: tuple[SpeedProbe, ...] = ()):
        if len(prefill_probes) != len(reference.prefill_durations_s):
            raise ValueError(f"a speed reference with {len(reference.prefill_durations_s)} "
                             f"prefill probes' durations needs as many prefill probes, got "
                             f"{len(prefill_probes)}")
        self.executor = executor
        self.probe = probe
        self.prefill_probes = tuple(prefill_probes)
        self.reference = reference

    def execute(self, plan):
        take_due_readings(plan, self.probe, self.prefill_probes)
        result = self.executor.execute(plan)
        factor = self.probe.readings[-1] / self.reference.duration_s
        prefill_factors = ()
        if plan.num_prefill_tokens > 0:   # (a prompt step: every prefill probe has a reading)
            prefill_factors = tuple(
                prefill_probe.readings[-1] / duration for prefill_probe, duration
                in zip(self.prefill_probes, self.reference.prefill_durations_s))
        result.duration = result.duration / self.reference.slowdown(
            factor, plan.num_prefill_tokens, prefill_factors)
        return result

    def speed_summary(self) -> dict:
        """The speed factors of every reading (the probes' durations over the reference)."""
        factors = np.asarray(self.probe.readings) / self.reference.duration_s
        summary = {"speed_factor_median": float(np.median(factors)),
                   "speed_factor_p05": float(np.percentile(factors, 5)),
                   "speed_factor_p95": float(np.percentile(factors, 95)),
                   "speed_probes": len(factors), "speed_probe_s": self.probe.probe_time_s}
        if self.prefill_probes and all(p.readings for p in self.prefill_probes):
            summary["prefill_speed_factor_medians"] = [
                float(np.median(np.asarray(p.readings) / duration)) for p, duration
                in zip(self.prefill_probes, self.reference.prefill_durations_s)]
            summary["prefill_speed_probes"] = sum(len(p.readings) for p in self.prefill_probes)
        summary["speed_probe_s"] += sum(p.probe_time_s for p in self.prefill_probes)
        return summary

    def __getattr__(self, name):   # acceptance_stats and the rest: the wrapped executor's
        return getattr(self.executor, name)
