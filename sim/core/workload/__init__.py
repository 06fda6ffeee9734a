"""Workload generation: the `workload` config group as the requests a run replays, one module per
kind (`synthetic`, `conversation`, `trace`, and the closed-loop kinds in `sessions`).

Each random quantity has its own stream of `default_rng(seed)`, so two runs differing in one knob
see the same draws of everything else (common random numbers).
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from policies.lora.spec import LoRAConfig
from policies.types import Request
from sim.core.workload.conversation import CONVERSATION_FIELDS, sample_conversation
from sim.core.workload.distributions import (
    ARRIVAL_PROCESSES, LENGTH_DISTRIBUTIONS, LENGTH_FIELDS, MAX_ZIPF_SUPPORT, TIME_DISTRIBUTIONS,
    TIME_FIELDS, sample_prompt_token_ids)
from sim.core.workload.fields import (DEFAULT_TENANT, Fields, RequestArrays, Streams,
                                      as_plain_dict)
from sim.core.workload.lora_ids import assign_lora_ids, draw_lora_ids
from sim.core.workload.session_source import SessionSource
from sim.core.workload.sessions import (AGENT_FIELDS, CLOSED_LOOP_FIELDS, SESSIONS_FIELDS,
                                        sample_agent, sample_closed_loop, sample_sessions)
from sim.core.workload.synthetic import (
    CLASS_FIELDS, SHARE_SUM_TOLERANCE, SYNTHETIC_FIELDS, sample_synthetic)
from sim.core.workload.trace import (
    AZURE_COLUMNS, METADATA_COLUMNS, PLAIN_COLUMNS, REPO_ROOT, TOKEN_IDS_COLUMN, TRACE_FIELDS,
    read_trace, resolve_trace_path, sample_trace)

KINDS = ("synthetic", "trace", "conversation")
# Kinds whose arrivals the run decides (each turn after the previous one finished).
CLOSED_LOOP_KINDS = ("sessions", "agent", "closed_loop")
_CLOSED_LOOP_SAMPLERS = {"sessions": sample_sessions, "agent": sample_agent,
                         "closed_loop": sample_closed_loop}
_SAMPLERS = {"synthetic": sample_synthetic, "trace": sample_trace,
             "conversation": sample_conversation}

__all__ = [
    "AGENT_FIELDS", "ARRIVAL_PROCESSES", "AZURE_COLUMNS", "CLASS_FIELDS", "CLOSED_LOOP_FIELDS",
    "CLOSED_LOOP_KINDS",
    "CONVERSATION_FIELDS", "DEFAULT_TENANT", "KINDS", "LENGTH_DISTRIBUTIONS", "LENGTH_FIELDS",
    "MAX_ZIPF_SUPPORT", "METADATA_COLUMNS", "PLAIN_COLUMNS", "REPO_ROOT", "SESSIONS_FIELDS",
    "SHARE_SUM_TOLERANCE", "SYNTHETIC_FIELDS", "TIME_DISTRIBUTIONS", "TIME_FIELDS",
    "TOKEN_IDS_COLUMN", "TRACE_FIELDS", "RequestStream", "SessionSource", "build_session_source",
    "build_workload", "is_closed_loop", "read_trace", "resolve_trace_path", "workload_stream",
]


def build_workload(cfg: Mapping[str, Any], *, seed: int, vocab_size: int | None = None,
                   lora: LoRAConfig | None = None) -> list[Request]:
    """The requests `cfg` describes, arrival-sorted with request_id 0..N-1, each with its LoRA
    adapter when `lora` is on; a bad value raises a ValueError naming its field."""
    return list(workload_stream(cfg, seed=seed, vocab_size=vocab_size, lora=lora))


def workload_stream(cfg: Mapping[str, Any], *, seed: int, vocab_size: int | None = None,
                    lora: LoRAConfig | None = None) -> RequestStream:
    """build_workload's requests drawn now but made as iterated, so a long run never holds them
    all."""
    fields = Fields(as_plain_dict(cfg), "workload")
    if fields.get("kind", None) in CLOSED_LOOP_KINDS:
        raise ValueError(f"workload.kind={fields.get('kind', None)} is closed-loop: its arrivals "
                         f"depend on the run; build it with build_session_source and run it "
                         f"with run_experiment (twinserve)")
    kind = fields.choice("kind", KINDS)
    # Child i is the same however many are spawned, so new streams go last to leave the earlier
    # ones' draws as they were.
    streams = Streams(*np.random.default_rng(seed).spawn(len(Streams._fields)))
    drawn = _SAMPLERS[kind](fields, vocab_size, streams)

    token_ids = drawn.token_ids
    if token_ids is None and drawn.token_spec is not None:
        token_ids = sample_prompt_token_ids(drawn.prompt_lens, *drawn.token_spec, streams.token)
    metadata = {name: values for name, values in drawn.metadata.items()
                if name != "lora_id" or lora is not None}
    if lora is not None:
        num_requests = len(drawn.prompt_lens)
        metadata["lora_id"] = draw_lora_ids(
            metadata.get("lora_id", [None] * num_requests),
            metadata.get("session_id", [None] * num_requests), lora, seed)
    # A trace row's own timeout_s wins over the workload's.
    timeout_s = fields.number("timeout_s", default=None, greater_than=0.0)
    if timeout_s is not None:
        metadata["timeout_s"] = [timeout_s if value is None else value for value in
                                 metadata.get("timeout_s", [None] * len(drawn.prompt_lens))]
    return RequestStream(drawn, token_ids, metadata)


class RequestStream:
    """A workload's requests, each made only when iterating reaches it, since the draws are a few
    bytes a request and a Request a couple of KB."""

    CHUNK = 4096

    def __init__(self, drawn: RequestArrays, token_ids: list | None,
                 metadata: dict[str, list]):
        self.drawn, self.token_ids, self.metadata = drawn, token_ids, metadata

    def __len__(self) -> int:
        return len(self.drawn.prompt_lens)

    def tenants(self) -> set:
        """The requests' tenants."""
        return set(self.metadata.get("tenant", [DEFAULT_TENANT]))

    def has_sessions(self) -> bool:
        """Whether any request belongs to a session (a conversation's turns)."""
        return any(value is not None for value in self.metadata.get("session_id", ()))

    def __iter__(self) -> Iterator[Request]:
        drawn, n, metadata = self.drawn, self.drawn.n, self.metadata
        for start in range(0, len(self), self.CHUNK):
            end = start + self.CHUNK
            # .tolist() converts a chunk in one pass.
            token_ids = (self.token_ids[start:end] if self.token_ids is not None
                         else [None] * len(drawn.prompt_lens[start:end]))
            chunk_metadata = [(name, values[start:end]) for name, values in metadata.items()]
            for offset, (t, p, o, ids) in enumerate(zip(drawn.arrival_times[start:end].tolist(),
                                                        drawn.prompt_lens[start:end].tolist(),
                                                        drawn.output_lens[start:end].tolist(),
                                                        token_ids)):
                request = Request(request_id=start + offset, arrival_time=t, prompt_len=p,
                                  output_len=o, n=n, prompt_token_ids=ids)
                for name, values in chunk_metadata:
                    setattr(request, name, values[offset])
                yield request


def is_closed_loop(cfg: Mapping[str, Any]) -> bool:
    """Whether the `workload` config is of a closed-loop kind (build_session_source's)."""
    return as_plain_dict(cfg).get("kind") in CLOSED_LOOP_KINDS


def build_session_source(cfg: Mapping[str, Any], *, seed: int, vocab_size: int | None = None,
                         lora: LoRAConfig | None = None) -> SessionSource:
    """The sessions a closed-loop `workload` config describes, from build_workload's streams."""
    fields = Fields(as_plain_dict(cfg), "workload")
    kind = fields.choice("kind", CLOSED_LOOP_KINDS)
    streams = Streams(*np.random.default_rng(seed).spawn(len(Streams._fields)))
    source = _CLOSED_LOOP_SAMPLERS[kind](fields, vocab_size, streams)
    assign_lora_ids(source.all_requests(), lora, seed)
    return source
