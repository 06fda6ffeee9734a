"""Summary statistics of a run's requests, in `vllm bench serve`'s units (ms).

A value with no data is 0.0, never NaN, so summary.json stays valid JSON and scripts need not
special-case empty runs.
"""
from __future__ import annotations

import math
import operator
import re
from collections import defaultdict

import numpy as np

from policies.batching.vtc import INPUT_WEIGHT, OUTPUT_WEIGHT
from policies.types import Request

LATENCY_METRICS: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")
PERCENTILES: tuple[tuple[str, float], ...] = (("median", 50.0), ("p90", 90.0), ("p99", 99.0))
# What each per_tenant / per_priority entry holds of a group's latencies (ms).
GROUP_LATENCY_KEYS: tuple[str, ...] = tuple(
    f"{stat}_{name}_ms" for name in ("ttft", "tpot", "e2el") for stat in ("mean", "median", "p99"))
# VTC's own service weights, so the summary measures what scheduler=vtc equalises.
SERVICE_INPUT_WEIGHT, SERVICE_OUTPUT_WEIGHT = INPUT_WEIGHT, OUTPUT_WEIGHT


# ---- per-request latencies ----------------------------------------------------------------------

def is_completed(request: Request) -> bool:
    return request.finish_time is not None and request.rejected_reason is None


def completed_requests(requests: list[Request]) -> list[Request]:
    """The completed ones of `requests`, in order."""
    # When all completed, as in most runs, two C passes replace a call per request.
    if (list(map(operator.attrgetter("finish_time"), requests)).count(None) == 0
            and list(map(operator.attrgetter("rejected_reason"), requests)).count(None)
            == len(requests)):
        return list(requests)
    return [request for request in requests if is_completed(request)]


def output_tokens(requests: list[Request], per_sample: bool = False) -> list[int]:
    """Each request's `num_output_tokens` (per_sample: `num_output_tokens_per_sample`)."""
    sequences = list(map(operator.attrgetter("sequences"), requests))
    # With one sample per request both counts are the sequence's, read in C passes.
    if list(map(len, sequences)).count(1) == len(sequences):
        return list(map(operator.attrgetter("num_output_tokens"),
                        map(operator.itemgetter(0), sequences)))
    name = "num_output_tokens_per_sample" if per_sample else "num_output_tokens"
    return list(map(operator.attrgetter(name), requests))


def request_latencies_s(request: Request) -> tuple[float | None, float | None, float | None]:
    """(TTFT, TPOT, E2EL) in seconds; None where the request has no such value."""
    ttft = tpot = e2el = None
    if request.first_token_time is not None:
        ttft = request.first_token_time - request.arrival_time
    if request.finish_time is not None:
        e2el = request.finish_time - request.arrival_time
        tokens = request.num_output_tokens_per_sample
        if request.first_token_time is not None and tokens > 1:
            tpot = (request.finish_time - request.first_token_time) / (tokens - 1)
    return ttft, tpot, e2el


def latency_arrays_s(requests: list[Request]) -> dict[str, np.ndarray]:
    """TTFT, TPOT (of requests with more than one token per sample) and E2EL in seconds, as
    `request_latencies_s` gives them, computed one pass per attribute for speed."""
    completed = completed_requests(requests)
    first_token_times = [request.first_token_time for request in completed]
    if None in first_token_times:   # (no run of the simulator leaves one so): request by request
        return _latency_arrays_one_by_one(completed)
    count = len(completed)
    arrival = np.fromiter(map(operator.attrgetter("arrival_time"), completed), np.float64, count)
    finish = np.fromiter(map(operator.attrgetter("finish_time"), completed), np.float64, count)
    first_token = np.asarray(first_token_times, dtype=np.float64)
    tokens = np.fromiter(output_tokens(completed, per_sample=True), np.int64, count)
    has_tpot = tokens > 1
    return {"ttft": first_token - arrival,
            "tpot": (finish[has_tpot] - first_token[has_tpot]) / (tokens[has_tpot] - 1),
            "e2el": finish - arrival}


def _latency_arrays_one_by_one(completed: list[Request]) -> dict[str, np.ndarray]:
    """latency_arrays_s of completed requests, from `request_latencies_s` of each."""
    ttfts, tpots, e2els = [], [], []
    for request in completed:
        ttft, tpot, e2el = request_latencies_s(request)
        if ttft is not None:
            ttfts.append(ttft)
        if tpot is not None:
            tpots.append(tpot)
        e2els.append(e2el)
    return {"ttft": np.asarray(ttfts, dtype=np.float64),
            "tpot": np.asarray(tpots, dtype=np.float64),
            "e2el": np.asarray(e2els, dtype=np.float64)}


