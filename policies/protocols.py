"""The contract a plug-in satisfies: every member the step loop, the simulator, the engine and
the tools use on a policy. Any class with these members is a policy; `BaseScheduler` is a
convenience. Pure Python: no torch, no simpy. docs/policies.md explains the contract, its checks
and the disaggregation members (`take_handoffs`, `admit_transfer`, `finish_transfer`).

The step loop, as both backends run it:

    plan = scheduler.schedule(now)             # an empty plan with requests outstanding stalls
    result = executor.execute(plan)            # simulated or real; result.duration passes
    finished = scheduler.update(plan, result, now)
"""
from __future__ import annotations

from typing import Iterable, Literal, Mapping, Protocol, Sequence as Seq, runtime_checkable

from policies.types import Request, Sequence, StepPlan, StepResult


@runtime_checkable
class KVCacheManager(Protocol):
    """Counts, shares and moves KV blocks. Physical block ids index the engine's real KV tensors;
    the simulator keeps the same tables without tensors."""

    block_size: int                       # tokens per block
    num_blocks: int                       # device blocks: sizes the engine's KV tensors
    num_host_blocks: int                  # host blocks for swapped-out sequences
    block_tables: dict[int, list[int]]    # seq_id -> physical block ids, read by the executor

    def num_free_blocks(self) -> int:
        """Device blocks a sequence could still be given (free or evictable)."""
    def num_used_blocks(self) -> int:
        """Device blocks held by sequences (a step row's `kv_blocks_used`)."""
    def num_slots_allocated(self) -> int:
        """Token slots of the used blocks (a step row's `kv_slots_allocated`)."""
    def num_tokens_stored(self) -> int:
        """Tokens those slots hold (a step row's `kv_tokens_stored`; the gap is waste)."""
    def can_ever_fit(self, num_tokens: int, num_seqs: int = 1) -> bool:
        """Whether `num_seqs` sequences of `num_tokens` could be admitted into the empty pool."""
    def allocate_prefix(self, seq: Sequence) -> int:
        """Point a new sequence at its cached prefix's blocks; returns the tokens they hold."""
    def num_cached_prefix_tokens(self, token_ids: Seq[int]) -> int:
        """Prompt tokens allocate_prefix would serve from the cache (any tier), changing nothing."""
    def allocate_slots(self, seq: Sequence, num_tokens: int, *, watermark: bool = False) -> bool:
        """Make the sequence's table cover positions [0, num_tokens); False changes nothing."""
    def append_slots(self, seqs: list[Sequence], start: int = 0) -> int:
        """allocate_slots(seq, seq.num_tokens) for seqs[start:] in order; returns the index of
        the first that failed (len(seqs) when none did)."""
    def trim_slots(self, seq: Sequence, num_tokens: int) -> None:
        """Shrink the sequence's table to at most [0, num_tokens) (rejected drafts' slots)."""
    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """Give `child` the parent's blocks (shared or copied); False if the pool cannot."""
    def free(self, seq: Sequence) -> None:
        """Release every device and host block the sequence holds."""
    def can_swap_out(self, seqs: Seq[Sequence]) -> bool:
        """Whether the host pool can take these sequences' blocks."""
    def swap_out(self, seqs: Seq[Sequence]) -> list[tuple[int, int]]:
        """Move their blocks to the host pool; returns the (device, host) block pairs."""
    def can_swap_in(self, seqs: Seq[Sequence]) -> bool:
        """Whether the device pool can take these swapped sequences back."""
    def swap_in(self, seqs: Seq[Sequence]) -> list[tuple[int, int]]:
        """Move their blocks back to the device; returns the (host, device) block pairs."""
    def take_pending_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) block copies decided since the last call (copy-on-write)."""


@runtime_checkable
class LoRAManager(Protocol):
    """Which LoRA adapters sit in a replica's device slots; a step's batch holds at most
    `max_loras` distinct adapters (vLLM's rule). docs/lora.md says how a scheduler uses it."""

    max_loras: int                    # device adapter slots: sizes the engine's adapter buffers
    ranks: Seq[int]                   # rank of adapter i (Request.lora_id i)
    batch_loras: set[int]             # the adapters the batch holds now (what `fits` reads)

    def track(self, requests: Iterable[Request]) -> None:
        """The batch's adapters are those of `requests` (the running ones)."""
    def fits(self, lora_id: int | None) -> bool:
        """Whether a request of adapter `lora_id` (None: the base model) may join the batch."""
    def admitted(self, lora_id: int | None) -> None:
        """A request of adapter `lora_id` joined the batch."""
    def is_loaded(self, lora_id: int) -> bool:
        """Whether the adapter is in a device slot now (no load before its next step)."""
    def finish_step(self, plan: StepPlan, running: Iterable[Request]) -> None:
        """Load the adapters the plan's sequences need into slots and set `plan.lora` (a StepLoRA)."""
    def summary(self) -> dict:
        """The run summary's LoRA counts (adapter loads, host-pool misses, ...)."""


@runtime_checkable
class PreemptionPolicy(Protocol):
    """Which running request gives up its memory, and how."""

    swap_space_gb: float  # host memory for swapped-out KV blocks: sizes the KV manager's host pool

    def select_victim(self, running: Seq[Request]) -> Request:
        """The request among `running` to preempt."""
    def mode(self, request: Request, kv_cache: KVCacheManager) -> Literal["recompute", "swap"]:
        """Whether the victim's blocks are freed (recomputed later) or swapped to the host."""


@runtime_checkable
class SpeculationPolicy(Protocol):
    """How many draft tokens each decode proposes and verifies per step (speculative decoding)."""

    max_num_speculative_tokens: int  # upper bound on k: sizes the drafter and the lookahead

    def num_speculative_tokens(self, num_decodes: int) -> int:
        """k for this step's `num_decodes` decoding sequences (0 = no speculation)."""
    def observe(self, proposed: list[int], accepted: list[int]) -> None:
        """After each step: per speculating sequence, drafts proposed and drafts accepted."""


@runtime_checkable
class Scheduler(Protocol):
    """Moves requests between its queues and writes one StepPlan per step. Its constructor's
    arguments, `block_tables` on every plan and the times `update` stamps are in
    docs/policies.md (The contract)."""

    kv_cache: KVCacheManager                  # the engine sizes its KV tensors from it
    speculation: SpeculationPolicy | None     # the engine sizes its drafter from it; None: never drafts

    def add_request(self, request: Request, now: float) -> None:
        """Queue a new request, or set its `rejected_reason` if it can never run."""
    def schedule(self, now: float) -> StepPlan:
        """The next step's plan; it is empty only if nothing can progress (a stall)."""
    def update(self, plan: StepPlan, result: StepResult, now: float) -> list[Request]:
        """Account for the executed plan at time `now`; returns the requests that finished."""
    def has_unfinished(self) -> bool:
        """Whether any request is still waiting, running or swapped out."""
    @property
    def num_outstanding(self) -> int:
        """Unfinished requests (what a router balances)."""
    def queue_lengths(self) -> tuple[int, int, int]:
        """(waiting, running, swapped) requests: a step row's queue columns and the stall error."""


@runtime_checkable
class AbortingScheduler(Protocol):
    """A scheduler that drops a request whose client gave up (`timeout_s`) or went away; the step
    loop calls it between steps."""

    def abort(self, request: Request, now: float) -> None:
        """Dequeue unfinished `request`, free its blocks and stamp `abandoned_time` (not `finish_time`)."""


@runtime_checkable
class KVRetentionPolicy(Protocol):
    """What happens to a session's KV blocks between its turns (conf/kv_retention: evict, pin,
    offload); a scheduler is given one only when `keeps_blocks`."""

    keeps_blocks: bool   # False: finished turns are freed as any request's (evict); never called

    def turn_finished(self, seq: Sequence, now: float) -> None:
        """`seq` finished at `now`: free its blocks, or keep them for the session's next turn."""
    def turn_arrived(self, request: Request, now: float) -> None:
        """`request` joined the scheduler's queue at `now`: its session is no longer idle."""
    def turn_admitted(self, request: Request, now: float) -> None:
        """`request` was first admitted at `now`: what was kept for its session may go."""
    def expire(self, now: float) -> None:
        """Release what was kept until a time at or before `now`."""
    def holds_for(self, request: Request) -> bool:
        """Whether blocks are kept for `request`'s session, so it may pass a head that cannot fit."""
    def release_oldest(self, now: float, idle_only: bool = False) -> bool:
        """Release the longest-kept session's blocks early (`idle_only`: only a session whose next
        turn has not arrived); False when none."""
    def held_blocks_log(self) -> list[tuple[float, int]]:
        """(time, change) of the device blocks held for idle sessions, in the order changed."""


@runtime_checkable
class LengthPredictor(Protocol):
    """Guesses a request's output length on arrival, before routing (`request.predicted_output_len`)."""

    def predict(self, request: Request) -> int | None:
        """The predicted output length (tokens per sequence, positive), or None for none."""


@runtime_checkable
class OnlineLengthPredictor(Protocol):
    """A length predictor that the step loop asks again after every step as tokens come out."""

    def update(self, request: Request, num_output_tokens: int) -> int | None:
        """The refined prediction of `request`, `num_output_tokens` per sequence served."""


@runtime_checkable
class Executor(Protocol):
    """Runs a step: the simulator predicts its duration, the engine runs and times it."""

    def execute(self, plan: StepPlan) -> StepResult:
        """Carry out the plan's memory operations and forward pass; returns duration (and tokens)."""


class ReplicaView(Protocol):
    """What a router sees of a replica (also `pool` and `role` for a router that wants them)."""

    replica_id: int

    @property
    def num_outstanding(self) -> int:
        """The replica's unfinished requests."""
    @property
    def kv_cache(self) -> KVCacheManager:
        """The replica's KV manager, to read (num_cached_prefix_tokens), never to change."""


@runtime_checkable
class LoRAReplicaView(ReplicaView, Protocol):
    """A replica view a LoRA-aware router reads (the simulator's Replica is one)."""

    lora: LoRAManager | None   # its LoRA manager, to read (batch_loras, is_loaded); None: off


@runtime_checkable
class Router(Protocol):
    """Which replica of a cluster gets a new request."""

    def route(self, request: Request, replicas: Seq[ReplicaView]) -> int:
        """The `replica_id` of the replica that takes `request`."""


@runtime_checkable
class DisaggregationPolicy(Protocol):
    """Whether a request runs disaggregated (prefill and decode pools, a KV transfer between) or
    colocated; asked once per request at arrival."""

    def disaggregate(self, request: Request, pools: Mapping[str, Seq[ReplicaView]]) -> bool:
        """True to disaggregate; `pools` maps each pool's role to its replicas."""


class PrefillPoolScheduler(Protocol):
    """A scheduler of a prefill pool (docs/policies.md, disaggregation)."""

    def take_handoffs(self) -> list[Request]:
        """The requests stopped after their first token since the last call, blocks kept."""


class DecodePoolScheduler(Protocol):
    """A scheduler of a decode pool (docs/policies.md, disaggregation)."""

    def admit_transfer(self, request: Request, now: float) -> bool:
        """A sequence and blocks for KV computed elsewhere; False: no room now."""
    def finish_transfer(self, request: Request, now: float) -> None:
        """The KV has arrived: the request decodes from the next step."""


@runtime_checkable
class CostModel(Protocol):
    """How long a simulated step takes (conf/cost_model: any `_target_` class with `step_time`);
    its constructor's arguments and optional capabilities are in docs/cost-models.md."""

    def step_time(self, plan: StepPlan) -> float:
        """Seconds the step `plan` takes."""


@runtime_checkable
class StatesExpectedError(Protocol):
    """A cost model that states the expected error of a run's latencies (the GPU cost model)."""

    # {"ttft", "tpot", "e2e": percent, "checks": how many, "basis": their kind}; None: none
    expected_error_pct: dict | None


@runtime_checkable
class StepWorkCostModel(Protocol):
    """A cost model that says the work of the steps it costs, what the energy meter charges power
    for (the roofline and GPU cost models; without it, the work of the model's shape)."""

    def step_work(self, plan: StepPlan) -> tuple[float, float]:
        """(FLOPs, device-memory bytes) of the step `plan` on one GPU."""


@runtime_checkable
class DecodeWorkCostModel(Protocol):
    """A StepWorkCostModel whose decode-only steps' work is linear, so a run of decode steps is
    charged without a call a step."""

    def decode_work_terms(self) -> tuple[float, float, float, float] | None:
        """(a, b, c, d): n decodes over t context tokens do n·a + t·b FLOPs and move c + (t + n)·d
        bytes, as step_work sums them; None where its work is not of that form."""


@runtime_checkable
class ReportsSpeed(Protocol):
    """An executor whose durations are normalised to a profile's machine speed; the summary adds
    what its speed probes saw."""

    def speed_summary(self) -> dict:
        """The summary's speed_factor_* and speed_probe* keys."""


@runtime_checkable
class BoundedScheduler(Protocol):
    """A scheduler that says how many sequences a step runs at most (sizes the CUDA graphs)."""

    max_num_seqs: int
