"""The closed-loop workload kinds (`sessions`, `agent`, `closed_loop`): a turn arrives a gap after
the previous one *finished*, so a slow server delays the next turn; each builds a `SessionSource`
the run asks for the next request as one finishes."""
from __future__ import annotations

import math

import numpy as np

from policies.types import Request
from sim.core.workload.conversation import (SessionTurns, draw_session_turns, lay_out_sessions,
                                            no_request_left, prompt_settings, session_token_ids)
from sim.core.workload.distributions import (parse_length_distribution, parse_time_distribution,
                                             sample_arrival_times, sample_prompt_token_ids)
from sim.core.workload.fields import Fields, Streams, parse_common
from sim.core.workload.session_source import SessionSource

_COMMON_FIELDS = ("kind", "num_sessions", "rate", "concurrency", "output_len", "max_prompt_len",
                  "n", "with_token_ids", "shared_prefix_len")
SESSIONS_FIELDS = (*_COMMON_FIELDS, "turns", "think_time_s", "message_len")
AGENT_FIELDS = (*_COMMON_FIELDS, "steps", "prompt_len", "tool_latency_s", "tool_output_len")
CLOSED_LOOP_FIELDS = ("kind", "concurrency", "num_requests", "input_len", "output_len",
                      "think_time_s", "n", "with_token_ids")


def sample_sessions(fields: Fields, vocab_size: int | None, streams: Streams) -> SessionSource:
    """The `sessions` kind: the conversation kind's sessions, in a closed loop."""
    fields.reject_unknown(SESSIONS_FIELDS)
    num_sessions, rate, concurrency = _population(fields)
    turns_dist = parse_length_distribution(fields.section("turns"))
    think_dist = parse_time_distribution(fields.section("think_time_s"))
    message_dist = parse_length_distribution(fields.section("message_len"))
    output_dist = parse_length_distribution(fields.section("output_len"))
    max_prompt_len, n, token_spec, shared_prefix_len = prompt_settings(fields, vocab_size)
    drawn = draw_session_turns(
        num_sessions, turns_dist, think_dist, message_dist, output_dist,
        turns_rng=streams.turns, think_rng=streams.think, message_rng=streams.prompt,
        output_rng=streams.output)
    turns = lay_out_sessions(*drawn, shared_prefix_len, max_prompt_len)
    return _source(fields, turns, n, token_spec, streams, num_sessions, rate, concurrency,
                   first_len="message_len")


def sample_agent(fields: Fields, vocab_size: int | None, streams: Streams) -> SessionSource:
    """The `agent` kind: model calls whose next prompt appends the answer and a tool's result."""
    fields.reject_unknown(AGENT_FIELDS)
    num_sessions, rate, concurrency = _population(fields)
    steps_dist = parse_length_distribution(fields.section("steps"))
    prompt_dist = parse_length_distribution(fields.section("prompt_len"))
    output_dist = parse_length_distribution(fields.section("output_len"))
    latency_dist = parse_time_distribution(fields.section("tool_latency_s"))
    tool_output_dist = parse_length_distribution(fields.section("tool_output_len"))
    max_prompt_len, n, token_spec, shared_prefix_len = prompt_settings(fields, vocab_size)
    steps = steps_dist.sample(num_sessions, streams.turns)
    num_calls = int(steps.sum())
    latencies = latency_dist.sample(num_calls, streams.think)
    output_lens = output_dist.sample(num_calls, streams.output)
    # A tool result is drawn after every call, the last one's unused, to keep the stream aligned.
    first_calls = np.cumsum(steps) - steps
    new_lens = np.empty(num_calls, dtype=np.int64)
    new_lens[first_calls] = prompt_dist.sample(num_sessions, streams.prompt)
    tool_lens = tool_output_dist.sample(num_calls, streams.tool)
    later = np.ones(num_calls, dtype=bool)
    later[first_calls] = False
    new_lens[later] = tool_lens[np.flatnonzero(later) - 1]
    turns = lay_out_sessions(steps, latencies, new_lens, output_lens, shared_prefix_len,
                             max_prompt_len)
    return _source(fields, turns, n, token_spec, streams, num_sessions, rate, concurrency,
                   first_len="prompt_len", marks_final_turns=True)


def sample_closed_loop(fields: Fields, vocab_size: int | None, streams: Streams) -> SessionSource:
    """The `closed_loop` kind (`vllm bench serve --max-concurrency`): one-turn sessions of fixed
    lengths, `concurrency` at a time."""
    fields.reject_unknown(CLOSED_LOOP_FIELDS)
    concurrency = fields.integer("concurrency", minimum=1)
    num_requests = fields.integer("num_requests", minimum=1)
    input_len = fields.integer("input_len", minimum=1)
    output_len = fields.integer("output_len", minimum=1)
    think_times = ([0.0] * num_requests if fields.get("think_time_s", None) is None
                   else parse_time_distribution(fields.section("think_time_s")).sample(
                       num_requests, streams.think).tolist())
    n, token_spec = parse_common(fields, vocab_size)
    token_ids = (sample_prompt_token_ids(np.full(num_requests, input_len), *token_spec,
                                         streams.token)
                 if token_spec is not None else [None] * num_requests)
    sessions = [[Request(request_id=-1, arrival_time=math.nan, prompt_len=input_len,
                         output_len=output_len, n=n, prompt_token_ids=ids, session_id=session,
                         turn=0)]
                for session, ids in enumerate(token_ids)]
    return SessionSource(sessions, [[gap] for gap in think_times], concurrency=concurrency)


def _population(fields: Fields) -> tuple[int, float, int | None]:
    """num_sessions, rate (session starts/s) and concurrency (None: sessions start at `rate`)."""
    num_sessions = fields.integer("num_sessions", minimum=1)
    rate = fields.rate("rate")
    concurrency = fields.integer("concurrency", default=None, minimum=1)
    return num_sessions, rate, concurrency


def _source(fields: Fields, turns: SessionTurns, n: int, token_spec, streams: Streams,
            num_sessions: int, rate: float, concurrency: int | None,
            first_len: str, marks_final_turns: bool = False) -> SessionSource:
    """The SessionSource of the kept turns; `marks_final_turns` (agents), since an agent's
    framework knows its final call where a chat user's last message is not known as such."""
    if not len(turns.prompt_lens):
        raise no_request_left(fields, fields.get("max_prompt_len", None), first_len)
    # Drawn even under concurrency, so the streams after it stay the same either way.
    starts = sample_arrival_times("poisson", rate, 1.0, num_sessions, streams.arrival)
    kept_sessions, session_ids = np.unique(turns.sessions, return_inverse=True)
    token_ids = (session_token_ids(turns, *token_spec, streams.token)
                 if token_spec is not None else [None] * len(turns.prompt_lens))
    sessions: list[list[Request]] = [[] for _ in kept_sessions]
    gaps: list[list[float]] = [[] for _ in kept_sessions]
    for session, turn, prompt_len, output_len, gap, ids in zip(
            session_ids.tolist(), turns.turn_indices.tolist(), turns.prompt_lens.tolist(),
            turns.output_lens.tolist(), turns.think_times.tolist(), token_ids):
        sessions[session].append(Request(
            request_id=-1, arrival_time=math.nan, prompt_len=prompt_len, output_len=output_len,
            n=n, prompt_token_ids=ids, session_id=session, turn=turn))
        gaps[session].append(gap)
    if marks_final_turns:
        for requests in sessions:
            requests[-1].final_turn = True
    if concurrency is not None:
        return SessionSource(sessions, gaps, concurrency=concurrency)
    return SessionSource(sessions, gaps, start_times=starts[kept_sessions].tolist())
