"""The contract a plug-in satisfies: every method and attribute that the step loop
(`runtime/step.py`), the simulator, the engine and the tools use on a policy. A policy is any
class with these members; the built-in ones in batching/, memory/, preemption/, speculation/ and
routing/ are ordinary examples, and `BaseScheduler` is a convenience, not a requirement.
Pure Python: no torch, no simpy.

The step loop, as both backends run it:

    plan = scheduler.schedule(now)             # an empty plan with requests outstanding stalls
    result = executor.execute(plan)            # simulated or real; result.duration passes
    finished = scheduler.update(plan, result, now)

Every policy is checked against its protocol where it is built (`policies.checks.check_policy`:
one line naming the missing member). Optional capabilities are typed protocols, each had whole or
not at all and asked once where the object is built (`policies.checks.has_capability`): a KV
manager with a host tier for its prefix cache (`OffloadingKVCache`) or a cheap refusal of
admissions that cannot fit (`AdmissionCheckingKVCache`), both in policies/capabilities.py; an
online length predictor, a bounded scheduler, the disaggregation members, a cost model that
states its error and an executor that reports its speed, below; a few the simulator alone
uses, in the modules that use them.

Optional, for prefill/decode disaggregation (a scheduler of a prefill or decode pool; BaseScheduler
has them): on a prefill replica the scheduler stops a request whose `Request.handoff` is set after
its first token, keeping its blocks, and hands it over through `take_handoffs()`; the cluster frees
those blocks (`kv_cache.free`) once the KV has moved. On a decode replica `admit_transfer(request,
now) -> bool` gives the request a sequence of its own and the blocks for the KV computed elsewhere
(False: no room now; `rejected_reason` set: never), and `finish_transfer(request, now)` lets it
decode once the KV has arrived; it is never prefilled there unless preempted by recompute.
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
        """Tokens at the start of a prompt that allocate_prefix would serve from the cache (any
        tier), changing nothing; 0 without a prefix cache. What a prefix-aware router reads."""
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
    """Which LoRA adapters sit in a replica's device slots (multi-LoRA serving, conf/lora), and
    the rule that a step's batch holds at most `max_loras` distinct adapters (vLLM's). A
    scheduler built with `lora=` asks `fits` before admitting a request (or swapping one in),
    tells `admitted`, re-tracks the batch when requests leave it, and hands each finished plan
    to `finish_step`. policies/lora/manager.py's LRULoRAManager is the default."""

    max_loras: int                    # device adapter slots: sizes the engine's adapter buffers
    ranks: Seq[int]                   # rank of adapter i (Request.lora_id i)
    batch_loras: set[int]             # the adapters the batch holds now (what `fits` reads)

    def track(self, requests: Iterable[Request]) -> None:
        """The batch's adapters are those of `requests` (the running ones, at a step's start or
        after one left)."""
    def fits(self, lora_id: int | None) -> bool:
        """Whether a request of adapter `lora_id` (None: the base model) may join the batch."""
    def admitted(self, lora_id: int | None) -> None:
        """A request of adapter `lora_id` joined the batch."""
    def is_loaded(self, lora_id: int) -> bool:
        """Whether the adapter is in a device slot now (no load before its next step)."""
    def finish_step(self, plan: StepPlan, running: Iterable[Request]) -> None:
        """Load the adapters the plan's sequences need into slots (evicting ones no running
        request uses) and set `plan.lora` (a StepLoRA)."""
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
    """Moves requests between its queues and writes one StepPlan per step. Everything it needs
    arrives as arguments; measurement (step rows, inter-token latencies) is the step loop's.

    Built (runtime/assembly.py, for both backends) with the keyword arguments `kv_cache`,
    `preemption`, `max_num_batched_tokens` (resolved: an int), `max_model_len`, `max_num_seqs`
    (the engine's setting, or the scheduler group's own when it has one) and, only when the run
    speculates, `speculation`; the config group's other keys come as they are written.
    Every plan carries `block_tables=kv_cache.block_tables` (the engine reads each scheduled
    sequence's table there; the simulator does not). `update` stamps `request.first_token_time`
    (`now` of the step that gave the request its first output token) and
    `request.finish_time` (`now` of the step that finished it): the run's TTFT, TPOT and
    end-to-end latency are read from them, and a run that ends with no first token stamped
    says so."""

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
    """A scheduler that drops a request before it finishes: its client gave up (a request's
    `timeout_s` passed, in both backends) or went away (the engine's disconnects). Needed by a
    run whose requests carry a `timeout_s`; BaseScheduler has it. The step loop calls it between
    steps; a policy that wants to act on deadlines itself reads `Request.deadline`."""

    def abort(self, request: Request, now: float) -> None:
        """Take unfinished `request` out of its queue at `now` and give back every block it holds
        (as a finish does); stamp `request.abandoned_time`, leaving `finish_time` None."""


