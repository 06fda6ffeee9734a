"""One experiment from its Hydra config (conf/): settings read once, then build, run, write; the
code behind `twinserve`, callable from tests and scripts."""
from __future__ import annotations

import gc
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig
from tqdm import tqdm

from policies.lora.spec import lora_config
from policies.types import Request
from runtime.assembly import assemble_scheduler, build_preemption
from runtime.assembly import build_predictor, kv_cache_policy_config
from sim.cost.build import cost_model_summary
from sim.core.build import build_replica_executor, kv_cache_sizes, lora_summary, speed_summary
from sim.core.settings import RunSettings, run_settings
from runtime.policy_config import build_policy, policy_config
from sim.core.cluster import (DisaggregatedCluster, KVTransferModel, Pool, build_pools,
                              is_disaggregated, kv_transfer_summary, pools_summary)
from runtime.deadlines import abandonment_summary, check_deadlines
from sim.core.energy.meter import EnergyMeter, build_energy_meter
from sim.core.energy.summary import energy_summary
from sim.core.energy.trace import TracedEnergyMeter
from sim.core.executor import SimExecutor
from sim.core.lockstep import drive_lockstep, lockstep_group_size
from sim.core.pipelined_replica import build_pipelined_replica
from sim.core.long_run import (is_streamed, streamed_energy_summary, streamed_rejection_summary,
                               streamed_summary)
from runtime.metrics import STEP_COLUMNS, MetricsCollector, rejection_summary
from runtime.metrics.streaming import RequestLedger
from runtime.metrics.session_kv import has_sessions, session_kv_summary
from sim.core.replica import NextArrival, Replica, SimEnvironment, arrivals, drive_alone
from sim.core.session_arrivals import ClosedLoopArrivals
from runtime.specs import ModelSpec
from sim.core.workload import (RequestStream, build_session_source, is_closed_loop,
                               workload_stream)
from sim.tools.run_outputs import StreamedOutputs, write_run_outputs

# Allocations between young GC collections while simulating (Python's 700: every few steps).
YOUNG_GC_THRESHOLD = 20_000
# A run rejecting more than this share of its requests says so on stderr, with the main reason.
REJECTED_WARNING_FRACTION = 0.05
# What to change for a rejection reason (a piece of its text): the scheduler's own words say why.
REJECTION_HINTS = {"max_model_len": "a model with a longer context (e.g. model=llama-3.1-8b)",
                   "never fit in the KV cache": "a larger KV pool (kv_cache.num_blocks, more "
                                                "device memory or cluster.tensor_parallel_size)"}


@dataclass
class RunResult:
    summary: dict
    requests: list[Request]
    metrics: MetricsCollector
    num_kv_blocks: int
    replicas: list[Replica] = field(default_factory=list)   # as the run left them


def check_tenant_weights(scheduler_cfg, tenants: set[str]) -> None:
    """`scheduler.tenant_weights` may name only the run's `tenants`: another name is a typo."""
    weights = scheduler_cfg.get("tenant_weights") if hasattr(scheduler_cfg, "get") else None
    if not weights or not hasattr(weights, "keys"):
        return   # none, or not a mapping: the scheduler itself says what it takes
    tenants = sorted(tenants)
    for tenant in weights.keys():
        if tenant not in tenants:
            raise ValueError(f"scheduler.tenant_weights.{tenant}: no request of the run has "
                             f"tenant {tenant!r}; the run's tenants: {', '.join(tenants)}")


def check_first_tokens(requests: list[Request], replicas: list[Replica]) -> None:
    """Finished requests need a first token time (a scheduler's update stamps it) for TTFT."""
    missing = [r for r in requests
               if r.finish_time is not None and r.rejected_reason is None
               and r.first_token_time is None]
    if missing:
        schedulers = sorted({type(replica.scheduler).__name__ for replica in replicas})
        raise RuntimeError(f"{len(missing)} finished requests have no first_token_time (first: "
                           f"{missing[0].request_id}): {', '.join(schedulers)}.update must set "
                           f"request.first_token_time when a request gets its first token")


