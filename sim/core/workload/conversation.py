"""The `conversation` workload kind: multi-turn chats whose every prompt is the whole conversation
so far, so later turns start with the earlier turns' exact ids and the prefix cache can serve
them."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.core.workload.distributions import (
    LengthDistribution, TimeDistribution, parse_length_distribution, parse_time_distribution,
    sample_arrival_times)
from sim.core.workload.fields import Fields, RequestArrays, Streams, parse_common

CONVERSATION_FIELDS = ("kind", "num_sessions", "rate", "turns", "think_time_s", "message_len",
                       "output_len", "max_prompt_len", "n", "with_token_ids", "shared_prefix_len",
                       "timeout_s")


def prompt_settings(fields: Fields, vocab_size: int | None):
    """max_prompt_len, n, the token-id spec and shared_prefix_len, checked together."""
    max_prompt_len = fields.integer("max_prompt_len", default=None, minimum=1)
    # Prefix caching needs ids, so sessions have them unless told otherwise.
    n, token_spec = parse_common(fields, vocab_size, with_token_ids_default=True)
    shared_prefix_len = fields.integer("shared_prefix_len", default=0, minimum=0)
    if max_prompt_len is not None and shared_prefix_len >= max_prompt_len:
        raise ValueError(f"{fields.name('max_prompt_len')} must be > "
                         f"{fields.name('shared_prefix_len')}, got {max_prompt_len} <= "
                         f"{shared_prefix_len}")
    return max_prompt_len, n, token_spec, shared_prefix_len


def no_request_left(fields: Fields, max_prompt_len: int | None, first_len: str) -> ValueError:
    """The error for a max_prompt_len that cuts every session before its first turn."""
    return ValueError(f"{fields.name('max_prompt_len')}={max_prompt_len} leaves no request: "
                      f"every session's first prompt ({fields.name('shared_prefix_len')} + a "
                      f"{fields.name(first_len)}) is longer")


def sample_conversation(fields: Fields, vocab_size: int | None,
                        streams: Streams) -> RequestArrays:
    """The conversation kind's requests, on the synthetic kind's streams plus two of its own."""
    fields.reject_unknown(CONVERSATION_FIELDS)
    num_sessions = fields.integer("num_sessions", minimum=1)
    rate = fields.rate("rate")
    turns_dist = parse_length_distribution(fields.section("turns"))
    think_dist = parse_time_distribution(fields.section("think_time_s"))
    message_dist = parse_length_distribution(fields.section("message_len"))
    output_dist = parse_length_distribution(fields.section("output_len"))
    max_prompt_len, n, token_spec, shared_prefix_len = prompt_settings(fields, vocab_size)
    drawn = draw_session_turns(
        num_sessions, turns_dist, think_dist, message_dist, output_dist,
        turns_rng=streams.turns, think_rng=streams.think, message_rng=streams.prompt,
        output_rng=streams.output)
    session_starts = sample_arrival_times("poisson", rate, 1.0, num_sessions, streams.arrival)
    turns = lay_out_sessions(*drawn, shared_prefix_len, max_prompt_len,
                             session_starts=session_starts).by_arrival()
    if not len(turns.arrival_times):
        raise no_request_left(fields, max_prompt_len, "message_len")
    token_ids = (session_token_ids(turns, *token_spec, streams.token)
                 if token_spec is not None else None)
    return RequestArrays(turns.arrival_times, turns.prompt_lens, turns.output_lens, n,
                         token_spec, token_ids=token_ids,
                         metadata={"session_id": turns.sessions.tolist(),
                                   "turn": turns.turn_indices.tolist()})


@dataclass(frozen=True)
class SessionTurns:
    """Every kept turn of a multi-turn workload as parallel arrays, session-major or by arrival;
    the last turn has a think time too, since a closed loop may start a session after it."""

    arrival_times: np.ndarray   # open loop: the session's start plus its earlier think times
    prompt_lens: np.ndarray
    output_lens: np.ndarray
    message_lens: np.ndarray
    think_times: np.ndarray
    sessions: np.ndarray
    turn_indices: np.ndarray  # 0 for a session's first turn

    def by_arrival(self) -> SessionTurns:
        """The turns sorted by arrival, ties to the lower session, then the earlier turn."""
        order = np.lexsort((self.turn_indices, self.sessions, self.arrival_times))
        return SessionTurns(*(values[order] for values in (
            self.arrival_times, self.prompt_lens, self.output_lens, self.message_lens,
            self.think_times, self.sessions, self.turn_indices)))


def _segment_exclusive_cumsum(values: np.ndarray, starts: np.ndarray,
                              lengths: np.ndarray) -> np.ndarray:
    """For consecutive segments (session-major turns), the sum of each value's predecessors
    within its own segment."""
    inclusive = np.cumsum(values)
    before_segment = np.repeat(inclusive[starts] - values[starts], lengths)
    return inclusive - values - before_segment


def draw_session_turns(num_sessions: int, turns_dist: LengthDistribution,
                       think_dist: TimeDistribution, message_dist: LengthDistribution,
                       output_dist: LengthDistribution, *, turns_rng: np.random.Generator,
                       think_rng: np.random.Generator, message_rng: np.random.Generator,
                       output_rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """Each session's number of turns, then per turn (session-major) its think time after,
    message length and output length, each from its own stream."""
    turns = turns_dist.sample(num_sessions, turns_rng)
    num_turns = int(turns.sum())
    return (turns, think_dist.sample(num_turns, think_rng),
            message_dist.sample(num_turns, message_rng),
            output_dist.sample(num_turns, output_rng))


def lay_out_sessions(turns: np.ndarray, think_times: np.ndarray, message_lens: np.ndarray,
                     output_lens: np.ndarray, shared_prefix_len: int, max_prompt_len: int | None,
                     session_starts: np.ndarray | None = None) -> SessionTurns:
    """The sessions' turns, session-major, prompt_len(k+1) = prompt_len(k) + output_len(k) +
    message_len(k+1); arrival times nan unless `session_starts` (open loop), and a session cut
    before its first prompt past max_prompt_len."""
    num_sessions, num_turns = len(turns), int(turns.sum())

    starts = np.cumsum(turns) - turns
    sessions = np.repeat(np.arange(num_sessions), turns)
    turn_indices = np.arange(num_turns) - np.repeat(starts, turns)
    arrival_times = (np.full(num_turns, np.nan) if session_starts is None
                     else session_starts[sessions]
                     + _segment_exclusive_cumsum(think_times, starts, turns))
    prompt_lens = (shared_prefix_len + message_lens
                   + _segment_exclusive_cumsum(message_lens + output_lens, starts, turns))
    kept = (np.ones(num_turns, dtype=bool) if max_prompt_len is None
            else prompt_lens <= max_prompt_len)
    return SessionTurns(arrival_times[kept], prompt_lens[kept], output_lens[kept],
                        message_lens[kept], think_times[kept], sessions[kept],
                        turn_indices[kept])


def session_token_ids(turns: SessionTurns, vocab_size: int, shared_prefix_len: int,
                            rng: np.random.Generator) -> list[list[int]]:
    """Each turn's prompt ids: the previous prompt, random ids standing for its answer, then the
    new message. The stand-in answer, not what the run generates, keeps both backends' prefix
    cache hits alike."""
    prefix = rng.integers(0, vocab_size, shared_prefix_len).tolist()

    message_rng, answer_rng = rng.spawn(2)
    message_ids = message_rng.integers(0, vocab_size, int(turns.message_lens.sum())).tolist()
    answer_ids = answer_rng.integers(0, vocab_size, int(turns.output_lens.sum())).tolist()
    contexts: dict[int, list[int]] = {}  # session -> its last prompt and stand-in answer
    token_ids = []
    message_start = answer_start = 0
    for session, message_len, output_len in zip(turns.sessions.tolist(),
                                                 turns.message_lens.tolist(),
                                                 turns.output_lens.tolist()):
        # Turns of a session arrive in turn order, so its context is the previous turn's.
        prompt = contexts.get(session, prefix) + message_ids[message_start:message_start
                                                             + message_len]
        message_start += message_len
        token_ids.append(prompt)
        contexts[session] = prompt + answer_ids[answer_start:answer_start + output_len]
        answer_start += output_len
    return token_ids