def ms_or_none(seconds: float | None) -> float | None:
    """`seconds` in ms; None (no such value) stays None."""
    return None if seconds is None else seconds * 1000.0



# ---- statistics ---------------------------------------------------------------------------------

def stats_ms(values_s: np.ndarray, name: str) -> dict[str, float]:
    """mean/median/p90/p99 of `values_s` (seconds) in ms, keyed like vllm ("mean_ttft_ms")."""
    if values_s.size == 0:
        return {f"{stat}_{name}_ms": 0.0 for stat in ("mean", *(label for label, _ in PERCENTILES))}
    values_ms = values_s * 1000.0
    stats = {f"mean_{name}_ms": float(values_ms.mean())}
    for label, pct in PERCENTILES:
        stats[f"{label}_{name}_ms"] = float(np.percentile(values_ms, pct))
    return stats


def weighted_percentiles(values: np.ndarray, counts: np.ndarray,
                         percentiles: list[float] | np.ndarray) -> np.ndarray:
    """np.percentile(np.repeat(values, counts), percentiles) without materialising the repeat,
    which can be billions of tokens long."""
    values = np.asarray(values, dtype=np.float64)
    counts = np.asarray(counts, dtype=np.int64)
    keep = counts > 0
    values, counts = values[keep], counts[keep]
    order = np.argsort(values, kind="stable")
    values, counts = values[order], counts[order]
    # ends[i] is one past the last position of values[i] in the sorted, expanded list.
    if counts.size == 0:
        raise ValueError("weighted_percentiles of an empty multiset")
    ends = np.cumsum(counts)
    total = int(ends[-1])
    # numpy's "linear" method: virtual index h = (N - 1) * q, interpolate between floor and ceil.
    positions = (total - 1) * (np.asarray(percentiles, dtype=np.float64) / 100.0)
    below = np.floor(positions)
    fraction = positions - below
    below = below.astype(np.int64)
    above = np.minimum(below + 1, total - 1)
    value_below = values[np.searchsorted(ends, below, side="right")]
    value_above = values[np.searchsorted(ends, above, side="right")]
    # The same two-sided lerp as numpy's, so results match it to the last bit.
    difference = value_above - value_below
    return np.where(fraction >= 0.5, value_above - difference * (1.0 - fraction),
                    value_below + difference * fraction)


def histogram_stats_ms(itl_counts: dict[float, int], name: str) -> dict[str, float]:
    """stats_ms of the latencies in a {seconds: count} histogram, each counted that often."""
    total = sum(itl_counts.values())
    if total == 0:
        return stats_ms(np.empty(0), name)
    values_ms = np.fromiter(itl_counts.keys(), dtype=np.float64, count=len(itl_counts)) * 1000.0
    counts = np.fromiter(itl_counts.values(), dtype=np.int64, count=len(itl_counts))
    # Casting first gives np.dot's bits and skips its slow mixed-type path.
    stats = {f"mean_{name}_ms": float(np.dot(values_ms, counts.astype(np.float64)) / total)}
    results = weighted_percentiles(values_ms, counts, [pct for _, pct in PERCENTILES])
    for (label, _), value in zip(PERCENTILES, results):
        stats[f"{label}_{name}_ms"] = float(value)
    return stats


def per_second(amount: float, duration_s: float) -> float:
    """A rate over `duration_s`; 0.0 for an empty run."""
    return amount / duration_s if duration_s > 0 else 0.0


def rejection_kind(reason: str) -> str:
    """A rejection reason with its numbers written #: reasons alike but for them are one kind."""
    return re.sub(r"\d+", "#", reason)


def count_rejections(requests: list[Request], kinds: dict[str, list]) -> None:
    """Count the rejected `requests` into `kinds` {kind: [its first reason, count]}."""
    for request in requests:
        if request.rejected_reason is not None:
            kinds.setdefault(rejection_kind(request.rejected_reason),
                             [request.rejected_reason, 0])[1] += 1


def rejection_summary(requests: list[Request]) -> dict:
    """Why a run rejected requests: the most common kind (reasons alike but for their numbers)
    with its first reason and count, and every kind's count."""
    kinds: dict[str, list] = {}
    count_rejections(requests, kinds)
    return rejection_kinds_summary(kinds)


