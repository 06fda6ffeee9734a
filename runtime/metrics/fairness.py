"""Fairness over time: each tenant's VTC service per window, compared between tenants backlogged
for the whole window, which is what VTC's guarantee is about; a whole-run index only measures the
demand ratio once everything completes.

Output tokens are spread evenly over the replica's decode steps from first token to finish (exact
without preemption or speculation), computed once in the summary so nothing is added per step.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from policies.types import Request
from runtime.metrics.statistics import (SERVICE_INPUT_WEIGHT, SERVICE_OUTPUT_WEIGHT,
                                         is_completed, jain_fairness)

if TYPE_CHECKING:
    from runtime.metrics.recorder import MetricsCollector

# Keeps a step that ends at a request's first token or finish on the right side of it despite
# rounding.
_TIME_TOLERANCE_S = 1e-9


def windowed_fairness(requests: list[Request], decode_step_ends: dict[int, np.ndarray],
                      window_s: float) -> tuple[dict, dict[str, dict]]:
    """The run's windowed fairness over windows with two or more tenants backlogged throughout
    (max service difference, mean Jain's index), and each tenant's part; zeros with no such
    window."""
    tenants = sorted({request.tenant for request in requests}, key=str)
    edges = window_edges(requests, window_s)
    service = service_by_window(requests, decode_step_ends, edges)
    backlogged = {tenant: backlogged_by_window(
        [request for request in requests if request.tenant == tenant], edges)
        for tenant in tenants}

    diffs, indices = [], []
    per_tenant = {tenant: [] for tenant in tenants}
    for window in range(len(edges) - 1):
        values = {tenant: float(service[tenant][window]) for tenant in tenants
                  if backlogged[tenant][window]}
        if len(values) < 2:
            continue
        diffs.append(max(values.values()) - min(values.values()))
        indices.append(jain_fairness(list(values.values())))
        for tenant, value in values.items():
            per_tenant[tenant].append(value)
    summary = {
        "fairness_window_s": float(window_s),
        "fairness_windows": len(diffs),
        "max_backlogged_service_diff": max(diffs, default=0.0),
        "windowed_jain_fairness": math.fsum(indices) / len(indices) if indices else 0.0,
    }
    tenant_parts = {str(tenant): {
        "backlogged_windows": len(values),
        "mean_backlogged_service": math.fsum(values) / len(values) if values else 0.0,
    } for tenant, values in per_tenant.items()}
    return summary, tenant_parts


def window_edges(requests: list[Request], window_s: float) -> np.ndarray:
    """The edges of the whole windows of `window_s` from the first arrival to the last finish."""
    start = min(request.arrival_time for request in requests)
    end = max((request.finish_time for request in requests if is_completed(request)),
              default=start)
    return start + window_s * np.arange(int((end - start) // window_s) + 1)


def service_by_window(requests: list[Request], decode_step_ends: dict[int, np.ndarray],
                      edges: np.ndarray) -> dict[str, np.ndarray]:
    """Tenant -> the weighted tokens its completed requests were served in each window between
    `edges` (every tenant of `requests`, zeros for one that got nothing)."""
    served = {tenant: np.zeros(len(edges)) for tenant in {r.tenant for r in requests}}
    for request in requests:
        if is_completed(request):
            served[request.tenant] += _service_by(request, edges, decode_step_ends)
    return {tenant: np.diff(cumulative) for tenant, cumulative in served.items()}


def decode_step_ends(metrics: MetricsCollector) -> dict[int, np.ndarray]:
    """Replica id -> the sorted end times of its steps with decodes, from the step rows."""
    column = metrics.step_column
    replicas = column("replica_id")
    decoding = column("num_decode_seqs") > 0
    ends = column("start_time") + column("duration")
    return {int(replica): np.sort(ends[decoding & (replicas == replica)])
            for replica in np.unique(replicas)}


def _service_by(request: Request, edges: np.ndarray,
                decode_step_ends: dict[int, np.ndarray]) -> np.ndarray:
    """The weighted tokens `request` was served by each of `edges` (times, in order)."""
    first_tokens = min(request.n, request.num_output_tokens)
    served = (SERVICE_INPUT_WEIGHT * request.prompt_len * (request.first_scheduled_time <= edges)
              + SERVICE_OUTPUT_WEIGHT * first_tokens * (request.first_token_time <= edges))
    later_tokens = request.num_output_tokens - first_tokens
    if later_tokens:
        served = served + SERVICE_OUTPUT_WEIGHT * later_tokens * _decoded_share_by(
            request, edges, decode_step_ends)
    return served


def _decoded_share_by(request: Request, edges: np.ndarray,
                      decode_step_ends: dict[int, np.ndarray]) -> np.ndarray:
    """The share of its decode steps after its first token that `request` ran by each edge; a
    share of time where its replica recorded no steps."""
    ends = decode_step_ends.get(request.replica_id)
    if ends is None and len(decode_step_ends) == 1:
        (ends,) = decode_step_ends.values()
    begin, finish = request.first_token_time, request.finish_time
    if ends is not None:
        first, last = np.searchsorted(ends, [begin + _TIME_TOLERANCE_S,
                                             finish + _TIME_TOLERANCE_S], side="right")
        if last > first:
            steps_by_edge = np.searchsorted(ends, edges, side="right") - first
            return np.clip(steps_by_edge, 0, last - first) / (last - first)
    if finish <= begin:
        return (finish <= edges).astype(np.float64)
    return np.clip((edges - begin) / (finish - begin), 0.0, 1.0)


def backlogged_by_window(requests: list[Request], edges: np.ndarray) -> np.ndarray:
    """For each window between `edges`, whether some request waited for its first admission
    throughout it."""
    spans = sorted((request.arrival_time, request.first_scheduled_time)
                   for request in requests if request.first_scheduled_time is not None)
    merged: list[list[float]] = []
    for begin, finish in spans:
        if merged and begin <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], finish)
        else:
            merged.append([begin, finish])
    if not merged or len(edges) < 2:
        return np.zeros(max(len(edges) - 1, 0), dtype=bool)
    begins = np.array([span[0] for span in merged])
    finishes = np.array([span[1] for span in merged])
    covering = np.searchsorted(begins, edges[:-1], side="right") - 1
    return (covering >= 0) & (finishes[np.maximum(covering, 0)] >= edges[1:])
