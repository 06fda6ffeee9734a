"""A replica of pipeline stages (`cluster.pipeline_parallel_size` > 1) with batches in flight, as
vLLM V0 ran pipeline parallelism (virtual engines) and Vidur models it.

The replica runs pp virtual engines, each a step loop with its own scheduler (the run's policy)
over its own share of the replica's KV blocks, and pp stages, each a simpy resource that works on
one step at a time. A virtual engine plans its next step as soon as the first stage is free for
it, the step takes each stage in turn for that stage's time (sim/cost/pipeline.py: its layers'
work, the first stage the engine overhead, the last the LM head, every stage but the last its
send of the activations), waiting in between while the next stage works on another engine's
step, and the step's tokens come out when it leaves the last stage; then the engine plans again.
So at most pp steps are in flight, and the bubble and the overlap come out of the timeline: one
engine with work leaves every stage but one idle; pp busy engines keep the slowest stage busy.

Requests go to the virtual engine with the fewest unfinished requests (V0's rule; ties to the
first). A router sees, as the replica's KV manager and LoRA manager, those of the engine that
would take the request.

KV split: each engine owns num_blocks // pp device blocks (and that share of the host swap pool
and of the prefix cache's host tier), as V0 split its cache among its virtual engines. A step in
flight holds its blocks while the other engines plan, so their pools must be disjoint; one
shared pool would need preemptions across engines, which V0 never did. Each engine with adapters
has its own LoRA manager of max_loras slots.

What a step row records: its plan, the replica's KV and queues summed over its engines when the
step enters the first stage, and its duration from entering the first stage to leaving the last
(waits for busy stages included: rows of one replica overlap, up to pp at a time).

Energy: each stage's tp boards are charged the seconds that stage is busy with each step at that
stage's work (its base cost model's FLOPs and bytes, the LM head counted on every stage: an
over-count of its weights, ~4% of a Llama-2-7B stage's at pp=2), and idle power the rest of the
run. Repeated steps (sim/core/repeated_steps.py) never run here: every step is its own event.
A run that plots gives the stages traced meters and keeps the stage timeline, from which the
power plot draws the replica's power as the sum of its stages' (sim/core/energy/trace.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import simpy

from policies.lora.spec import lora_config
from policies.protocols import LoRAManager, Scheduler
from policies.types import Request
from runtime.assembly import assemble_scheduler, build_preemption
from runtime.assembly import kv_cache_policy_config
from sim.core.build import (build_replica_executor, kv_cache_sizes,
                            max_num_batched_tokens)
from sim.core.energy.meter import EnergyMeter, build_energy_meter
from sim.core.energy.stages import StagesEnergyMeter
from sim.core.energy.trace import TracedEnergyMeter, TracedStagesEnergyMeter
from runtime.metrics import STEP_COLUMNS, MetricsCollector, StepRecorder
from sim.cost.pipeline import KEY, PipelineCostModel
from runtime.step import StepLoop

if TYPE_CHECKING:
    from sim.core.executor import SimExecutor

_DURATION = STEP_COLUMNS.index("duration")


class EnginesView:
    """The replica's engines as one scheduler for a step row (KV and queues summed)."""

    def __init__(self, schedulers: list[Scheduler]):
        self.schedulers = schedulers
        self.kv_cache = self

    def num_used_blocks(self) -> int:
        return sum(s.kv_cache.num_used_blocks() for s in self.schedulers)

    def num_slots_allocated(self) -> int:
        return sum(s.kv_cache.num_slots_allocated() for s in self.schedulers)

    def num_tokens_stored(self) -> int:
        return sum(s.kv_cache.num_tokens_stored() for s in self.schedulers)

    def queue_lengths(self) -> tuple[int, int, int]:
        waiting = running = swapped = 0
        for scheduler in self.schedulers:
            w, r, s = scheduler.queue_lengths()
            waiting, running, swapped = waiting + w, running + r, swapped + s
        return waiting, running, swapped