def rejection_kinds_summary(kinds: dict[str, list]) -> dict:
    """rejection_summary's keys from count_rejections' {kind: [first reason, count]}."""
    if not kinds:
        return {}
    reason, count = max(kinds.values(), key=lambda example_count: example_count[1])
    by_reason = sorted(kinds.items(), key=lambda kind_count: (-kind_count[1][1], kind_count[0]))
    return {"rejected_reason": reason, "rejected_reason_count": count,
            "rejected_by_reason": {kind: kind_count for kind, (_, kind_count) in by_reason}}


def request_slos_ms(request: Request, slos_ms: dict[str, float] | None) -> dict[str, float]:
    """The limits (ms) `request` is held to: the run's, with its own TTFT / TPOT SLOs in place."""
    limits = dict(slos_ms or {})
    if request.slo_ttft_ms is not None:
        limits["ttft"] = request.slo_ttft_ms
    if request.slo_tpot_ms is not None:
        limits["tpot"] = request.slo_tpot_ms
    return limits


def meets_slos(request: Request, slos_ms: dict[str, float] | None) -> bool:
    """Whether a completed request met every limit it is held to."""
    ttft, tpot, e2el = map(ms_or_none, request_latencies_s(request))
    latencies_ms = {"ttft": ttft, "tpot": tpot, "e2el": e2el}
    # A request without a TPOT (single-token samples) cannot miss a TPOT SLO.
    return all(latencies_ms[name] is None or latencies_ms[name] <= limit
               for name, limit in request_slos_ms(request, slos_ms).items())


def service_tokens(request: Request) -> int:
    """The service a completed request got, in VTC's weighted tokens; 0 for any other."""
    if not is_completed(request):
        return 0
    return (SERVICE_INPUT_WEIGHT * request.prompt_len
            + SERVICE_OUTPUT_WEIGHT * request.num_output_tokens)


def jain_fairness(values: list[float]) -> float:
    """Jain's index (sum x)^2 / (n * sum x^2); 0.0 when nobody got anything."""
    squares = math.fsum(value * value for value in values)
    return math.fsum(values) ** 2 / (len(values) * squares) if squares else 0.0


def _group_summary(requests: list[Request], duration_s: float,
                   slos_ms: dict[str, float] | None, has_slos: bool) -> dict:
    """One group's numbers; throughputs over the whole run's duration, so that the groups'
    throughputs add up to the run's."""
    completed = completed_requests(requests)
    result: dict = {
        "completed": len(completed),
        "request_throughput": per_second(len(completed), duration_s),
        "output_throughput": per_second(sum(output_tokens(completed)), duration_s),
    }
    latencies = latency_arrays_s(completed)
    stats = {}
    for name in ("ttft", "tpot", "e2el"):
        stats.update(stats_ms(latencies[name], name))
    result.update({key: stats[key] for key in GROUP_LATENCY_KEYS})
    if has_slos:
        # A request its client gave up on (runtime/deadlines.py) missed, as in the run's.
        counted = len(completed) + sum(request.abandoned_time is not None for request in requests)
        num_good = sum(1 for request in completed if meets_slos(request, slos_ms))
        result["slo_attainment"] = num_good / counted if counted else 0.0
    return result


def group_summaries(requests: list[Request], duration_s: float,
                    slos_ms: dict[str, float] | None, has_slos: bool) -> dict:
    """`per_tenant` (with `jain_fairness`) and `per_priority`, each when there is more than one."""
    by_tenant: dict[str, list[Request]] = defaultdict(list)
    by_priority: dict[int, list[Request]] = defaultdict(list)
    for request in requests:
        by_tenant[request.tenant].append(request)
        by_priority[request.priority].append(request)
    result: dict = {}
    if len(by_tenant) > 1:
        result["per_tenant"] = {str(tenant): _group_summary(by_tenant[tenant], duration_s,
                                                            slos_ms, has_slos)
                                for tenant in sorted(by_tenant, key=str)}
    if len(by_priority) > 1:
        result["per_priority"] = {str(priority): _group_summary(by_priority[priority],
                                                                duration_s, slos_ms, has_slos)
                                  for priority in sorted(by_priority)}
    if len(by_tenant) > 1:
        result["jain_fairness"] = jain_fairness(
            [float(sum(map(service_tokens, group))) for group in by_tenant.values()])
    return result
