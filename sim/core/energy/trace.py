"""Each step's joules, kept for a run's power plot (power.png): `TracedEnergyMeter` and, for a
pipelined replica, `TracedStagesEnergyMeter`. Only runs that write plots build them, so the plain
meters' hot path is untouched.
"""
from __future__ import annotations

import array
from collections.abc import Mapping

import numpy as np

from policies.protocols import StepWorkCostModel
from sim.core.energy.meter import EnergyMeter
from sim.core.energy.power import PowerModel
from sim.core.energy.stages import StagesEnergyMeter

# A replica's next step that starts this long after the previous one ended: it idled between
# (simulated seconds; steps run back to back start at the float sum of the previous one's end).
IDLE_GAP_S = 1e-9


class TracedEnergyMeter(EnergyMeter):
    """An EnergyMeter whose `step_joules[i]` is one board's joules over its replica's i-th step,
    the very value the meter added, so its totals are the plain meter's bit for bit."""

    __slots__ = ("step_joules",)

    def __init__(self, power_model: PowerModel, work: StepWorkCostModel, num_boards: int = 1):
        super().__init__(power_model, work, num_boards)
        self.step_joules = array.array("d")
        charge, log = self._busy_energy_j, self.step_joules.append

        def busy_energy_j(duration_s: float, flops: float, bytes_moved: float) -> float:
            joules = charge(duration_s, flops, bytes_moved)
            log(joules)
            return joules

        # Every step goes through the power model's logged call, a run of repeated steps too.
        self._busy_energy_j = busy_energy_j
        self._decode_work_terms = None

    def busy_power_w(self, durations: np.ndarray) -> np.ndarray:
        """The replica's watts over each of its steps given their `durations` (NaN for a step of no
        time)."""
        joules = np.frombuffer(self.step_joules, dtype=np.float64)
        if len(durations) != len(joules):
            raise ValueError(f"{len(durations)} step rows for {len(joules)} metered steps")
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(durations > 0, self.num_boards * joules / durations, np.nan)


class TracedStagesEnergyMeter(StagesEnergyMeter):
    """A pipelined replica's StagesEnergyMeter whose stages are traced, with the replica's stage
    `timeline` of (stage, engine, start, end)."""

    def __init__(self, stages: list[TracedEnergyMeter], timeline: list[tuple]):
        super().__init__(stages)
        self.timeline = timeline

    def power_over_time(self) -> np.ndarray:
        """The replica's power as a step function of simulated time: rows (time, W) wherever a stage
        starts or ends a step, summing each stage's busy or idle draw. A stage ends its steps in
        the order the replica charges them (first in, first out)."""
        if not self.timeline:
            return np.empty((0, 2))
        entries = np.asarray(self.timeline, dtype=np.float64)
        stage_of, starts, ends = entries[:, 0], entries[:, 2], entries[:, 3]
        times = np.unique(np.concatenate([starts, ends]))
        watts = np.zeros(times.size)
        for index, meter in enumerate(self.stages):
            rows = stage_of == index
            start, end = starts[rows], ends[rows]
            power = meter.busy_power_w(end - start)   # (in the order the meter charged them)
            worked = end > start
            start, end, power = start[worked], end[worked], power[worked]
            order = np.argsort(start, kind="stable")
            start, end, power = start[order], end[order], power[order]
            # Each time's latest step started on this stage, and whether it is still at work.
            latest = np.searchsorted(start, times, side="right") - 1
            at_work = (latest >= 0) & (times < end[np.maximum(latest, 0)])
            idle_w = meter.num_boards * meter.power_model.idle_power_w
            watts += np.where(at_work, power[np.maximum(latest, 0)], idle_w)
        return np.column_stack([times, watts])


TracedMeter = TracedEnergyMeter | TracedStagesEnergyMeter


def step_power_w(steps: np.ndarray, columns: tuple[str, ...],
                 meters: Mapping[int, EnergyMeter | StagesEnergyMeter | None]) -> np.ndarray:
    """Each step row's replica power in W, for `steps` an array of a run's step rows; NaN where the
    replica kept no trace or is pipelined (its rows overlap)."""
    replica_column, duration_column = columns.index("replica_id"), columns.index("duration")
    power = np.full(len(steps), np.nan)
    for replica_id, meter in meters.items():
        if isinstance(meter, TracedEnergyMeter):
            rows = steps[:, replica_column] == replica_id
            power[rows] = meter.busy_power_w(steps[rows, duration_column])
    return power


def power_over_time(steps: np.ndarray, columns: tuple[str, ...],
                    meters: Mapping[int, EnergyMeter | StagesEnergyMeter | None]) -> np.ndarray:
    """The traced replicas' power as a step function of simulated time: rows (replica_id, time, W),
    each step's power from its start and idle draw after it; drawn as steps-post, its area is
    what the meter charged."""
    replica_column, start_column, duration_column = (
        columns.index(name) for name in ("replica_id", "start_time", "duration"))
    power = step_power_w(steps, columns, meters)
    pieces = [np.empty((0, 3))]
    for replica_id, meter in meters.items():
        if isinstance(meter, TracedStagesEnergyMeter):
            series = meter.power_over_time()
            pieces.append(np.column_stack([np.full(len(series), float(replica_id)), series]))
            continue
        if not isinstance(meter, TracedEnergyMeter):
            continue
        rows = (steps[:, replica_column] == replica_id) & (steps[:, duration_column] > 0)
        if not rows.any():   # (a replica the router sent nothing)
            continue
        start, watts = steps[rows, start_column], power[rows]
        end = start + steps[rows, duration_column]
        idles_after = np.append(start[1:] > end[:-1] + IDLE_GAP_S, True)
        times = np.concatenate([start, end[idles_after]])
        order = np.argsort(times, kind="stable")
        values = np.concatenate([watts, np.full(int(idles_after.sum()),
                                                meter.num_boards * meter.power_model.idle_power_w)])
        pieces.append(np.column_stack([np.full(times.size, float(replica_id)),
                                       times[order], values[order]]))
    return np.concatenate(pieces)
