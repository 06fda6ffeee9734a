"""A run's summary (`MetricsCollector.summary`): its headline numbers from its requests and what
its MetricsCollector recorded."""
from __future__ import annotations

import operator
from typing import TYPE_CHECKING

from policies.types import Request
from runtime.metrics.fairness import decode_step_ends, windowed_fairness
from runtime.metrics.statistics import (GROUP_LATENCY_KEYS, LATENCY_METRICS,
                                         completed_requests, group_summaries, jain_fairness,
                                         latency_arrays_s, meets_slos, output_tokens,
                                         per_second, stats_ms)

if TYPE_CHECKING:
    from runtime.metrics.recorder import MetricsCollector
    from runtime.metrics.streaming import RequestLedger, RequestTotals

# Long enough for several requests of each tenant, short enough to see who was served while
# both waited.
DEFAULT_FAIRNESS_WINDOW_S = 10.0


def run_summary(metrics: MetricsCollector, requests: list[Request], wall_time_s: float,
                slos_ms: dict[str, float] | None = None,
                fairness_window_s: float = DEFAULT_FAIRNESS_WINDOW_S) -> dict:
    """The run's headline numbers; a value with no data to stand on is 0.0 (statistics.py).

    `slos_ms`, e.g. {"ttft": 200, "tpot": 50}, adds `goodput` and `slo_attainment` (vllm's
    definitions), as do requests' own SLOs."""
    # Sums over the requests run as C passes (map, attrgetter): a big run's summary is a share
    # of its time.
    completed = completed_requests(requests)
    duration_s = _duration_s(requests, completed)
    total_input = sum(map(operator.attrgetter("prompt_len"), completed))
    result = _headline(len(completed), _num_set(requests, "rejected_reason"), len(requests),
                       duration_s, total_input, sum(output_tokens(completed)))
    latencies = latency_arrays_s(completed)
    result.update(_latency_numbers(metrics, lambda name: stats_ms(latencies[name], name)))
    has_slos = slos_ms is not None or not (_all_none(requests, "slo_ttft_ms")
                                           and _all_none(requests, "slo_tpot_ms"))
    if has_slos:
        result.update(_goodput(completed, slos_ms or {}, duration_s,
                               _num_set(requests, "abandoned_time")))
    result.update(_step_numbers(metrics, sum(map(operator.attrgetter("num_preemptions"),
                                                 requests)), duration_s, wall_time_s))
    if not _all_none(requests, "prompt_token_ids"):   # prefix caching needs token ids
        result.update(_prefix_cache_numbers(
            total_input, sum(request.num_cached_tokens for request in completed),
            sum(request.num_host_cached_tokens for request in completed)))
    result.update(_offload_numbers(metrics))
    result.update(group_summaries(requests, duration_s, slos_ms, has_slos))
    if "per_tenant" in result:
        _add_windowed_fairness(result, requests, metrics, fairness_window_s)
    return result


def _duration_s(requests: list[Request], completed: list[Request]) -> float:
    """From the first arrival to the last completion; 0.0 when nothing completed."""
    if not completed:
        return 0.0
    return (max(map(operator.attrgetter("finish_time"), completed))
            - min(map(operator.attrgetter("arrival_time"), requests)))


def _headline(num_completed: int, num_rejected: int, num_requests: int, duration_s: float,
              total_input: int, total_output: int) -> dict:
    """The counts and throughputs that open every summary."""
    return {
        "completed": num_completed,
        "rejected": num_rejected,
        "num_requests": num_requests,
        "duration_s": float(duration_s),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": per_second(num_completed, duration_s),
        "output_throughput": per_second(total_output, duration_s),
        "total_token_throughput": per_second(total_input + total_output, duration_s),
    }


def _latency_numbers(metrics: MetricsCollector, stats_of) -> dict:
    """Each latency metric's statistics: ITL from the step recorder, the rest from `stats_of`."""
    result: dict = {}
    for name in LATENCY_METRICS:
        result.update(metrics.itl_stats_ms() if name == "itl" else stats_of(name))
    return result


def _add_windowed_fairness(result: dict, requests: list[Request], metrics: MetricsCollector,
                           fairness_window_s: float) -> None:
    """The windowed fairness (fairness.py) beside `jain_fairness`, and its per-tenant parts."""
    fairness, per_tenant = windowed_fairness(requests, decode_step_ends(metrics),
                                             fairness_window_s)
    result.update(fairness)
    for tenant, part in per_tenant.items():
        result["per_tenant"][tenant].update(part)


def _num_set(requests: list[Request], name: str) -> int:
    """How many requests have attribute `name` not None."""
    return len(requests) - list(map(operator.attrgetter(name), requests)).count(None)


def _all_none(requests: list[Request], name: str) -> bool:
    """Whether every request's attribute `name` is None."""
    return list(map(operator.attrgetter(name), requests)).count(None) == len(requests)


