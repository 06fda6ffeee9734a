"""A replica of pipeline stages (`cluster.pipeline_parallel_size` > 1) with batches in flight, as
vLLM V0's virtual engines: pp lanes, each its own scheduler over num_blocks // pp blocks and its
own `ReplicaDriver` with `ThroughStages` timing, taking the stages (simpy resources) in turn, so
the bubble comes out of the timeline (docs/simulator.md, Pipeline parallelism).
"""
from __future__ import annotations

import simpy

from policies.lora.spec import lora_config
from policies.protocols import Scheduler
from runtime.assembly import assemble_scheduler, build_preemption
from runtime.assembly import kv_cache_policy_config
from runtime.metrics import MetricsCollector
from sim.core.build import build_replica_executor, kv_cache_sizes
from sim.core.energy.meter import EnergyMeter, build_energy_meter
from sim.core.energy.stages import StagesEnergyMeter
from sim.core.energy.trace import TracedEnergyMeter, TracedStagesEnergyMeter
from sim.core.replica import Lane, Replica, ReplicaDriver
from sim.cost.pipeline import KEY, PipelineCostModel


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


class Stages:
    """A pipelined replica's stages, one simpy resource each; with `timeline` a list, every stage's
    work is appended as (stage, engine, start, end)."""

    def __init__(self, env: simpy.Environment, cost_model: PipelineCostModel,
                 energy: StagesEnergyMeter, view: EnginesView, timeline: list | None = None):
        if not isinstance(cost_model, PipelineCostModel):
            raise TypeError(f"a pipelined replica costs its stages with a PipelineCostModel, got "
                            f"{type(cost_model).__name__}")
        self.env, self.cost_model, self.energy, self.view = env, cost_model, energy, view
        self.resources = [simpy.Resource(env, capacity=1) for _ in cost_model.stages]
        self.timeline = timeline


class ThroughStages:
    """One virtual engine's steps: planned once the first stage is free for it, then through the
    stages in turn, each for its time, waiting while the next works on another engine's step."""

    def __init__(self, stages: Stages, lane: Lane):
        self.stages, self.lane = stages, lane
        self._claim = None

    def gate(self) -> simpy.Event:
        self._claim = self.stages.resources[0].request()
        return self._claim

    def cancel(self) -> None:
        self.stages.resources[0].release(self._claim)

    def step(self, driver: ReplicaDriver, now: float):
        stages, lane = self.stages, self.lane
        env, cost_model, timeline = driver.env, stages.cost_model, stages.timeline
        steps, recorder = lane.steps, lane.replica.recorder
        result = steps.begin_unrecorded(now)   # (the stall error where it plans nothing)
        plan = steps.plan
        # The row is the replica's as the step enters the first stage; its duration comes last.
        row = recorder.metrics.num_steps
        recorder.record_step_row(now, plan, 0.0, stages.view)
        # (the executor costed this plan just now: its stage times, not a second costing)
        stage_times = (cost_model.last_stage_times if cost_model.last_plan is plan
                       else cost_model.stage_times(plan))
        claim = self._claim
        for index, stage in enumerate(stages.resources):
            if index:
                claim = stage.request()
                yield claim
            entered = env.now
            yield env.timeout(stage_times[index])
            stage.release(claim)
            if timeline is not None:
                timeline.append((index, lane.index, entered, env.now))
        result.duration = duration = env.now - now
        recorder.metrics.set_step_duration(row, duration)
        stages.energy.add_stages(plan, stage_times)
        driver.finish(lane.replica, steps.complete(env.now))
        return True


def build_pipelined_replica(pool, replica_id: int, env: simpy.Environment,
                            metrics: MetricsCollector, model, predictor,
                            on_requests_done, retention_policies: list | None = None,
                            lora_managers: list | None = None,
                            meter_class: type[EnergyMeter] = EnergyMeter) -> Replica:
    """A pool's replica of pipeline stages: an engine's policies per stage over its share of the
    KV blocks, and the stages' cost models and energy meters (`meter_class`)."""
    cfg, settings = pool.cfg, pool.settings
    num_stages = settings.pipeline_parallel_size
    if pool.role != "mixed":
        raise ValueError(f"{KEY}={num_stages} in the {pool.role} pool {pool.name!r}: pipelined "
                         f"replicas run in a mixed pool only; give the {pool.role} pool "
                         f"pipeline_parallel_size: 1")
    if pool.num_kv_blocks < num_stages:
        raise ValueError(f"kv_cache.num_blocks={pool.num_kv_blocks} is fewer than {KEY}="
                         f"{num_stages}: each virtual engine needs blocks of its own")

    def engine_sizes(preemption) -> dict:   # an engine's share of every pool
        return {name: size // num_stages for name, size in kv_cache_sizes(
            settings, pool.num_kv_blocks, preemption).items()}

    schedulers, managers = [], []
    for _ in range(num_stages):
        scheduler = assemble_scheduler(
            cfg.scheduler, build_preemption(cfg.preemption), kv_cache_policy_config(cfg.kv_cache),
            engine_sizes, max_num_batched_tokens=settings.max_num_batched_tokens,
            max_model_len=model.max_model_len, kv_retention=cfg.get("kv_retention"),
            retention_policies=retention_policies, lora=lora_config(cfg.get("lora")),
            lora_managers=managers)
        schedulers.append(scheduler)
    if lora_managers is not None:
        lora_managers += managers
    executor = build_replica_executor(cfg, settings, model, pool.hardware,
                                      schedulers[0].kv_cache, replica_id)
    stage_meters = [
        build_energy_meter(cfg.get("power"), stage.model, pool.hardware,
                           settings.tensor_parallel_size, settings.block_size, stage, meter_class)
        for stage in executor.cost_model.stages]
    # (Only a run that plots keeps the timeline: its stages' work intervals for the power plot.)
    timeline = [] if issubclass(meter_class, TracedEnergyMeter) else None
    energy = (StagesEnergyMeter(stage_meters) if timeline is None
              else TracedStagesEnergyMeter(stage_meters, timeline))
    replica = Replica(env, replica_id, schedulers, executor, metrics,
                      on_requests_done=on_requests_done, predictor=predictor, pool=pool.name,
                      role=pool.role, energy=energy, lora_managers=managers or None)
    stages = Stages(env, executor.cost_model, energy, EnginesView(schedulers),
                    timeline=timeline)
    for lane in replica.lanes:
        ReplicaDriver(env, [lane], ThroughStages(stages, lane))
    return replica
