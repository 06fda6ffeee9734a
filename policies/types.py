"""The objects every policy and every executor share: requests, sequences, step plans, results.

A request asks for `n` samples of `output_len` tokens after a prompt of `prompt_len` tokens. Each
sample is a `Sequence`. What a sequence still needs computed is `num_tokens - num_computed_tokens`:
a whole prompt before its first step, a chunk of it under chunked prefill, one token while decoding,
prompt + outputs again after a recompute preemption. Prefill and decode are the same thing.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class Sequence:
    """One sample of a request. Plain attributes, no properties: the scheduler touches these in
    its hot loop once per sequence per step."""

    __slots__ = (
        "seq_id", "request", "num_tokens", "num_computed_tokens", "num_output_tokens",
        "output_token_ids", "status", "last_token_time", "draft_lag", "starts_run",
    )

    def __init__(self, seq_id: int, request: "Request", num_output_tokens: int = 0,
                 output_token_ids: list[int] | None = None):
        self.seq_id = seq_id
        self.request = request
        self.num_output_tokens = num_output_tokens
        self.num_tokens = request.prompt_len + num_output_tokens
        self.num_computed_tokens = 0
        # Token ids are kept only for requests that have them (the engine's); the simulator
        # counts tokens and never stores one per token.
        if output_token_ids is None and request.prompt_token_ids is not None:
            output_token_ids = []
        self.output_token_ids = output_token_ids
        self.status = SequenceStatus.WAITING
        self.last_token_time = 0.0
        # Speculative decoding, as the sequence's steps left it (set by the scheduler's update,
        # read by both backends). draft_lag: tokens whose K/V the target computed and a draft
        # model did not (1 after a step that accepted all k drafts: the draft model never ran
        # its own last draft), which its next pass runs again. starts_run: its next speculating
        # step starts a run of acceptable drafts (its first one, or the one after a rejection:
        # a "fresh" step in the acceptance statistics, where the simulator draws a new run).
        self.draft_lag = 0
        self.starts_run = True

    def advance(self, num_computed: int, num_sampled: int, now: float,
                token_ids: list[int] | None = None) -> None:
        """`num_computed` more of its tokens were computed, then `num_sampled` new tokens
        (`token_ids`, where the run keeps ids) were appended at `now`; none for a prefill chunk
        short of the prompt's end."""
        self.num_computed_tokens += num_computed
        if num_sampled:
            self.num_tokens += num_sampled
            self.num_output_tokens += num_sampled
            self.last_token_time = now
            if token_ids is not None:
                self.output_token_ids.extend(token_ids)

    @staticmethod
    def advance_decodes(seqs: list[Sequence], num_steps: int, now: float) -> None:
        """`advance(num_steps, num_steps, now)` for each of `seqs`, decodes that gained a token
        at each of `num_steps` steps without ids, in one pass (the simulator's hot loop)."""
        for seq in seqs:
            seq.num_computed_tokens += num_steps
            seq.num_tokens += num_steps
            seq.num_output_tokens += num_steps
            seq.last_token_time = now

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_ids(self) -> list[int] | None:
        """Prompt + output token ids, or None when the run does not track ids."""
        if self.request.prompt_token_ids is None:
            return None
        return list(self.request.prompt_token_ids) + list(self.output_token_ids or ())

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request.request_id}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"{self.status.value})")


