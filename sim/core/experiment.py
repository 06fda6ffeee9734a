"""Build one experiment from its config and run it: the code behind `twinserve`, callable from
tests and scripts without the command line.

The config is the Hydra tree of conf/ (model, hardware, workload, scheduler, kv_cache, preemption,
speculation, cost_model, cluster, backend). Policies are built with `hydra.utils.instantiate`, so
any `_target_` class works, the built-in ones and a user's own.
"""
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
from policies.validators import finite_number, non_negative_number
from runtime.assembly import assemble_scheduler, build_preemption
from runtime.assembly import build_predictor, kv_cache_policy_config
from sim.cost.build import cost_model_summary
from sim.core.build import (build_replica_executor, check_run_settings, fairness_window_s, kv_cache_sizes, max_num_batched_tokens, lora_summary, slos_ms, speculation_setup, speed_summary)
from runtime.policy_config import build_policy, policy_config
from sim.core.cluster import (DisaggregatedCluster, KVTransferModel, Pool, build_pools,
                              is_disaggregated, kv_transfer_summary, pools_summary)
from runtime.deadlines import abandonment_summary, check_deadlines
from sim.core.energy.meter import EnergyMeter, build_energy_meter
from sim.core.energy.summary import energy_summary
from sim.core.energy.trace import TracedEnergyMeter
from sim.core.executor import SimExecutor
from sim.core.lockstep import drive_lockstep, lockstep_group_size
from sim.cost.pipeline import pipeline_parallel_size
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

# Allocations between the cyclic GC's young collections while the simulation runs (Python's
# default is 700: a collection every few steps).
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
    """A scheduler's `tenant_weights` (scheduler=vtc) may weigh only tenants the run's requests
    have (`tenants`): a name that none has is a typo, not a tenant to wait for."""
    weights = scheduler_cfg.get("tenant_weights") if hasattr(scheduler_cfg, "get") else None
    if not weights or not hasattr(weights, "keys"):
        return   # none, or not a mapping: the scheduler itself says what it takes
    tenants = sorted(tenants)
    for tenant in weights.keys():
        if tenant not in tenants:
            raise ValueError(f"scheduler.tenant_weights.{tenant}: no request of the run has "
                             f"tenant {tenant!r}; the run's tenants: {', '.join(tenants)}")


def check_first_tokens(requests: list[Request], replicas: list[Replica]) -> None:
    """Finished requests without a first token time have no TTFT or TPOT: a scheduler's update
    must stamp it (policies.protocols.Scheduler)."""
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
    """One line on stderr for each configured feature the run's scheduler never used: prefix
    caching with no prompt token served from the cache though prompts repeat a first block, or
    a swap pool with every preemption recomputed."""
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
    """One line on stderr when more than REJECTED_WARNING_FRACTION of the requests were
    rejected: how many, the most common reason (the summary's rejected_reason) and what to
    change; a trace of long prompts on a short-context model would otherwise look served."""
    num_rejected, num_requests = summary["rejected"], summary["num_requests"]
    if num_rejected <= REJECTED_WARNING_FRACTION * num_requests:
        return
    reason = summary["rejected_reason"]
    hint = next((f"; try {hint}" for key, hint in REJECTION_HINTS.items() if key in reason), "")
    print(f"twinserve: {num_rejected:,} of {num_requests:,} requests "
          f"({num_rejected / num_requests:.0%}) rejected, {summary['rejected_reason_count']:,} "
          f"because {reason}{hint}", file=sys.stderr)


def frontend_latency(cfg: DictConfig) -> float:
    """cluster.frontend_latency_s, checked (0 when the config has none)."""
    key = "cluster.frontend_latency_s"
    return float(non_negative_number(key, finite_number(
        key, cfg.cluster.get("frontend_latency_s", 0.0))))


def run_experiment(cfg: DictConfig, out_dir: Path | None = None,
                   progress: bool = False, plots: bool = True,
                   requests: list[Request] | None = None) -> RunResult:
    """Run the experiment `cfg` describes; write its files into `out_dir` if given (the PNG
    plots too, unless plots=False). `requests` (fresh, unserved) replace cfg.workload's: a
    measured run replayed from memory (calibration/realrun/)."""
    wall_start = time.perf_counter()
    simulation = build_simulation(cfg, out_dir, plots, requests)
    simulate(simulation, progress)
    summary = summarize(simulation, wall_start)
    if out_dir is not None:
        write_outputs(simulation, summary, Path(out_dir), plots)
    return RunResult(summary, [] if simulation.streamed else simulation.requests,
                     simulation.metrics, simulation.pools[0].num_kv_blocks, simulation.replicas)