class VirtualEngine:
    """One of a pipelined replica's step loops (the module docstring)."""

    def __init__(self, replica: PipelinedReplica, index: int, scheduler: Scheduler, predictor):
        self.replica, self.index = replica, index
        self.scheduler = scheduler
        # Its scheduler's update, the latencies and a refining predictor: StepLoop.complete.
        self.steps = StepLoop(scheduler, replica.executor, replica.recorder, predictor)
        self._idle: simpy.Event | None = None
        self.process = replica.env.process(self.run())

    def wake(self) -> None:
        if self._idle is not None and not self._idle.triggered:
            self._idle.succeed()

    def run(self):
        replica, scheduler = self.replica, self.scheduler
        env, stages, timeline = replica.env, replica.stages, replica.stage_timeline
        metrics = replica.metrics
        cost_model = replica.cost_model
        while True:
            while not scheduler.has_unfinished():
                self._idle = env.event()
                yield self._idle
                self._idle = None
            claim = stages[0].request()
            yield claim
            abandoned = self.steps.abandon_due(env.now)   # (after the wait for the stage)
            if abandoned:
                replica.finished(abandoned)
                if not scheduler.has_unfinished():
                    stages[0].release(claim)
                    continue
            start = env.now
            result = self.steps.begin_unrecorded(start)   # (the stall error where it plans nothing)
            plan = self.steps.plan
            row = metrics.num_steps
            replica.recorder.record_step_row(start, plan, 0.0, replica.engines_view)
            # (the executor costed this plan just now: its stage times, not a second costing)
            stage_times = (cost_model.last_stage_times if cost_model.last_plan is plan
                           else cost_model.stage_times(plan))
            for index, stage in enumerate(stages):
                if index:
                    claim = stage.request()
                    yield claim
                entered = env.now
                yield env.timeout(stage_times[index])
                stage.release(claim)
                if timeline is not None:
                    timeline.append((index, self.index, entered, env.now))
            result.duration = duration = env.now - start
            recorded = metrics.step_row(row)
            metrics.set_step_row(
                row, recorded[:_DURATION] + (duration,) + recorded[_DURATION + 1:])
            replica.energy.add_stages(plan, stage_times)
            finished = self.steps.complete(env.now)
            if finished:
                replica.finished(finished)


class PipelinedReplica:
    """A replica of `len(schedulers)` pipeline stages and as many virtual engines, each over its
    scheduler; the Replica (sim/core/replica.py) a router and the run see. `executor` costs the
    stages (its cost model a PipelineCostModel); with `stage_timeline` a list, every stage's work
    is appended to it as (stage, engine, start, end)."""

    def __init__(self, env: simpy.Environment, replica_id: int, schedulers: list[Scheduler],
                 executor: SimExecutor, metrics: MetricsCollector, energy: StagesEnergyMeter,
                 on_requests_done: Callable[[list[Request]], None] | None = None, predictor=None,
                 pool: str = "main", role: str = "mixed",
                 lora_managers: list[LoRAManager] | None = None,
                 stage_timeline: list | None = None):
        if not isinstance(executor.cost_model, PipelineCostModel):
            raise TypeError(f"a pipelined replica costs its stages with a PipelineCostModel, got "
                            f"{type(executor.cost_model).__name__}")
        self.env, self.replica_id = env, replica_id
        self.pool, self.role = pool, role
        self.executor, self.cost_model = executor, executor.cost_model
        self.metrics = metrics
        self.energy = energy
        self.recorder = StepRecorder(metrics, replica_id, energy)   # (rows and latencies)
        self.schedulers = schedulers
        self.scheduler = schedulers[0]   # (its first engine's: the policy a run's messages name)
        self.engines_view = EnginesView(schedulers)
        self._lora_managers = lora_managers
        self.stages = [simpy.Resource(env, capacity=1) for _ in schedulers]
        self.stage_timeline = stage_timeline
        self.on_requests_done = on_requests_done
        self.on_finished: Callable[[list[Request]], None] | None = None
        self.engines = [VirtualEngine(self, index, scheduler, predictor)
                        for index, scheduler in enumerate(schedulers)]

    def next_engine(self) -> VirtualEngine:
        """The engine a new request joins: the fewest unfinished requests, then the first."""
        return min(self.engines, key=lambda engine: engine.scheduler.num_outstanding)

    @property
    def num_outstanding(self) -> int:
        return sum(scheduler.num_outstanding for scheduler in self.schedulers)

    @property
    def kv_cache(self):
        """The KV manager of the engine a new request would join (a router reads its prefix
        cache)."""
        return self.next_engine().scheduler.kv_cache

    @property
    def lora(self) -> LoRAManager | None:
        """The LoRA manager of the engine a new request would join (None: no adapters)."""
        if not self._lora_managers:
            return None
        return self._lora_managers[self.next_engine().index]

    def submit(self, request: Request) -> None:
        request.replica_id = self.replica_id
        engine = self.next_engine()
        engine.scheduler.add_request(request, self.env.now)
        if request.rejected_reason is not None:
            self.finished([request])
            return
        engine.steps.deadlines.add(request)
        engine.wake()

    def finished(self, requests: list[Request]) -> None:
        if self.on_requests_done:
            self.on_requests_done(requests)
        if self.on_finished is not None:
            self.on_finished(requests)


