"""The summary of a run's multi-turn sessions (requests with a `session_id`): first turns and
follow-up turns apart, since a follow-up's prompt holds the conversation so far and its latency
depends on what the server kept of it. Absent from runs without sessions."""
from __future__ import annotations

import operator

import numpy as np

from policies.types import Request
from sim.core.metrics.statistics import is_completed, stats_ms


def session_summary(requests: list[Request]) -> dict:
    """`num_sessions` and TTFT statistics of first turns (`*_ttft_first_turn_ms`) and of later
    turns (`*_ttft_followup_turn_ms`) over completed requests; {} when no request has a
    session."""
    session_ids = list(map(operator.attrgetter("session_id"), requests))
    if session_ids.count(None) == len(session_ids):
        return {}
    in_sessions = [request for request, session in zip(requests, session_ids)
                   if session is not None and is_completed(request)]
    ttft_s = {"first_turn": [], "followup_turn": []}
    for request in in_sessions:
        ttft_s["followup_turn" if request.turn else "first_turn"].append(
            request.first_token_time - request.arrival_time)
    result = {"num_sessions": len(set(session_ids) - {None})}
    for kind, values in ttft_s.items():
        result.update(stats_ms(np.asarray(values, dtype=np.float64), f"ttft_{kind}"))
    return result