def warn_unused_features(cfg: DictConfig, requests: list[Request], summary: dict,
                         replicas: list[Replica]) -> None:
    """One line on stderr for a configured feature the scheduler never used (prefix caching,
    a swap pool)."""
    schedulers = ", ".join(sorted({type(replica.scheduler).__name__ for replica in replicas}))
    block_size = cfg.kv_cache.block_size
    if cfg.kv_cache.get("enable_prefix_caching") and summary.get("prefix_cache_hit_rate") == 0:
        first_blocks = [tuple(r.prompt_token_ids[:block_size]) for r in requests
                        if r.prompt_token_ids is not None and r.prompt_len > block_size]
        repeats = len(first_blocks) - len(set(first_blocks))
        if repeats:
            print(f"twinserve: kv_cache.enable_prefix_caching=true but no prompt token came from "
                  f"the prefix cache, though {repeats} prompts repeat an earlier one's first "
                  f"block: does {schedulers} call kv_cache.allocate_prefix?", file=sys.stderr)
    host_blocks = max(replica.scheduler.kv_cache.num_host_blocks for replica in replicas)
    if host_blocks and summary["num_preemptions"] and not summary["swap_bytes"]:
        print(f"twinserve: a swap pool of {host_blocks} host blocks per replica is configured but "
              f"all {summary['num_preemptions']} preemptions recomputed: does {schedulers} "
              f"ask preemption.mode and call kv_cache.swap_out?", file=sys.stderr)


def warn_rejections(summary: dict) -> None:
    """One line on stderr when many requests were rejected, since the run would look served."""
    num_rejected, num_requests = summary["rejected"], summary["num_requests"]
    if num_rejected <= REJECTED_WARNING_FRACTION * num_requests:
        return
    reason = summary["rejected_reason"]
    hint = next((f"; try {hint}" for key, hint in REJECTION_HINTS.items() if key in reason), "")
    print(f"twinserve: {num_rejected:,} of {num_requests:,} requests "
          f"({num_rejected / num_requests:.0%}) rejected, {summary['rejected_reason_count']:,} "
          f"because {reason}{hint}", file=sys.stderr)


def run_experiment(cfg: DictConfig, out_dir: Path | None = None,
                   progress: bool = False, plots: bool = True,
                   requests: list[Request] | None = None) -> RunResult:
    """Run the experiment `cfg` describes and write its files into `out_dir` if given;
    `requests` (fresh) replace cfg.workload's, as a measured run's replay does."""
    wall_start = time.perf_counter()
    simulation = build_simulation(cfg, out_dir, plots, requests)
    simulate(simulation, progress)
    summary = summarize(simulation, wall_start)
    if out_dir is not None:
        write_outputs(simulation, summary, Path(out_dir), plots)
    return RunResult(summary, [] if simulation.streamed else simulation.requests,
                     simulation.metrics, simulation.pools[0].num_kv_blocks, simulation.replicas)


class RequestsEnded:
    """What the replicas call with the requests that ended; the progress bar starts with the
    run, so that a setting the build refuses prints its one line alone."""

    def __init__(self, ledger: RequestLedger, metrics: MetricsCollector, streamed: bool):
        self.ledger, self.metrics, self.streamed = ledger, metrics, streamed
        self.bar: tqdm | None = None

    def __call__(self, finished: list[Request]) -> None:
        self.ledger.add(finished)
        if self.streamed:
            self.metrics.spill_steps_if_many()
        self.bar.update(len(finished))


@dataclass
class Simulation:
    """An experiment built from its settings: the cluster, its arrivals started, its recorders."""

    cfg: DictConfig
    run: RunSettings
    pools: list[Pool]
    env: SimEnvironment
    replicas: list[Replica]
    metrics: MetricsCollector
    ledger: RequestLedger
    ended: RequestsEnded
    # The requests (a closed loop's: those that arrived, known once it ran).
    requests: list[Request] | RequestStream | None
    sessions: ClosedLoopArrivals | None
    num_planned: int
    streamed: bool
    disaggregated: bool
    retention_policies: list   # the replicas' KV retention policies that keep blocks
    lora_managers: list        # the replicas' LoRA managers (none without adapters)
    outputs: StreamedOutputs | None   # a streamed run's files, written as it runs