def streamed_run_summary(metrics: MetricsCollector, ledger: RequestLedger, wall_time_s: float,
                         has_slos: bool) -> dict:
    """run_summary's numbers from a ledger folded as requests finished (percentiles from
    sketches); without the windowed fairness, which needs every request's times."""
    totals = ledger.totals
    duration_s = totals.last_finish - totals.first_arrival if totals.completed else 0.0
    total_input = totals.total_input
    result = _headline(totals.completed, totals.rejected, totals.num_requests, duration_s,
                       total_input, totals.total_output)
    result.update(_latency_numbers(metrics, totals.latency_stats_ms))
    has_slos = has_slos or totals.has_request_slos
    if has_slos:
        result.update(_streamed_goodput(totals, duration_s))
    result.update(_step_numbers(metrics, totals.num_preemptions, duration_s, wall_time_s))
    if totals.has_token_ids:
        result.update(_prefix_cache_numbers(total_input, totals.cached_tokens,
                                            totals.host_cached_tokens))
    result.update(_offload_numbers(metrics))
    for key, groups in (("per_tenant", ledger.by_tenant), ("per_priority", ledger.by_priority)):
        if len(groups) > 1:
            result[key] = {str(value): _streamed_group(groups[value], duration_s, has_slos)
                           for value in sorted(groups, key=str if key == "per_tenant" else None)}
    if len(ledger.by_tenant) > 1:
        result["jain_fairness"] = jain_fairness(
            [float(group.service_tokens) for group in ledger.by_tenant.values()])
    return result


def _streamed_goodput(totals: RequestTotals, duration_s: float) -> dict[str, float]:
    """_goodput's numbers from a ledger's totals."""
    counted = totals.completed + totals.abandonment["abandoned"]
    return {"goodput": per_second(totals.num_good, duration_s),
            "slo_attainment": totals.num_good / counted if counted else 0.0}


def _streamed_group(totals: RequestTotals, duration_s: float, has_slos: bool) -> dict:
    """statistics._group_summary's numbers from one group's totals."""
    result: dict = {
        "completed": totals.completed,
        "request_throughput": per_second(totals.completed, duration_s),
        "output_throughput": per_second(totals.total_output, duration_s),
    }
    stats = {}
    for name in ("ttft", "tpot", "e2el"):
        stats.update(totals.latency_stats_ms(name))
    result.update({key: stats[key] for key in GROUP_LATENCY_KEYS})
    if has_slos:
        result["slo_attainment"] = _streamed_goodput(totals, duration_s)["slo_attainment"]
    return result


def _step_numbers(metrics: MetricsCollector, num_preemptions: int, duration_s: float,
                  wall_time_s: float) -> dict:
    """The summary's numbers from the step rows (and the requests' preemptions, in key order)."""
    total = metrics.step_column_total
    blocks_swapped = total("num_blocks_swapped_out") + total("num_blocks_swapped_in")
    num_drafts = total("num_draft_tokens")
    num_accepted = total("num_accepted_tokens")
    num_decodes = total("num_decode_seqs")
    return {
        "num_preemptions": num_preemptions,
        "peak_kv_blocks": metrics.step_column_peak("kv_blocks_used"),
        "kv_waste_fraction": metrics.kv_waste_fraction(),
        "swap_bytes": int(blocks_swapped) * metrics.kv_bytes_per_block,
        "num_steps": metrics.num_steps,
        "wall_time_s": float(wall_time_s),
        "sim_speedup": per_second(duration_s, wall_time_s),
        "num_draft_tokens": num_drafts,
        "num_accepted_tokens": num_accepted,
        "spec_acceptance_rate": num_accepted / num_drafts if num_drafts else 0.0,
        "mean_tokens_per_decode_step": ((num_decodes + num_accepted) / num_decodes
                                        if num_decodes else 0.0),
    }


def _prefix_cache_numbers(prompt_tokens: int, cached: int, host_cached: int) -> dict:
    """The share of completed prompts' tokens the prefix cache served, and of those the
    device's cache and the host tier's."""
    def share(tokens: int) -> float:
        return tokens / prompt_tokens if prompt_tokens else 0.0
    return {"prefix_cache_hit_rate": share(cached),
            "prefix_cache_device_hit_rate": share(cached - host_cached),
            "prefix_cache_host_hit_rate": share(host_cached)}


def _offload_numbers(metrics: MetricsCollector) -> dict:
    """The prefix cache's host tier: K/V bytes stored there and loaded back (none without)."""
    blocks_offloaded = metrics.step_column_total("num_blocks_offloaded")
    blocks_loaded = metrics.step_column_total("num_blocks_loaded")
    if not (blocks_offloaded or blocks_loaded):
        return {}
    return {"offload_bytes": blocks_offloaded * metrics.kv_bytes_per_block,
            "reload_bytes": blocks_loaded * metrics.kv_bytes_per_block}


def _goodput(completed: list[Request], slos_ms: dict[str, float], duration_s: float,
             num_abandoned: int = 0) -> dict[str, float]:
    """`goodput` and `slo_attainment`; an abandoned request counts as a miss."""
    unknown = set(slos_ms) - {"ttft", "tpot", "e2el"}
    if unknown:
        raise ValueError(f"unknown SLO metrics {sorted(unknown)}; use ttft, tpot, e2el")
    num_good = sum(1 for request in completed if meets_slos(request, slos_ms))
    return {"goodput": per_second(num_good, duration_s),
            "slo_attainment": (num_good / (len(completed) + num_abandoned)
                               if completed or num_abandoned else 0.0)}