class RequestsEnded:
    """What the replicas call with the requests that ended: the ledger, a streamed run's step
    spill and the progress bar (drawn once the run starts, so that a setting the build refuses
    prints its one line alone)."""

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
    """An experiment built from its config: the simulated cluster, its arrivals started, and
    what records the run."""

    cfg: DictConfig
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
    """The run's pools, replicas, workload and recorders, built and checked from `cfg`."""
    model = ModelSpec.from_config(cfg.model)
    check_run_settings(cfg)
    pools = build_pools(cfg, model)
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
    speculation = speculation_setup(cfg)
    lora = lora_config(cfg.get("lora"))
    # One per run, asked at each arrival; a config without the group predicts nothing.
    predictor = build_predictor(cfg.get("predictor"), cfg.seed)
    env = SimEnvironment()
    # A closed-loop workload's requests arrive as the run finishes their sessions' turns.
    sessions = None
    if requests is None and is_closed_loop(cfg.workload):
        source = build_session_source(cfg.workload, seed=cfg.seed, vocab_size=model.vocab_size,
                                      lora=lora)
        sessions = ClosedLoopArrivals(env, source, predictor, frontend_latency(cfg))
        check_tenant_weights(cfg.scheduler,
                             {request.tenant for request in source.all_requests()})
        num_planned = source.num_planned_requests
    else:
        if requests is None:
            requests = workload_stream(cfg.workload, seed=cfg.seed, vocab_size=model.vocab_size,
                                       lora=lora)
        check_tenant_weights(cfg.scheduler, requests.tenants() if isinstance(
            requests, RequestStream) else {request.tenant for request in requests})
        num_planned = len(requests)
    # A long open-loop run folds its requests into running totals as they finish and drops
    # them (long_run.py); any other keeps them all, made now.
    streamed = is_streamed(cfg, requests, num_planned, disaggregated)
    if not streamed and isinstance(requests, RequestStream):
        requests = list(requests)
    ledger = RequestLedger(keep=not streamed, slos_ms=slos_ms(cfg))
    metrics = MetricsCollector(kv_bytes_per_block=bytes_per_block, streamed=streamed)
    outputs = None
    if streamed and out_dir is not None:
        outputs = StreamedOutputs(Path(out_dir))
        ledger.write_rows, metrics.write_step_rows = outputs.write_requests, outputs.write_steps
    ended = RequestsEnded(ledger, metrics, streamed)
    replicas, retention_policies, lora_managers = [], [], []
    next_arrival = NextArrival() if sessions is None else sessions
    for pool in pools:
        replicas += build_pool_replicas(pool, len(replicas), env, metrics, model, speculation,
                                        predictor, next_arrival, ended,
                                        retention_policies, lora_managers,
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
                             frontend_latency(cfg)))
    else:
        sessions.start(router, replicas)
    return Simulation(cfg, pools, env, replicas, metrics, ledger, ended, requests, sessions,
                      num_planned, streamed, disaggregated, retention_policies, lora_managers,
                      outputs)


def simulate(simulation: Simulation, progress: bool) -> None:
    """Run the simulation to its end (a progress bar on stderr with `progress`), then put its
    step rows in order and its replicas' inter-token latencies into its metrics."""
    # (None: only on a terminal, where erasing the bar leaves the line clean for the summary.)
    bar = simulation.ended.bar = tqdm(total=simulation.num_planned, desc="requests", unit="req",
                                      disable=None if progress else True, mininterval=0.5,
                                      leave=False)
    # The workload's objects live for the whole run: keep the cyclic GC from rescanning them at
    # every collection, and collect young objects less often (most a step keeps are not garbage).
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
    """The run's summary (summary.json), after checking that every request ended; warnings about
    features the run configured but never used, and about many rejections, go to stderr."""
    cfg, metrics, replicas = simulation.cfg, simulation.metrics, simulation.replicas
    requests, pools = simulation.requests, simulation.pools
    if simulation.streamed:
        summary = streamed_summary(metrics, simulation.ledger, simulation.num_planned,
                                   time.perf_counter() - wall_start, slos_ms(cfg) is not None,
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
                              slos_ms=slos_ms(cfg), fairness_window_s=fairness_window_s(cfg))
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
    """The run's files in `out_dir`: summary, requests and steps (a streamed run's rows are
    written already), the plots unless plots=False, and trace.json with cfg.trace_export."""
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
                        metrics: MetricsCollector, model: ModelSpec, speculation, predictor,
                        next_arrival: NextArrival, on_requests_done,
                        retention_policies: list | None = None,
                        lora_managers: list | None = None,
                        meter_class: type[EnergyMeter] = EnergyMeter) -> list[Replica]:
    """A pool's replicas, numbered from `first_id`: each its own policies (built from the pool's
    config), executor and energy meter (a `meter_class`); the KV retention policies that keep
    blocks are appended to `retention_policies`, their LoRA managers to `lora_managers`."""
    cfg = pool.cfg
    group_size = lockstep_group_size(cfg, model, pool.num_replicas, pool.role)
    replicas = []
    num_stages = pipeline_parallel_size(cfg, model)
    if num_stages > 1 and group_size > 1:
        raise ValueError(f"cluster.pipeline_parallel_size={num_stages} with an expert group "
                         f"spanning {group_size} replicas (cluster.expert_parallel_size): "
                         f"pipeline stages and lockstep ranks are not modelled together")
    for replica_id in range(first_id, first_id + pool.num_replicas):
        if num_stages > 1:   # (virtual engines over pipeline stages)
            replicas.append(build_pipelined_replica(
                pool, replica_id, env, metrics, model, num_stages, predictor, on_requests_done,
                retention_policies, lora_managers, meter_class))
            continue
        preemption = build_preemption(cfg.preemption)
        scheduler = assemble_scheduler(
            cfg.scheduler, preemption, kv_cache_policy_config(cfg.kv_cache),
            lambda preemption: kv_cache_sizes(cfg, model, pool.num_kv_blocks, preemption,
                                              speculation),
            max_num_batched_tokens=max_num_batched_tokens(cfg, model),
            max_model_len=model.max_model_len,
            speculation=None if speculation is None else speculation.policy_cfg,
            kv_retention=cfg.get("kv_retention"), retention_policies=retention_policies,
            lora=lora_config(cfg.get("lora")), lora_managers=lora_managers)
        kv_cache = scheduler.kv_cache
        executor = build_replica_executor(cfg, model, pool.hardware, kv_cache, speculation,
                                          replica_id)
        energy = build_energy_meter(
            cfg.get("power"), model, pool.hardware, cfg.cluster.tensor_parallel_size,
            cfg.kv_cache.block_size,
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