def build_simulation(cfg: DictConfig, out_dir: Path | None, plots: bool,
                     requests: list[Request] | None) -> Simulation:
    """The run's pools, replicas, workload and recorders, from `cfg` read once."""
    model = ModelSpec.from_config(cfg.model)
    run = run_settings(cfg)
    pools = build_pools(cfg, model, run)
    # The target's KV bytes of one block: what the summary counts a swapped block as.
    bytes_per_block = model.kv_bytes_per_block(cfg.kv_cache.block_size)
    disaggregated = is_disaggregated(pools)
    if disaggregated:
        if cfg.backend.get("executor") is not None:
            raise ValueError("prefill and decode pools run on backend=sim; the engine's "
                             "disaggregated pair is engine.DisaggregatedLLM")
        transfer = KVTransferModel.from_config(cfg.cluster.get("kv_transfer"), model)
        disaggregation = build_policy(
            policy_config(cfg.cluster.get("disaggregate", "always"), "disaggregate",
                          "cluster.disaggregate"), "cluster.disaggregate")
    lora = lora_config(cfg.get("lora"))
    predictor = build_predictor(cfg.get("predictor"), run.seed)
    env = SimEnvironment()
    # A closed-loop workload's requests arrive as the run finishes their sessions' turns.
    sessions = None
    if requests is None and is_closed_loop(cfg.workload):
        source = build_session_source(cfg.workload, seed=run.seed, vocab_size=model.vocab_size,
                                      lora=lora)
        sessions = ClosedLoopArrivals(env, source, predictor, run.frontend_latency_s)
        check_tenant_weights(cfg.scheduler,
                             {request.tenant for request in source.all_requests()})
        num_planned = source.num_planned_requests
    else:
        if requests is None:
            requests = workload_stream(cfg.workload, seed=run.seed, vocab_size=model.vocab_size,
                                       lora=lora)
        check_tenant_weights(cfg.scheduler, requests.tenants() if isinstance(
            requests, RequestStream) else {request.tenant for request in requests})
        num_planned = len(requests)
    # A long open-loop run keeps running totals rather than its requests (long_run.py).
    streamed = is_streamed(cfg, requests, num_planned, disaggregated)
    if not streamed and isinstance(requests, RequestStream):
        requests = list(requests)
    ledger = RequestLedger(keep=not streamed, slos_ms=run.slos_ms)
    metrics = MetricsCollector(kv_bytes_per_block=bytes_per_block, streamed=streamed)
    outputs = None
    if streamed and out_dir is not None:
        outputs = StreamedOutputs(Path(out_dir))
        ledger.write_rows, metrics.write_step_rows = outputs.write_requests, outputs.write_steps
    ended = RequestsEnded(ledger, metrics, streamed)
    replicas, retention_policies, lora_managers = [], [], []
    next_arrival = NextArrival() if sessions is None else sessions
    for pool in pools:
        replicas += build_pool_replicas(pool, len(replicas), env, metrics, model, predictor,
                                        next_arrival, ended, retention_policies, lora_managers,
                                        # (a run that plots keeps each step's joules)
                                        TracedEnergyMeter if out_dir is not None and plots
                                        else EnergyMeter)
    if check_deadlines(requests if sessions is None else sessions.source.all_requests(),
                       [scheduler for replica in replicas for scheduler in replica.schedulers],
                       "prefill and decode pools" if disaggregated else None):
        for replica in replicas:
            for lane in replica.lanes:
                lane.steps.deadlines.expected = True
    router = pools[0].router
    if disaggregated:
        router = DisaggregatedCluster(env, replicas, pools, transfer, disaggregation,
                                      next_arrival).router
    if sessions is None:
        env.process(arrivals(env, requests, router, replicas, next_arrival, predictor,
                             run.frontend_latency_s))
    else:
        sessions.start(router, replicas)
    return Simulation(cfg, run, pools, env, replicas, metrics, ledger, ended, requests, sessions,
                      num_planned, streamed, disaggregated, retention_policies, lora_managers,
                      outputs)


