"""A speed meter for a shared machine, so that timings taken minutes apart compare.

On a shared VM the same engine step runs 10-25 % faster or slower from one minute to the next
(other tenants' load; the guest's CPU clock does not see it, so thread time drifts the same), and
all step shapes drift together. A profile taken at one speed then mispredicts an engine run taken
at another by the whole drift, whatever the cost model. The probe times a few fixed step shapes
(its own small KV pool, never the run's) every `interval_s` of wall time; the median of their
durations over reference durations (robust to one shape's hiccup), averaged over the latest two
readings (a burst shorter than the interval counts half), is the machine's current speed factor.

- The profiler probes while it profiles: the reference is the probes' median over its run, and
  every sample is divided by the factor of the latest probe (`normalize_samples`).
- An engine run given that reference (`backend.speed_reference=<profile>`, which
  twinserve-validate sets) divides every step's measured duration by the latest factor
  (`SpeedNormalizedExecutor`), so both time steps at the profile's machine speed.

Measured on this 2-core VM (a minute of random step shapes with a probe every 0.5 s): the
drift of 10-second medians from the overall median went from 3.5 % mean / 10.7 % max to 1.4 % /
3.0 %, for about 8 % more wall time; a profile's fit in a busy hour from R² 0.958 (7.2 % mean
error per grid point) on the raw samples to 0.977 (4.6 %) on the normalised ones.
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from typing import Sequence

import numpy as np

from engine.step_shapes import GridPoint, build_plan

# A small decode batch (per-step overhead), a prefill (matmuls) and a large decode batch
# (attention over many blocks): the three regimes a step's cost comes from.
PROBE_POINTS: tuple[GridPoint, ...] = (
    GridPoint(0, "decode", 16, decodes=(128,) * 4),
    GridPoint(1, "prefill", 16, prefills=((128, 0),)),
    GridPoint(2, "decode", 16, decodes=(256,) * 32),
)
PROBE_POOL_BLOCKS = max(point.num_blocks_needed() for point in PROBE_POINTS)
DEFAULT_INTERVAL_S = 0.5
SMOOTHING_READINGS = 2


def speed_factor(durations: Sequence[float], reference: Sequence[float]) -> float:
    """How much slower than the reference one reading ran (> 1: slower)."""
    return statistics.median(d / r for d, r in zip(durations, reference))


def applied_factor(factors: Sequence[float], index: int) -> float:
    """The factor that times steps after reading `index`: the mean of the latest readings'."""
    window = factors[max(0, index - SMOOTHING_READINGS + 1): index + 1]
    return sum(window) / len(window)


def probe_points_spec() -> list[dict]:
    """The probe shapes as a profile's JSON records them (a reference only holds for these)."""
    return json.loads(json.dumps([dataclasses.asdict(point) for point in PROBE_POINTS]))


class SpeedProbe:
    """Times PROBE_POINTS on `executor` (with a pool of its own, of at least PROBE_POOL_BLOCKS
    blocks of 16) when a reading is due: at most every interval_s."""

    def __init__(self, executor, interval_s: float = DEFAULT_INTERVAL_S, seed: int = 0):
        if not interval_s > 0:
            raise ValueError(f"the speed probe's interval must be > 0 s, got {interval_s!r}")
        rng = np.random.default_rng(seed)
        self.executor = executor
        self.plans = [build_plan(point, rng, PROBE_POOL_BLOCKS, 0) for point in PROBE_POINTS]
        self.interval_s = interval_s
        self.readings: list[list[float]] = []   # durations of every probe point, per probe
        self.probe_time_s = 0.0                 # wall time spent probing
        self._last = -math.inf
        for plan in self.plans:                 # untimed: first runs pay one-time costs
            executor.execute(plan)

    def due(self) -> bool:
        return time.perf_counter() - self._last >= self.interval_s

    def measure(self) -> list[float]:
        start = time.perf_counter()
        durations = [float(self.executor.execute(plan).duration) for plan in self.plans]
        self._last = time.perf_counter()
        self.probe_time_s += self._last - start
        self.readings.append(durations)
        return durations

    def reference(self) -> list[float]:
        """Each probe point's median duration over every reading."""
        if not self.readings:
            raise ValueError("the speed probe has no readings")
        return [statistics.median(column) for column in zip(*self.readings)]


def normalize_samples(samples: list[dict], reading_of_sample: list[int],
                      probe: SpeedProbe) -> dict:
    """Divide each profile sample's duration_s by the speed factor of the probe reading before it
    (raw_duration_s and speed_factor keep what was measured); returns the profile's
    `speed_reference`."""
    reference = probe.reference()
    factors = [speed_factor(durations, reference) for durations in probe.readings]
    for sample, reading in zip(samples, reading_of_sample):
        sample["raw_duration_s"] = sample["duration_s"]
        sample["speed_factor"] = applied_factor(factors, reading)
        sample["duration_s"] = sample["raw_duration_s"] / sample["speed_factor"]
    return {"points": probe_points_spec(), "durations_s": reference,
            "interval_s": probe.interval_s, "num_readings": len(factors),
            "factor_min": min(factors), "factor_max": max(factors)}


def load_reference(profile_path) -> list[float]:
    """The speed reference durations of a profile JSON file."""
    try:
        content = json.loads(open(profile_path).read())
    except (OSError, ValueError) as error:
        raise ValueError(f"backend.speed_reference: cannot read profile {profile_path!r}: "
                         f"{error}") from None
    return check_reference(content.get("speed_reference"), f"profile {profile_path}")


def check_reference(reference: dict | None, source: str) -> list[float]:
    """The reference durations of a profile's `speed_reference`, or a clear error."""
    if not reference:
        raise ValueError(f"{source} has no speed_reference: re-take it with twinserve-profile "
                         f"(its speed probe is on by default), or run without "
                         f"backend.speed_reference")
    if reference.get("points") != probe_points_spec():
        raise ValueError(f"{source}: its speed_reference was taken on other probe shapes than "
                         f"engine/speed.py's PROBE_POINTS; re-take the profile")
    durations = reference.get("durations_s")
    if (not isinstance(durations, list) or len(durations) != len(PROBE_POINTS)
            or not all(isinstance(d, (int, float)) and d > 0 for d in durations)):
        raise ValueError(f"{source}: speed_reference.durations_s must be {len(PROBE_POINTS)} "
                         f"positive numbers, got {durations!r}")
    return [float(d) for d in durations]


class SpeedNormalizedExecutor:
    """An engine executor whose step durations are divided by the machine's latest speed factor
    against `reference` (a profile's probe durations): the run's clock runs at the profile's
    machine speed. Everything else is the wrapped executor's."""

    def __init__(self, executor, probe: SpeedProbe, reference: Sequence[float]):
        self.executor = executor
        self.probe = probe
        self.reference = list(reference)
        self.factors: list[float] = []   # of every reading
        self.factor = 1.0                # the one applied now

    def execute(self, plan):
        if self.probe.due():
            self.factors.append(speed_factor(self.probe.measure(), self.reference))
            self.factor = applied_factor(self.factors, len(self.factors) - 1)
        result = self.executor.execute(plan)
        result.duration = result.duration / self.factor
        return result

    def speed_summary(self) -> dict:
        return {"speed_factor_median": statistics.median(self.factors),
                "speed_factor_min": min(self.factors), "speed_factor_max": max(self.factors),
                "speed_probes": len(self.factors), "speed_probe_s": self.probe.probe_time_s}

    def __getattr__(self, name):   # acceptance_stats and the rest: the engine executor's
        return getattr(self.executor, name)
