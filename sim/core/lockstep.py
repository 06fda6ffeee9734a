"""Data-parallel ranks that step together: the replicas an expert group spans
(`cluster.expert_parallel_size` greater than `cluster.tensor_parallel_size`, vLLM's data parallel
with enable_expert_parallel).

Every layer's expert all-to-all exchanges tokens between the group's ranks, so no rank can run
ahead: vLLM starts a step on every rank of the group at once (a rank with nothing to do runs a
dummy batch) and each step lasts as long as the slowest rank's. Here a `LockstepGroup` runs its
ranks' step loops as one simpy process: at each step every rank with requests plans and executes
its own batch at the same time, and the step takes the longest of their durations, which every
rank records as its own (a rank that finishes its work early waits in the collectives, so the
energy meter sees it busy for its own work and idle for the rest). A rank with nothing to do
records no step: its dummy batch costs less than the others' real ones. The expert cost models
price a rank's experts with its peers carrying its load (sim/cost/experts.py), so the step's
experts come from the largest rank's batch: vLLM pads every rank's batch to the largest one's
token count, so this is what its GPUs do.

Runs of repeated decode steps (runtime/step.py) are not used: a rank's batch changes whenever a
peer's does. Prefill/decode disaggregation and pipeline stages are not combined with lockstep
groups (refused, `lockstep_group_size` and sim/core/experiment.py).
"""
from __future__ import annotations

import simpy
from omegaconf import DictConfig

from sim.cost.build import expert_parallel_size
from sim.cost.experts import EP_KEY
from sim.core.replica import Replica
from runtime.specs import ModelSpec


class LockstepRank(Replica):
    """A replica whose steps its `LockstepGroup` runs."""

    group: LockstepGroup

    def start(self) -> None:
        return None   # (the group's process runs this rank's steps)

    def wake(self) -> None:
        self.group.wake()


class LockstepGroup:
    """Ranks stepping together (module docstring)."""

    def __init__(self, env: simpy.Environment, ranks: list[LockstepRank]):
        self.env = env
        self.ranks = ranks
        for rank in ranks:
            rank.group = self
        self._idle: simpy.Event | None = None
        self.process = env.process(self.run())

    def wake(self) -> None:
        if self._idle is not None and not self._idle.triggered:
            self._idle.succeed()

    def run(self):
        env, ranks = self.env, self.ranks
        while True:
            for rank in ranks:
                abandoned = rank.steps.abandon_due(env.now)
                if abandoned:
                    rank.ended(abandoned)
            stepping = [rank for rank in ranks if rank.scheduler.has_unfinished()]
            if not stepping:
                self._idle = env.event()
                yield self._idle
                self._idle = None
                continue
            now = env.now
            duration = max([rank.steps.begin_unrecorded(now).duration for rank in stepping])
            for rank in stepping:
                rank.steps.record(now, duration)
            yield env.timeout(duration)
            for rank in stepping:
                rank._queued_during_step.clear()   # (counted only for repeated steps)
                finished = rank.steps.complete(env.now)
                if finished:
                    rank.ended(finished)


def lockstep_group_size(cfg: DictConfig, model: ModelSpec, num_replicas: int,
                        role: str = "mixed") -> int:
    """Ranks per lockstep group: expert_parallel_size / tensor_parallel_size where the expert
    group spans replicas, else 1 (each replica steps alone). Errors name the keys."""
    ep = expert_parallel_size(cfg, model)
    tp = cfg.cluster.tensor_parallel_size
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