@runtime_checkable
class KVRetentionPolicy(Protocol):
    """What happens to a session's KV blocks between its turns (conf/kv_retention: evict, pin,
    offload). Built once per replica with the keyword argument `kv_cache` (the replica's KV
    manager) and the group's own keys. A scheduler that takes `kv_retention` (BaseScheduler
    does) is given it only when `keeps_blocks`; it then hands it every finished turn of a
    session instead of freeing its blocks, tells it when a request is queued and when it is
    first admitted, and lets it release what it holds at the start of every step."""

    keeps_blocks: bool   # False: finished turns are freed as any request's (evict); never called

    def turn_finished(self, seq: Sequence, now: float) -> None:
        """`seq` (its request's only sample) finished at `now`: free its blocks, or keep them
        for the session's next turn; a request without a session is freed as always."""
    def turn_arrived(self, request: Request, now: float) -> None:
        """`request` joined the scheduler's queue at `now`: its session is no longer idle."""
    def turn_admitted(self, request: Request, now: float) -> None:
        """`request` was admitted for the first time at `now` (its prefix cache hit taken):
        what was kept for its session need not be kept any longer."""
    def expire(self, now: float) -> None:
        """Release what was kept until a time at or before `now`."""
    def holds_for(self, request: Request) -> bool:
        """Whether device blocks are kept for waiting `request`'s session: admitting it then
        costs only its new tokens, so the scheduler lets it go ahead of a head that cannot fit."""
    def release_oldest(self, now: float, idle_only: bool = False) -> bool:
        """Release the longest-kept session's blocks early (the scheduler would otherwise plan
        nothing, preempt a running request or keep a session's next turn waiting); with
        `idle_only` only those of a session whose next turn has not arrived. False when none."""
    def held_blocks_log(self) -> list[tuple[float, int]]:
        """(time, change) of the device blocks held for idle sessions, in the order changed."""


@runtime_checkable
class LengthPredictor(Protocol):
    """Guesses a request's output length when it arrives (conf/predictor): the simulator's
    arrivals and the engine's `generate` store it in `request.predicted_output_len`, before
    routing. Optional: OnlineLengthPredictor."""

    def predict(self, request: Request) -> int | None:
        """The predicted output length (tokens per sequence, positive), or None for none."""


@runtime_checkable
class OnlineLengthPredictor(Protocol):
    """A length predictor that learns as tokens come out: the step loop asks it after every step
    about each request that made progress (`policies.prediction.refine`) and runs every step on
    its own for it. Without `update` a prediction made at arrival stands."""

    def update(self, request: Request, num_output_tokens: int) -> int | None:
        """The refined prediction of `request`, `num_output_tokens` per sequence served."""


@runtime_checkable
class Executor(Protocol):
    """Runs a step: the simulator predicts its duration, the engine runs and times it."""

    def execute(self, plan: StepPlan) -> StepResult:
        """Carry out the plan's memory operations and forward pass; returns duration (and tokens)."""


class ReplicaView(Protocol):
    """What a router sees of a replica (its `pool` name and `role`, mixed | prefill | decode, too,
    for a router that wants them)."""

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
    """Whether a request of a cluster with prefill and decode pools runs disaggregated (prefill on
    a prefill replica, decode on a decode replica after a KV transfer) or colocated (whole on a
    mixed replica, else on a prefill replica); asked once per request at arrival."""

    def disaggregate(self, request: Request, pools: Mapping[str, Seq[ReplicaView]]) -> bool:
        """True to disaggregate; `pools` maps each pool's role to its replicas."""


class PrefillPoolScheduler(Protocol):
    """A scheduler of a prefill pool (docstring above: disaggregation)."""

    def take_handoffs(self) -> list[Request]:
        """The requests stopped after their first token since the last call, blocks kept."""


class DecodePoolScheduler(Protocol):
    """A scheduler of a decode pool (docstring above: disaggregation)."""

    def admit_transfer(self, request: Request, now: float) -> bool:
        """A sequence and blocks for KV computed elsewhere; False: no room now."""
    def finish_transfer(self, request: Request, now: float) -> None:
        """The KV has arrived: the request decodes from the next step."""


@runtime_checkable
class CostModel(Protocol):
    """How long a simulated step takes (conf/cost_model: any `_target_` class with `step_time`).
    Built once per replica with the keyword arguments `model` (runtime.specs.ModelSpec),
    `hardware` (HardwareSpec), `tensor_parallel_size` and the group's own keys (and
    `expert_parallel_size` when cluster.expert_parallel_size > 1: a cost model that does not
    take it cannot cost that cluster, and the run says so); when the run
    speculates also `draft_model` ("ngram", "lookahead", "medusa" or the draft model's
    ModelSpec: policies.speculation.drafters says what each costs) and, for Medusa,
    `medusa_num_heads`. `step_time` reads the plan's aggregate features (num_prefill_tokens,
    decode_context_tokens, spec_lens, ...); it may draw noise, and is called once per step.
    Optional, each a protocol of its own: `expected_error_pct` (StatesExpectedError, below), the
    summary's expected_{ttft,tpot,e2e}_error_pct; `step_work` (StepWorkCostModel, below), what
    the energy meter charges; `costs_repeated_steps` and `repeated_step_times(plan, num_steps)`
    (RepeatedStepsCostModel, sim/core/repeated_steps.py), which cost the simulator's repeated
    steps as one event. The executor wrapping it may report its
    machine's speed (ReportsSpeed, below)."""

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
    """A StepWorkCostModel whose decode-only steps' work is linear, so that the energy meter
    charges a run of repeated decode steps without a call a step."""

    def decode_work_terms(self) -> tuple[float, float, float, float] | None:
        """(a, b, c, d): a step of n decodes alone (no prefill, drafts or block copies) over a
        context of t tokens does n·a + t·b FLOPs and moves c + (t + n)·d bytes, the very sums
        step_work makes; None where its work is not of that form."""


@runtime_checkable
class ReportsSpeed(Protocol):
    """An executor whose durations are normalised to a profile's machine speed (the engine with
    backend.speed_reference): the run's summary adds what its speed probes saw."""

    def speed_summary(self) -> dict:
        """speed_factor_median, speed_factor_p05, speed_factor_p95, speed_probes,
        speed_probe_s and, with prefill probes, prefill_speed_factor_medians and
        prefill_speed_probes."""


@runtime_checkable
class BoundedScheduler(Protocol):
    """A scheduler that says how many sequences a step runs at most (the engine captures CUDA
    graphs for decode batches up to it)."""

    max_num_seqs: int
