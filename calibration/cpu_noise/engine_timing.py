"""The speed probes built on an engine's loaded model, and `speed_normalization`, the step-timing
hook an engine run with backend.speed_reference hands to the engine, so that the engine never
imports calibration."""
from __future__ import annotations

from dataclasses import dataclass

from calibration.cpu_noise.speed import (DEFAULT_INTERVAL_S, DEFAULT_PREFILL_INTERVAL_S,
                                         PREFILL_PROBE_POINTS, PROBE_POINT, PROBE_POOL_BLOCKS,
                                         SpeedNormalizedExecutor, SpeedProbe, SpeedReference,
                                         load_reference)
from engine.builder import NewExecutor
from runtime.step_shapes import GridPoint


def build_speed_probe(new_executor: NewExecutor, seed: int = 0,
                      interval_s: float = DEFAULT_INTERVAL_S,
                      point: GridPoint = PROBE_POINT) -> SpeedProbe:
    """A speed probe timing `point` on an executor of its own (`new_executor`'s, on the model
    the probe's readings stand for)."""
    return SpeedProbe(new_executor(PROBE_POOL_BLOCKS, point.block_size), interval_s, seed, point)


def build_prefill_probes(new_executor: NewExecutor, seed: int = 0) -> tuple[SpeedProbe, ...]:
    """The prefill probes, one per PREFILL_PROBE_POINTS shape."""
    return tuple(build_speed_probe(new_executor, seed, DEFAULT_PREFILL_INTERVAL_S, point)
                 for point in PREFILL_PROBE_POINTS)


@dataclass(frozen=True)
class SpeedNormalization:
    """The engine's step-timing hook that normalises every step to `reference`'s machine speed."""

    reference: SpeedReference

    def __call__(self, executor, new_executor: NewExecutor, seed: int) -> SpeedNormalizedExecutor:
        prefill_probes = (build_prefill_probes(new_executor, seed)
                          if self.reference.prefill_durations_s else ())
        return SpeedNormalizedExecutor(executor, build_speed_probe(new_executor, seed),
                                       self.reference, prefill_probes)


def speed_normalization(profile: str | None) -> SpeedNormalization | None:
    """The hook for backend.speed_reference (conf/backend/engine.yaml): the speed reference of
    the profile JSON at `profile`, or None (steps timed as measured) when it is null."""
    return None if profile is None else SpeedNormalization(load_reference(profile))
