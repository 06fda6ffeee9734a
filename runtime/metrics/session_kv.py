"""What a run's multi-turn sessions got from the KV kept between their turns: first and follow-up
turns apart, and the blocks held for idle sessions over time."""
from __future__ import annotations

import heapq
from collections.abc import Iterable
from itertools import groupby

from policies.types import Request
from runtime.metrics.statistics import is_completed, latency_arrays_s, stats_ms


def has_sessions(requests: list[Request]) -> bool:
    return any(request.session_id is not None for request in requests)


def session_kv_summary(requests: list[Request],
                       held_blocks_logs: Iterable[list[tuple[float, int]]]) -> dict:
    """TTFT and prefix-cache hit rate of first and follow-up turns, and the blocks held for idle
    sessions (summed over replicas, time-weighted mean and maximum)."""
    in_sessions = [r for r in requests if r.session_id is not None]
    completed = [r for r in in_sessions if is_completed(r)]
    turns = {"first_turn": [r for r in completed if not r.turn],
             "followup_turn": [r for r in completed if r.turn]}
    summary: dict = {"num_sessions": len({r.session_id for r in in_sessions}),
                     "num_followup_turns": len(turns["followup_turn"])}
    for kind, done in turns.items():
        summary.update(stats_ms(latency_arrays_s(done)["ttft"], f"ttft_{kind}"))
    if any(r.prompt_token_ids is not None for r in in_sessions):
        for kind, done in turns.items():
            prompt_tokens = sum(r.prompt_len for r in done)
            summary[f"prefix_cache_hit_rate_{kind}"] = (
                sum(r.num_cached_tokens for r in done) / prompt_tokens if prompt_tokens else 0.0)
    finished = [r.finish_time for r in requests if is_completed(r)]
    start = min(r.arrival_time for r in requests) if finished else 0.0
    end = max(finished, default=0.0)
    summary["idle_session_blocks_mean"], summary["idle_session_blocks_max"] = (
        held_blocks_over_time(held_blocks_logs, start, end))
    return summary


def held_blocks_over_time(logs: Iterable[list[tuple[float, int]]], start: float,
                          end: float) -> tuple[float, float]:
    """The time-weighted mean over [start, end] and the maximum of a level moved by the logs'
    changes; changes at one time count together so a pin and its releases make no false peak."""
    changes = heapq.merge(*(sorted(log, key=_time) for log in logs), key=_time)
    level = peak = 0
    area = 0.0
    last = start
    for time, group in groupby(changes, key=_time):
        clipped = min(max(time, start), end)
        area += level * (clipped - last)
        last = clipped
        level += sum(delta for _, delta in group)
        peak = max(peak, level)
    area += level * (end - last)
    return (area / (end - start) if end > start else 0.0), float(peak)


def _time(change: tuple[float, int]) -> float:
    return change[0]