def simulate(simulation: Simulation, progress: bool) -> None:
    """Run the simulation to its end, then order its step rows and collect inter-token gaps."""
    # (None: only on a terminal, where erasing the bar leaves the line clean for the summary.)
    bar = simulation.ended.bar = tqdm(total=simulation.num_planned, desc="requests", unit="req",
                                      disable=None if progress else True, mininterval=0.5,
                                      leave=False)
    # The workload lives for the whole run, so the GC need not rescan it.
    gc.freeze()
    thresholds = gc.get_threshold()
    gc.set_threshold(YOUNG_GC_THRESHOLD, *thresholds[1:])
    try:
        simulation.env.run()
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()
    bar.close()
    if simulation.sessions is not None:
        simulation.requests = simulation.sessions.requests
    metrics, replicas = simulation.metrics, simulation.replicas
    if len(replicas) > 1:   # (one replica records its steps in order already)
        metrics.order_steps_by_start()
    for replica in replicas:
        metrics.add_itl_counts(replica.recorder.itl_counts)


def summarize(simulation: Simulation, wall_start: float) -> dict:
    """The run's summary (summary.json), after checking that every request ended."""
    cfg, metrics, replicas = simulation.cfg, simulation.metrics, simulation.replicas
    requests, pools = simulation.requests, simulation.pools
    if simulation.streamed:
        summary = streamed_summary(metrics, simulation.ledger, simulation.num_planned,
                                   time.perf_counter() - wall_start,
                                   simulation.run.slos_ms is not None,
                                   replicas)
        summary["num_kv_blocks"] = pools[0].num_kv_blocks
        summary.update(streamed_rejection_summary(simulation.ledger))
        summary.update(abandonment_summary(simulation.ledger.totals.abandonment))
        summary.update(streamed_energy_summary(simulation.ledger, replicas, summary))
        summary.update(_cluster_summary(simulation))
        warn_unused_features(cfg, [], summary, replicas)
        warn_rejections(summary)
        return summary
    unfinished = [r for r in requests if not r.is_finished]
    if unfinished:
        raise RuntimeError(f"{len(unfinished)} requests never finished (first: "
                           f"{unfinished[0].request_id}); the simulation stalled")
    check_first_tokens(requests, replicas)
    summary = metrics.summary(requests, wall_time_s=time.perf_counter() - wall_start,
                              slos_ms=simulation.run.slos_ms,
                              fairness_window_s=simulation.run.fairness_window_s)
    summary["num_kv_blocks"] = pools[0].num_kv_blocks
    summary.update(rejection_summary(requests))
    summary.update(abandonment_summary(requests))
    summary.update(energy_summary({replica.replica_id: replica.recorder.energy
                                   for replica in replicas},
                                  {replica.replica_id: replica.pool for replica in replicas},
                                  requests, summary["duration_s"],
                                  summary["total_output_tokens"]))
    summary.update(_cluster_summary(simulation))
    if has_sessions(requests):
        summary.update(session_kv_summary(requests, [
            retention.held_blocks_log() for retention in simulation.retention_policies]))
    warn_unused_features(cfg, requests, summary, replicas)
    warn_rejections(summary)
    if cfg.cluster.get("pools") is not None:
        metrics.replica_labels = {replica.replica_id: f"{replica.pool} {replica.replica_id}"
                                  for replica in replicas}
        summary.update(pools_summary(pools, replicas, metrics.step_array(), STEP_COLUMNS,
                                     summary["duration_s"]))
    if simulation.disaggregated:
        summary.update(kv_transfer_summary(requests))
    return summary


def _cluster_summary(simulation: Simulation) -> dict:
    """The summary's keys of the replicas' speed, adapters and cost models."""
    replicas = simulation.replicas
    summary = speed_summary([replica.executor for replica in replicas])
    summary.update(lora_summary(simulation.lora_managers))
    summary.update(cost_model_summary([replica.executor.cost_model for replica in replicas
                                       if isinstance(replica.executor, SimExecutor)],
                                      simulation.cfg.workload.get("kind") == "closed_loop"))
    return summary


