"""Build one experiment from its config and run it: the code behind `twinserve`, callable from
tests and scripts without the command line.

The config is the Hydra tree of conf/ (model, hardware, workload, scheduler, kv_cache, preemption,
speculation, cost_model, cluster, backend). Policies are built with `hydra.utils.instantiate`, so
any `_target_` class works, the built-in ones and a user's own.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig
from tqdm import tqdm

from policies.types import Request
from sim.core.build import (build_kv_cache, build_policy, build_predictor,
                             build_replica_executor, build_router, check_run_settings,
                             max_num_batched_tokens, num_kv_blocks, slos_ms, speculation_setup,
                             speed_summary)
from sim.core.metrics import MetricsCollector, rejection_summary
from sim.core.replica import NextArrival, Replica, SimEnvironment, arrivals
from sim.core.specs import HardwareSpec, ModelSpec
from sim.core.workload import build_workload



@dataclass
class RunResult:
    summary: dict
    requests: list[Request]
    metrics: MetricsCollector
    num_kv_blocks: int


def check_tenant_weights(scheduler_cfg, requests: list[Request]) -> None:
    """A scheduler's `tenant_weights` (scheduler=vtc) may weigh only tenants the run's requests
    have: a name that none has is a typo, not a tenant to wait for."""
    weights = scheduler_cfg.get("tenant_weights") if hasattr(scheduler_cfg, "get") else None
    if not weights or not hasattr(weights, "keys"):
        return   # none, or not a mapping: the scheduler itself says what it takes
    tenants = sorted({request.tenant for request in requests})
    for tenant in weights.keys():
        if tenant not in tenants:
            raise ValueError(f"scheduler.tenant_weights.{tenant}: no request of the run has "
                             f"tenant {tenant!r}; the run's tenants: {', '.join(tenants)}")


def run_experiment(cfg: DictConfig, out_dir: Path | None = None,
                   progress: bool = False, plots: bool = True) -> RunResult:
    """Run the experiment `cfg` describes; write its files into `out_dir` if given (the PNG
    plots too, unless plots=False)."""
    wall_start = time.perf_counter()
    model = ModelSpec.from_config(cfg.model)
    hardware = HardwareSpec.from_config(cfg.hardware)
    check_run_settings(cfg)
    num_blocks = num_kv_blocks(cfg, model, hardware)
    # The target's KV bytes of one block: what the summary counts a swapped block as.
    bytes_per_block = model.kv_bytes_per_block(cfg.kv_cache.block_size)
    router = build_router(cfg.cluster.router)
    speculation = speculation_setup(cfg)
    # One per run, asked at each arrival; a config without the group predicts nothing.
    predictor = build_predictor(cfg.get("predictor"), cfg.seed)
    requests = build_workload(cfg.workload, seed=cfg.seed, vocab_size=model.vocab_size)
    check_tenant_weights(cfg.scheduler, requests)

    env = SimEnvironment()
    metrics = MetricsCollector(kv_bytes_per_block=bytes_per_block)
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress,
               mininterval=0.5, leave=False)
    replicas = []
    next_arrival = NextArrival()
    for replica_id in range(cfg.cluster.num_replicas):
        preemption = build_policy(cfg.preemption, "preemption")
        kv_cache = build_kv_cache(cfg, model, num_blocks, preemption, speculation)
        # Only a drafting run passes `speculation`: a scheduler of its own need not know it.
        drafting = ({} if speculation is None else
                    {"speculation": build_policy(speculation.policy_cfg, "speculation")})
        scheduler = build_policy(cfg.scheduler, "scheduler", kv_cache=kv_cache,
                                 preemption=preemption, max_model_len=model.max_model_len,
                                 max_num_batched_tokens=max_num_batched_tokens(cfg, model),
                                 **drafting)
        executor = build_replica_executor(cfg, model, hardware, kv_cache, speculation, replica_id)
        replicas.append(Replica(env, replica_id, scheduler, executor, metrics,
                                on_requests_done=bar.update, next_arrival=next_arrival,
                                predictor=predictor))
    env.process(arrivals(env, requests, router, replicas, next_arrival, predictor))
    # The workload's objects live for the whole run: keep the cyclic GC from rescanning them at
    # every collection (a 100k-request run spends a good part of its time there otherwise).
    gc.freeze()
    try:
        env.run()
    finally:
        gc.unfreeze()
    bar.close()
    metrics.order_steps_by_start()

    for replica in replicas:
        metrics.add_itl_counts(replica.recorder.itl_counts)
    unfinished = [r for r in requests if not r.is_finished]
    if unfinished:
        raise RuntimeError(f"{len(unfinished)} requests never finished (first: "
                           f"{unfinished[0].request_id}); the simulation stalled")
    summary = metrics.summary(requests, wall_time_s=time.perf_counter() - wall_start,
                              slos_ms=slos_ms(cfg))
    summary["num_kv_blocks"] = num_blocks
    summary.update(rejection_summary(requests))
    summary.update(speed_summary([replica.executor for replica in replicas]))
    if out_dir is not None:
        metrics.write_outputs(Path(out_dir), requests, summary, plots=plots)
    return RunResult(summary, requests, metrics, num_blocks)