@dataclass(eq=False, slots=True)
class Request:
    """A request and its bookkeeping. `output_len` is max_tokens: the simulator generates exactly
    that many tokens per sample (a trace replays its recorded lengths); the engine may stop early
    at EOS."""

    request_id: int
    arrival_time: float
    prompt_len: int
    output_len: int
    n: int = 1
    prompt_token_ids: list[int] | None = None
    # Opaque to the policies: the engine keeps its SamplingParams here.
    sampling_params: object = None
    # What a policy may schedule by: lower priority runs first (vLLM's convention), the client
    # it is served for, its own latency SLOs (None: the run's slo.*), and its output length as a
    # length predictor guessed it at arrival (None: no predictor).
    priority: int = 0
    tenant: str = "default"
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    predicted_output_len: int | None = None
    # The session (a chat, an agent's model calls, a trace's session column) and this request's
    # turn in it, from 0; None: a request of its own. Closed-loop workloads (workload=sessions,
    # agent) send turn k+1 after turn k finished.
    session_id: int | str | None = None
    turn: int = 0
    # The session ends with this request's answer (an agent's final answer, not a tool call:
    # its framework knows once the answer is out), so a KV retention policy keeps nothing for it.
    final_turn: bool = False
    # The LoRA adapter the request runs with: an index into the run's adapters (0 .. N-1);
    # None: the base model alone.
    lora_id: int | None = None
    # Seconds after its arrival at which its client gives up (None: never): both backends abort
    # it at the first step boundary at or after its `deadline`, waiting or running.
    timeout_s: float | None = None

    sequences: list[Sequence] = field(default_factory=list)
    replica_id: int = -1
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0   # prompt tokens the prefix cache served at its first admission
    num_host_cached_tokens: int = 0   # of those, the ones loaded back from the host tier
    rejected_reason: str | None = None
    # When it was aborted unfinished (its deadline passed, or the engine's client went away);
    # it then has no finish_time and counts as abandoned, not completed.
    abandoned_time: float | None = None
    # Prefill/decode disaggregation (sim/core/cluster.py), set by the cluster. `handoff`: its
    # scheduler stops the request after its first token and keeps its blocks for the KV transfer
    # (Scheduler.take_handoffs); the decode replica is then `replica_id`. The times: hand-off
    # (the prefill's end), the copy's start on the links and its landing on the decode replica.
    handoff: bool = False
    prefill_replica_id: int | None = None
    kv_handoff_time: float | None = None
    kv_transfer_start_time: float | None = None
    kv_transfer_end_time: float | None = None
    kv_transfer_bytes: int = 0

    def __post_init__(self):
        if self.prompt_token_ids is not None and len(self.prompt_token_ids) != self.prompt_len:
            raise ValueError(f"request {self.request_id}: prompt_len={self.prompt_len} but "
                             f"{len(self.prompt_token_ids)} prompt_token_ids")

    @property
    def is_finished(self) -> bool:
        return (self.finish_time is not None or self.rejected_reason is not None
                or self.abandoned_time is not None)

    @property
    def deadline(self) -> float | None:
        """When its client gives up (arrival_time + timeout_s, on the arrival clock); None:
        never."""
        return None if self.timeout_s is None else self.arrival_time + self.timeout_s

    @property
    def num_output_tokens(self) -> int:
        return sum(seq.num_output_tokens for seq in self.sequences)

    @property
    def num_output_tokens_per_sample(self) -> int:
        """Output tokens of its longest sample: how far along the request is (what TPOT divides
        by, as vllm does)."""
        return max((seq.num_output_tokens for seq in self.sequences), default=0)

    def unfinished_sequences(self) -> list[Sequence]:
        sequences = self.sequences
        if len(sequences) == 1:   # (n=1, nearly every request: no comprehension)
            return [] if sequences[0].status is SequenceStatus.FINISHED else [sequences[0]]
        return [seq for seq in sequences if seq.status is not SequenceStatus.FINISHED]


# The Request fields a client may send a serving engine for its scheduler plug-in, and their types
# (through vLLM's `vllm_xargs`: sim/tools/bench_client.py sends them, vllm_adapter/ reads them).
CLIENT_SCHEDULING_FIELDS: dict[str, type] = {
    "priority": int, "tenant": str, "slo_ttft_ms": float, "slo_tpot_ms": float,
    "predicted_output_len": int, "session_id": str, "turn": int, "final_turn": bool,
    "lora_id": int}


