"""Long runs in bounded memory: whether a run is streamed (runtime/metrics/streaming.py), and a
streamed run's checks and summary."""
from __future__ import annotations

import sys

from omegaconf import DictConfig

from policies.validators import positive_int
from sim.core.energy.summary import energy_summary
from runtime.metrics import MetricsCollector
from runtime.metrics.statistics import rejection_kinds_summary
from runtime.metrics.streaming import RequestLedger
from runtime.metrics.summary import streamed_run_summary
from sim.core.workload import RequestStream

# Runs of up to this many requests keep every request: exact percentiles, plots and trace.json.
DEFAULT_MAX_KEPT_REQUESTS = 100_000


def max_kept_requests(cfg: DictConfig) -> int:
    """metrics.max_kept_requests, checked."""
    value = (cfg.get("metrics") or {}).get("max_kept_requests")
    if value is None:
        return DEFAULT_MAX_KEPT_REQUESTS
    return positive_int("metrics.max_kept_requests", value)


def is_streamed(cfg: DictConfig, requests, num_planned: int, disaggregated: bool) -> bool:
    """Whether an open-loop run of more than metrics.max_kept_requests streams, unless a part of
    the run needs every request (said on stderr)."""
    limit = max_kept_requests(cfg)
    if num_planned <= limit:
        return False
    streamable = isinstance(requests, RequestStream)
    needs = [why for why, needed in (
        ("a closed-loop workload (the run makes its turns)", requests is None),
        ("requests handed to run_experiment", requests is not None and not streamable),
        ("cluster=disaggregated (its KV-transfer percentiles)", disaggregated),
        ("cluster.pools (per-pool step counts)", cfg.cluster.get("pools") is not None),
        ("trace_export=true", bool(cfg.get("trace_export"))),
        ("sessions (their KV summary)", streamable and requests.has_sessions())) if needed]
    if needs:
        print(f"twinserve: all {num_planned:,} requests are kept to the end (memory grows "
              f"with them) because of {', '.join(needs)}; above metrics.max_kept_requests="
              f"{limit:,} a run without these streams them", file=sys.stderr)
        return False
    return True


def streamed_summary(metrics: MetricsCollector, ledger: RequestLedger, num_planned: int,
                     wall_time_s: float, has_slos: bool, replicas: list) -> dict:
    """A streamed run's checks and its summary keys that come from requests."""
    ledger.fold()
    metrics.spill_steps(keep=0)
    totals = ledger.totals
    if totals.num_requests != num_planned:
        raise RuntimeError(f"{num_planned - totals.num_requests} requests never finished; the "
                           f"simulation stalled")
    if totals.num_missing_first_token:
        schedulers = sorted({type(replica.scheduler).__name__ for replica in replicas})
        raise RuntimeError(f"{totals.num_missing_first_token} finished requests have no "
                           f"first_token_time (first: {totals.first_missing_first_token}): "
                           f"{', '.join(schedulers)}.update must set request.first_token_time "
                           f"when a request gets its first token")
    summary = streamed_run_summary(metrics, ledger, wall_time_s, has_slos)
    if len(ledger.by_tenant) > 1:
        print(f"twinserve: the windowed fairness needs every request's times: it is left out of "
              f"a streamed run ({num_planned:,} requests > metrics.max_kept_requests)",
              file=sys.stderr)
    summary["streamed_requests"] = True
    summary["quantile_relative_accuracy"] = ledger.relative_accuracy
    return summary


def streamed_energy_summary(ledger: RequestLedger, replicas: list, summary: dict) -> dict:
    """energy_summary of a streamed run: the replicas' output tokens from the ledger's totals."""
    return energy_summary({replica.replica_id: replica.recorder.energy for replica in replicas},
                          {replica.replica_id: replica.pool for replica in replicas}, [],
                          summary["duration_s"], summary["total_output_tokens"],
                          ledger.totals.output_tokens_by_replica)


def streamed_rejection_summary(ledger: RequestLedger) -> dict:
    return rejection_kinds_summary(ledger.totals.rejections)
