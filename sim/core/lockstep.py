"""Data-parallel ranks that step together: the replicas an expert group spans
(`cluster.expert_parallel_size` greater than `cluster.tensor_parallel_size`, vLLM's data parallel
with enable_expert_parallel).

Every layer's expert all-to-all exchanges tokens between the group's ranks, so no rank can run
ahead: vLLM starts a step on every rank at once (an idle rank runs a dummy batch) and the step
lasts as long as the slowest rank's. Here one `ReplicaDriver` steps the group's ranks with
`Lockstep` timing: every rank with requests plans and executes its own batch, and each records
the longest duration as its own (the energy meter sees it busy for its own work, idle for the
rest); a rank with nothing to do records no step. The expert cost models price a rank's experts
with its peers carrying its load (sim/cost/experts.py), as vLLM pads every rank's batch to the
largest one's tokens.

No repeated decode steps: a rank's batch changes whenever a peer's does. Disaggregated pools and
pipeline stages are not combined with lockstep groups (refused here and in sim/core/experiment.py).
"""
from __future__ import annotations

import simpy

from sim.core.replica import Replica, ReplicaDriver
from sim.core.settings import ReplicaSettings
from sim.cost.experts import EP_KEY


class Lockstep:
    """The ranks with requests step together, each step as long as the slowest rank's."""

    gate = None

    def cancel(self) -> None:
        pass

    def step(self, driver: ReplicaDriver, now: float):
        stepping = [lane for lane in driver.lanes if lane.scheduler.has_unfinished()]
        duration = max([lane.steps.begin_unrecorded(now).duration for lane in stepping])
        for lane in stepping:
            lane.steps.record(now, duration)
        yield driver.env.timeout(duration)
        for lane in stepping:
            driver.finish(lane.replica, lane.steps.complete(driver.env.now))
        return True


def drive_lockstep(env: simpy.Environment, ranks: list[Replica]) -> ReplicaDriver:
    """Start one driver over the ranks of a group (each a replica of one scheduler)."""
    return ReplicaDriver(env, [rank.lanes[0] for rank in ranks], Lockstep())


def lockstep_group_size(settings: ReplicaSettings, num_replicas: int,
                        role: str = "mixed") -> int:
    """Ranks per lockstep group: expert_parallel_size / tensor_parallel_size where the expert
    group spans replicas, else 1 (each replica steps alone). Errors name the keys."""
    ep, tp = settings.expert_parallel_size, settings.tensor_parallel_size
    if ep <= tp:
        return 1
    size = ep // tp
    if role != "mixed":
        raise ValueError(f"{EP_KEY}={ep} spans {size} replicas, which step in lockstep; that is "
                         f"not modelled for a {role} pool (prefill/decode disaggregation): use "
                         f"{EP_KEY} <= the pool's tensor_parallel_size")
    if num_replicas % size:
        raise ValueError(f"{EP_KEY}={ep} with cluster.tensor_parallel_size={tp} groups replicas "
                         f"{size} at a time: cluster.num_replicas={num_replicas} must be a "
                         f"multiple of {size}")
    return size