@dataclass(slots=True)
class StepLoRA:
    """A step's adapters: each sequence runs adapter `seq.request.lora_id` (None: none)."""

    # Executor's input: (adapter id, device slot) pairs copied host -> device before the forward
    # pass, and adapter id -> its device slot (a live view into the LoRA manager).
    to_load: tuple[tuple[int, int], ...] = ()
    slots: dict[int, int] | None = None
    # Cost features.
    num_adapters: int = 0               # distinct adapters among the step's sequences
    rank_sum: int = 0                   # sum of their ranks (adapter weights read once each)
    token_rank_sum: int = 0             # sum over sequences of tokens computed x its rank
    load_rank_sum: int = 0              # sum of the ranks of the adapters in to_load


@dataclass(slots=True)
class StepPlan:
    """Everything an executor needs for one step and nothing it must decide, in four parts:

    - the work: `seqs[i]` computes `num_new_tokens[i]` tokens starting at position
      `seqs[i].num_computed_tokens` (its KV slots already allocated in `block_tables`); a sequence
      whose step reaches its last token samples one new token. A decode in `spec_lens`
      (seq_id -> k >= 1) also proposes k draft tokens and verifies them in the same forward pass;
      its slots cover positions [0, num_tokens + k).
    - the memory operations the policies decided, carried out before the forward pass in the
      order: swap out, offload, load, swap in, copy; and the requests preempted.
    - the cost features: sums over the work, kept while scheduling so that no cost model, meter
      or recorder loops over sequences; an executor never needs them to run the step.
    - `lora`: the step's adapters (their loads, slots and cost features), None without LoRA.
    """

    # The work.
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    # seq_id -> physical block ids; a live view into the KV manager, not a copy.
    block_tables: dict[int, list[int]] = field(default_factory=dict)
    # seq_id -> k draft tokens of a speculating decode; empty when speculation is off.
    spec_lens: dict[int, int] = field(default_factory=dict)
    # Memory operations, as (source block, destination block) pairs.
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)   # (host, device)
    # The prefix cache's host tier (kv_cache.offload_gb), in its own host id space: evicted
    # cached blocks stored there, and host hits loaded back before the forward pass.
    blocks_to_offload: list[tuple[int, int]] = field(default_factory=list)   # (device, tier)
    blocks_to_load: list[tuple[int, int]] = field(default_factory=list)      # (tier, device)
    preempted_recompute: list[Request] = field(default_factory=list)
    preempted_swap: list[Request] = field(default_factory=list)
    # Cost features (_STEP_FEATURES), summed by `add`, `add_decodes` and `add_drafts`.
    num_prefill_tokens: int = 0          # tokens of sequences not yet at their last token
    num_prefill_seqs: int = 0
    prefill_attention_work: int = 0     # sum over prefill chunks of chunk_len * context_len_after
    prefill_context_tokens: int = 0     # sum over prefill chunks of context read (cached + chunk)
    sum_squared_prefill_chunks: int = 0
    num_decode_seqs: int = 0            # sequences computing exactly their last token
    decode_context_tokens: int = 0      # sum over decode sequences of context length read
    num_draft_tokens: int = 0           # sum of spec_lens: draft tokens verified this step
    max_draft_len: int = 0              # max of spec_lens: sequential steps of a draft model
    draft_catch_up_tokens: int = 0      # sum of the sequences' draft_lag (within their context)
    # Multi-LoRA (conf/lora), set by the scheduler's LoRA manager at the end of planning.
    lora: StepLoRA | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def num_batched_tokens(self) -> int:
        """Tokens the forward pass computes: prefill chunks, decodes and their drafts."""
        return self.num_prefill_tokens + self.num_decode_seqs + self.num_draft_tokens

    @property
    def is_empty(self) -> bool:
        """Nothing to run and nothing changed: a scheduler that returns this is stuck. (A step
        that only preempted is not empty: the next one can use the memory it freed.)"""
        return not (self.seqs or self.blocks_to_swap_out or self.blocks_to_swap_in
                    or self.preempted_recompute or self.blocks_to_offload or self.blocks_to_load)

    def remove_request(self, request: Request) -> None:
        """Take a request's sequences back out of the plan and recompute the features. Rare:
        some samples of a request were scheduled before another ran out of memory."""
        kept = [(seq, num_new) for seq, num_new in zip(self.seqs, self.num_new_tokens)
                if seq.request is not request]
        kept_spec_lens = {seq.seq_id: self.spec_lens[seq.seq_id] for seq, _ in kept
                          if seq.seq_id in self.spec_lens}
        self.seqs, self.num_new_tokens, self.spec_lens = [], [], {}
        for feature in _STEP_FEATURES:
            setattr(self, feature, 0)
        for seq, num_new in kept:
            self.add(seq, num_new)
        self.add_drafts(kept_spec_lens)

    def add_decodes(self, seqs: list[Sequence], *, drafted: bool = True,
                    context_tokens: int | None = None) -> None:
        """Schedule one token for each of `seqs`, every one at its last token with outputs
        already (a decode). One call per step instead of one per sequence. `drafted=False`
        says none of them has a draft lag (no speculation ran), so it is not summed;
        `context_tokens`, their summed num_tokens where the caller knows it."""
        self.seqs.extend(seqs)
        self.num_new_tokens.extend([1] * len(seqs))
        self.num_decode_seqs += len(seqs)
        self.decode_context_tokens += (sum([seq.num_tokens for seq in seqs])
                                       if context_tokens is None else context_tokens)
        if drafted:
            self.draft_catch_up_tokens += sum([seq.draft_lag for seq in seqs])

    def add_drafts(self, spec_lens: dict[int, int]) -> None:
        """Let decodes already in the plan speculate: seq_id -> k >= 1 draft tokens each."""
        if not spec_lens:
            return
        self.spec_lens.update(spec_lens)
        self.num_draft_tokens += sum(spec_lens.values())
        self.max_draft_len = max(self.max_draft_len, max(spec_lens.values()))

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        """Schedule `num_new_tokens` of `seq` and account for them in the step features."""
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)
        start = seq.num_computed_tokens
        end = start + num_new_tokens
        if seq.draft_lag:
            self.draft_catch_up_tokens += min(seq.draft_lag, start)
        if num_new_tokens == 1 and end == seq.num_tokens and seq.num_output_tokens > 0:
            self.num_decode_seqs += 1
            self.decode_context_tokens += end
        else:
            self.num_prefill_tokens += num_new_tokens
            self.num_prefill_seqs += 1
            self.prefill_attention_work += num_new_tokens * end
            self.prefill_context_tokens += end
            self.sum_squared_prefill_chunks += num_new_tokens * num_new_tokens


_STEP_FEATURES = ("num_prefill_tokens", "num_prefill_seqs", "prefill_attention_work",
                  "prefill_context_tokens", "sum_squared_prefill_chunks", "num_decode_seqs",
                  "decode_context_tokens", "num_draft_tokens", "max_draft_len",
                  "draft_catch_up_tokens")


@dataclass(slots=True)
class StepResult:
    """What an executor returns: how long the step took and, from the engine, the token ids.

    `sampled_token_ids` maps seq_id -> the tokens that sequence gained this step (one, or with
    speculative decoding its accepted drafts and one more token). The simulator leaves it None:
    every sequence that reached its last token gains one token, a speculating one
    `num_accepted[seq_id] + 1`.
    """

    duration: float
    sampled_token_ids: dict[int, list[int]] | None = None
    # seq_ids the engine stopped early (EOS or a stop token).
    stopped_seq_ids: set[int] | None = None
    # For a request with n > 1 whose first sequence just finished its prompt: the first tokens of
    # the n - 1 samples forked from it (seq_id of the parent -> n - 1 token ids).
    forked_token_ids: dict[int, list[int]] | None = None
    # For every seq in the plan's spec_lens: how many of its k drafts were accepted (0..k).
    num_accepted: dict[int, int] | None = None
