"""Data-parallel ranks that step together, as an expert group spanning replicas must (every
layer's all-to-all waits for all of them): one `ReplicaDriver` with `Lockstep` timing steps them,
each rank recording the slowest rank's duration (docs/simulator.md, Lockstep groups).
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
