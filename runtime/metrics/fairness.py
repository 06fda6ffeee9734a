"""Fairness over time: each tenant's service in consecutive windows of a run, compared between the
tenants that were backlogged (had a request waiting for admission) for the whole window, which
is what VTC's guarantee is about (Sheng et al., OSDI 2024: two clients backlogged over an
interval get service within a bounded difference of each other). A whole-run index over
completed service only measures the demand ratio once everything completes; this one sees who
was served while both waited.

Service is VTC's weighted tokens (statistics.SERVICE_*_WEIGHT) at the times the scheduler
counts them: a request's prompt tokens when it is first admitted, its first token (one per
sample) at its first token time, and its other output tokens evenly over its replica's decode
steps (step rows with decodes) from then to its finish. That is exact for a request that
decoded in each of those steps (continuous batching without preemption or speculation); a
preempted request's tokens are spread over its pause too, and a run without step rows spreads
them evenly in time. All of it comes from the requests' times and the step rows already
recorded, once, in the summary: nothing is added per step.
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

# (A finish time and the end of the step that produced it are the same sum of durations; this
# keeps a step ending at a request's first token or finish on the right side of it anyway.)
_TIME_TOLERANCE_S = 1e-9


def windowed_fairness(requests: list[Request], decode_step_ends: dict[int, np.ndarray],
                      window_s: float) -> tuple[dict, dict[str, dict]]:
    """The run's windowed fairness and each tenant's part of it, over the whole windows of
    `window_s` from the first arrival to the last finish. `decode_step_ends`: replica id -> the
    sorted end times of its steps that decoded.

    Returns ({fairness_window_s, fairness_windows: windows with two or more tenants backlogged
    throughout, max_backlogged_service_diff: the largest difference between two such tenants'
    service in one window, windowed_jain_fairness: the mean over those windows of Jain's index of
    their service}, {tenant: {backlogged_windows, mean_backlogged_service: its mean service in
    those windows where it was one of them}}); zeros with no such window."""
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
    """The share of its decode steps after its first token that `request` ran by each edge: of
    its replica's decode steps ending in (first token, finish]; of that time where the replica
    (the only one, where the run did not say: the engine's LLM.generate) recorded no steps."""
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
    """For each window between `edges`, whether some request of `requests` waited for its first
    admission at every moment of it (the union of [arrival, first admission) covers it)."""
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