def write_outputs(simulation: Simulation, summary: dict, out_dir: Path, plots: bool) -> None:
    """The run's files in `out_dir` (a streamed run's rows are written already)."""
    if simulation.streamed:
        if plots:
            print("twinserve: no plots for a streamed run (they draw every request and step); "
                  "requests.csv and steps.csv have them all", file=sys.stderr)
        simulation.outputs.finish(summary)
        return
    metrics, requests = simulation.metrics, simulation.requests
    write_run_outputs(out_dir, metrics, requests, summary, plots=plots,
                      energy_meters={replica.replica_id: replica.recorder.energy
                                     for replica in simulation.replicas})
    if simulation.cfg.get("trace_export"):   # trace.json for Perfetto (sim/tools/trace_export.py)
        from sim.tools.trace_export import write_trace
        write_trace(out_dir / "trace.json", metrics.step_rows, STEP_COLUMNS, requests,
                    metrics.replica_labels)


def build_pool_replicas(pool: Pool, first_id: int, env: SimEnvironment,
                        metrics: MetricsCollector, model: ModelSpec, predictor,
                        next_arrival: NextArrival, on_requests_done,
                        retention_policies: list | None = None,
                        lora_managers: list | None = None,
                        meter_class: type[EnergyMeter] = EnergyMeter) -> list[Replica]:
    """A pool's replicas, numbered from `first_id`, each with its own policies, executor and
    energy meter; their retention policies and LoRA managers are appended to the lists given."""
    cfg, settings = pool.cfg, pool.settings
    speculation = settings.speculation
    group_size = lockstep_group_size(settings, pool.num_replicas, pool.role)
    replicas = []
    num_stages = settings.pipeline_parallel_size
    if num_stages > 1 and group_size > 1:
        raise ValueError(f"cluster.pipeline_parallel_size={num_stages} with an expert group "
                         f"spanning {group_size} replicas (cluster.expert_parallel_size): "
                         f"pipeline stages and lockstep ranks are not modelled together")
    for replica_id in range(first_id, first_id + pool.num_replicas):
        if num_stages > 1:   # (virtual engines over pipeline stages)
            replicas.append(build_pipelined_replica(
                pool, replica_id, env, metrics, model, predictor, on_requests_done,
                retention_policies, lora_managers, meter_class))
            continue
        preemption = build_preemption(cfg.preemption)
        scheduler = assemble_scheduler(
            cfg.scheduler, preemption, kv_cache_policy_config(cfg.kv_cache),
            lambda preemption: kv_cache_sizes(settings, pool.num_kv_blocks, preemption),
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_model_len=model.max_model_len,
            speculation=None if speculation is None else speculation.policy_cfg,
            kv_retention=cfg.get("kv_retention"), retention_policies=retention_policies,
            lora=lora_config(cfg.get("lora")), lora_managers=lora_managers)
        kv_cache = scheduler.kv_cache
        executor = build_replica_executor(cfg, settings, model, pool.hardware, kv_cache,
                                          replica_id)
        energy = build_energy_meter(
            cfg.get("power"), model, pool.hardware, settings.tensor_parallel_size,
            settings.block_size,
            executor.cost_model if isinstance(executor, SimExecutor) else None, meter_class)
        replica = Replica(env, replica_id, [scheduler], executor, metrics,
                          on_requests_done=on_requests_done, next_arrival=next_arrival,
                          predictor=predictor, pool=pool.name, role=pool.role, energy=energy,
                          # (the manager just built for this replica's scheduler)
                          lora_managers=lora_managers[-1:] if lora_managers else None)
        replicas.append(replica)
        if group_size == 1:
            drive_alone(replica)
    for first in range(0, len(replicas) if group_size > 1 else 0, group_size):
        drive_lockstep(env, replicas[first:first + group_size])
    return replicas
