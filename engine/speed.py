"""A speed meter for a shared machine, so that timings taken minutes apart compare.

On a shared VM the same engine step runs faster or slower from one moment to the next (other
tenants' load; the guest's CPU clock does not see it, so thread time drifts the same): slow phases
last from a tenth of a second to minutes, and every step shape slows down with them. A profile
taken at one speed then mispredicts an engine run taken at another by the whole drift, whatever
the cost model. The probe times one small fixed step (a decode batch of 4, on its own small KV
pool, never the run's) every `interval_s` of wall time, or less often where a probe would take
more than a tenth of that time; that step's duration over its reference duration is the
machine's current speed factor.

- The profiler probes while it profiles: the reference is the probe's median over its run, and
  every sample is divided by the factor of the latest probe (`normalize_samples`).
- An engine run given that reference (`backend.speed_reference=<profile>`, which
  twinserve-validate sets) divides every step's measured duration by the latest factor
  (`SpeedNormalizedExecutor`), so both time steps at the profile's machine speed.

Measured on this 2-core VM in a busy hour (30 s of the probe's own step back to back, 20 s of
random shapes): 0.1-s windows of step times correlate at 0.89 with the next, 2-s windows at 0.18,
so the probe must be frequent. Probing every 0.05 s, the means of 1-second windows strayed from
the overall mean by 1.4 % on average (4 % at most) instead of 9.5 % (37 %); every 0.5 s, 6 %.
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from pathlib import Path

import numpy as np

from engine.step_shapes import GridPoint, build_plan

# Small and quick, so that probing often costs little: a decode batch of 4 over 128 tokens.
PROBE_POINT = GridPoint(0, "decode", 16, decodes=(128,) * 4)
PROBE_POOL_BLOCKS = PROBE_POINT.num_blocks_needed()
DEFAULT_INTERVAL_S = 0.05
MAX_PROBE_SHARE = 0.1   # probes wait at least 10x their own duration: at most ~10 % more time


def probe_point_spec() -> dict:
    """The probe shape as a profile's JSON records it (a reference only holds for it)."""
    return json.loads(json.dumps(dataclasses.asdict(PROBE_POINT)))


class SpeedProbe:
    """Times PROBE_POINT on `executor` (with a pool of its own, of at least PROBE_POOL_BLOCKS
    blocks of 16) when a reading is due."""

    def __init__(self, executor, interval_s: float = DEFAULT_INTERVAL_S, seed: int = 0):
        if not interval_s > 0:
            raise ValueError(f"the speed probe's interval must be > 0 s, got {interval_s!r}")
        self.executor = executor
        self.plan = build_plan(PROBE_POINT, np.random.default_rng(seed), PROBE_POOL_BLOCKS, 0)
        self.interval_s = interval_s
        self.readings: list[float] = []   # the probe step's duration, per reading
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
        return duration

    def reference(self) -> float:
        """The probe step's median duration over every reading."""
        if not self.readings:
            raise ValueError("the speed probe has no readings")
        return statistics.median(self.readings)


def normalize_samples(probed: list[tuple[dict, int]], probe: SpeedProbe) -> dict:
    """Divide each profile sample's duration_s by the speed factor of the probe reading before it
    (`probed`: (sample, index of that reading) pairs; raw_duration_s and speed_factor keep what
    was measured); returns the profile's `speed_reference`."""
    reference = probe.reference()
    factors = [duration / reference for duration in probe.readings]
    for sample, reading in probed:
        sample["raw_duration_s"] = sample["duration_s"]
        sample["speed_factor"] = factors[reading]
        sample["duration_s"] = sample["raw_duration_s"] / factors[reading]
    return {"point": probe_point_spec(), "duration_s": reference,
            "interval_s": probe.interval_s, "num_readings": len(factors),
            "factor_p05": float(np.percentile(factors, 5)),
            "factor_p95": float(np.percentile(factors, 95))}


def load_reference(profile_path) -> float:
    """The speed reference duration of a profile JSON file."""
    try:
        content = json.loads(Path(profile_path).read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"backend.speed_reference: cannot read profile {profile_path!r}: "
                         f"{error}") from None
    return check_reference(content.get("speed_reference"), f"profile {profile_path}")


def check_reference(reference: dict | None, source: str) -> float:
    """The reference duration of a profile's `speed_reference`, or a clear error."""
    if not reference:
        raise ValueError(f"{source} has no speed_reference: re-take it with twinserve-profile "
                         f"(its speed probe is on by default), or run without "
                         f"backend.speed_reference")
    if reference.get("point") != probe_point_spec():
        raise ValueError(f"{source}: its speed_reference was taken on another probe shape than "
                         f"engine/speed.py's PROBE_POINT; re-take the profile")
    duration = reference.get("duration_s")
    if isinstance(duration, bool) or not isinstance(duration, (int, float)) or not duration > 0:
        raise ValueError(f"{source}: speed_reference.duration_s must be a positive number of "
                         f"seconds, got {duration!r}")
    return float(duration)


class SpeedNormalizedExecutor:
    """An engine executor whose step durations are divided by the machine's latest speed factor
    against `reference_s` (a profile's probe duration): the run's clock runs at the profile's
    machine speed. Everything else is the wrapped executor's."""

    def __init__(self, executor, probe: SpeedProbe, reference_s: float):
        self.executor = executor
        self.probe = probe
        self.reference_s = reference_s

    def execute(self, plan):
        if self.probe.due():
            self.probe.measure()
        result = self.executor.execute(plan)
        result.duration = result.duration * self.reference_s / self.probe.readings[-1]
        return result

    def speed_summary(self) -> dict:
        """The speed factors of every reading (the probe's durations over the reference)."""
        factors = np.asarray(self.probe.readings) / self.reference_s
        return {"speed_factor_median": float(np.median(factors)),
                "speed_factor_p05": float(np.percentile(factors, 5)),
                "speed_factor_p95": float(np.percentile(factors, 95)),
                "speed_probes": len(factors), "speed_probe_s": self.probe.probe_time_s}

    def __getattr__(self, name):   # acceptance_stats and the rest: the engine executor's
        return getattr(self.executor, name)