def build_pipelined_replica(pool, replica_id: int, env: simpy.Environment,
                            metrics: MetricsCollector, model, num_stages: int, predictor,
                            on_requests_done, retention_policies: list | None = None,
                            lora_managers: list | None = None,
                            meter_class: type[EnergyMeter] = EnergyMeter) -> PipelinedReplica:
    """A pool's replica of `num_stages` stages: an engine's policies per stage, each over its
    share of the pool's KV blocks (the module docstring), the stages' cost and energy meters
    (each a `meter_class`; traced ones, for the power plot, with the replica's stage timeline)."""
    cfg = pool.cfg
    if pool.role != "mixed":
        raise ValueError(f"{KEY}={num_stages} in the {pool.role} pool {pool.name!r}: pipelined "
                         f"replicas run in a mixed pool only; give the {pool.role} pool "
                         f"pipeline_parallel_size: 1")
    if pool.num_kv_blocks < num_stages:
        raise ValueError(f"kv_cache.num_blocks={pool.num_kv_blocks} is fewer than {KEY}="
                         f"{num_stages}: each virtual engine needs blocks of its own")

    def engine_sizes(preemption) -> dict:   # an engine's share of every pool
        return {name: size // num_stages for name, size in kv_cache_sizes(
            cfg, model, pool.num_kv_blocks, preemption, None).items()}

    schedulers, managers = [], []
    for _ in range(num_stages):
        scheduler = assemble_scheduler(
            cfg.scheduler, build_preemption(cfg.preemption), kv_cache_policy_config(cfg.kv_cache),
            engine_sizes, max_num_batched_tokens=max_num_batched_tokens(cfg, model),
            max_model_len=model.max_model_len, kv_retention=cfg.get("kv_retention"),
            retention_policies=retention_policies, lora=lora_config(cfg.get("lora")),
            lora_managers=managers)
        schedulers.append(scheduler)
    if lora_managers is not None:
        lora_managers += managers
    executor = build_replica_executor(cfg, model, pool.hardware, schedulers[0].kv_cache, None,
                                      replica_id)
    tensor_parallel_size = cfg.cluster.tensor_parallel_size
    stage_meters = [
        build_energy_meter(cfg.get("power"), stage.model, pool.hardware, tensor_parallel_size,
                           cfg.kv_cache.block_size, stage, meter_class)
        for stage in executor.cost_model.stages]
    # (Only a run that plots keeps the timeline: its stages' work intervals for the power plot.)
    timeline = [] if issubclass(meter_class, TracedEnergyMeter) else None
    energy = (StagesEnergyMeter(stage_meters) if timeline is None
              else TracedStagesEnergyMeter(stage_meters, timeline))
    return PipelinedReplica(env, replica_id, schedulers, executor, metrics, energy,
                            on_requests_done=on_requests_done, predictor=predictor,
                            pool=pool.name, role=pool.role, lora_managers=managers or None,
                            stage_timeline=timeline)
