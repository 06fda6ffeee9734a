"""A twinserve scheduler plug-in run over mirrors of vLLM's requests, in pure Python.

The plug-in keeps its own queues of twinserve `Request`s (one `Sequence` each), exactly as in the
simulator; each mirrors one vLLM request and is moved as vLLM's scheduler moves that request:
queued on arrival, admitted, preempted, advanced by each step's tokens, finished or aborted. The
plug-in's hooks then answer vLLM's two questions, which waiting request goes next
(`next_waiting`) and which running one gives way (`_victim_candidates` and the preemption
policy's `select_victim`). vllm_adapter/scheduler.py calls this at each of vLLM's decisions;
nothing here imports vLLM, so the tests drive it with fakes.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping

from policies.batching.base import BaseScheduler
from policies.batching.chunked_prefill import ChunkedPrefillScheduler
from policies.batching.continuous import ContinuousBatchingScheduler
from policies.batching.priority import PriorityScheduler
from policies.types import (CLIENT_SCHEDULING_FIELDS, Request, SequenceStatus, StepPlan,
                            StepResult)

# Each step's plan is vLLM's; of the plug-in's step planning only these run as vLLM plans anyway
# (all queued work, chunked or not) or are hosted here (priority's preemption to admit).
HOSTED_STEP_PLANS = (ContinuousBatchingScheduler.schedule, ChunkedPrefillScheduler.schedule)
HOSTED_PREFILL_ADMISSIONS = (None, ContinuousBatchingScheduler._admit_prefills,
                             PriorityScheduler._admit_prefills)
# The hooks the adapter calls: what a plug-in built on BaseScheduler has.
HOSTED_HOOKS = ("next_waiting", "_victim_candidates", "_take_waiting", "_preempt", "admission")


class KVCacheView:
    """What the plug-in sees of vLLM's KV cache: its size and free blocks. vLLM allocates and
    frees the blocks itself, so every allocation here succeeds and holds nothing."""

    num_host_blocks = 0

    def __init__(self, block_size: int, num_blocks: int,
                 num_free_blocks: Callable[[], int] | None = None):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.block_tables: dict[int, list[int]] = {}
        self._num_free_blocks = num_free_blocks or (lambda: num_blocks)

    def num_free_blocks(self) -> int:
        return self._num_free_blocks()

    def num_used_blocks(self) -> int:
        return self.num_blocks - self._num_free_blocks()

    def num_slots_allocated(self) -> int:
        return self.num_used_blocks() * self.block_size

    def num_tokens_stored(self) -> int:
        return self.num_slots_allocated()

    def can_ever_fit(self, num_tokens: int, num_seqs: int = 1) -> bool:
        return True   # vLLM rejects what can never fit before its scheduler sees it

    def allocate_prefix(self, seq) -> int:
        return 0

    def num_cached_prefix_tokens(self, token_ids) -> int:
        return 0

    def allocate_slots(self, seq, num_tokens: int, *, watermark: bool = False) -> bool:
        return True

    def append_slots(self, seqs, start: int = 0) -> int:
        return len(seqs)

    def trim_slots(self, seq, num_tokens: int) -> None:
        pass

    def fork(self, parent, child) -> bool:
        return False

    def free(self, seq) -> None:
        pass

    def can_swap_out(self, seqs) -> bool:
        return False

    def swap_out(self, seqs):
        raise RuntimeError("vLLM V1 preempts by recompute only")

    def can_swap_in(self, seqs) -> bool:
        return False

    def swap_in(self, seqs):
        raise RuntimeError("vLLM V1 preempts by recompute only")

    def take_pending_copies(self) -> list[tuple[int, int]]:
        return []


class _SwappableView(KVCacheView):
    """A KV cache with host room, to ask a preemption policy whether it would swap."""

    def can_swap_out(self, seqs) -> bool:
        return True


def unhostable(scheduler, preemption) -> str | None:
    """One line naming the member of the plug-in vLLM's scheduler cannot host, or None."""
    cls = type(scheduler)
    name = cls.__name__
    for hook in HOSTED_HOOKS:
        if not hasattr(scheduler, hook):
            return (f"scheduler: {name} has no {hook}; the adapter orders vLLM's queue through "
                    f"BaseScheduler's hooks (policies/batching/base.py), so subclass a built-in "
                    f"scheduler and override next_waiting")
    if getattr(cls, "schedule", None) not in HOSTED_STEP_PLANS:
        return (f"scheduler.schedule: {name} plans its own steps, which vLLM's runner cannot "
                f"execute (vLLM plans each step; the adapter hosts next_waiting, "
                f"_victim_candidates and the preemption policy's select_victim)")
    if getattr(cls, "_admit_prefills", None) not in HOSTED_PREFILL_ADMISSIONS:
        return (f"scheduler._admit_prefills: {name} admits in its own way, which vLLM's "
                f"scheduler cannot host (override next_waiting instead)")
    for member in ("_may_admit", "_schedule_running", "_swap_in", "_admit_waiting"):
        if getattr(cls, member) is not getattr(BaseScheduler, member):
            return (f"scheduler.{member}: {name} overrides {member}, which vLLM's scheduler "
                    f"cannot host (override next_waiting or _victim_candidates instead)")
    if getattr(scheduler, "speculation", None) is not None:
        return ("speculation: the plug-in drafts tokens; vLLM's runner executes only vLLM's own "
                "speculative decoding (vllm serve --speculative-config)")
    if getattr(scheduler, "kv_retention", None) is not None:
        return "kv_retention: vLLM's prefix cache keeps a session's blocks, not a plug-in"
    probe = Request(-1, 0.0, 1, 1)
    probe.sequences = [scheduler.queues.new_sequence(probe)] if hasattr(
        scheduler, "queues") else []
    if preemption.mode(probe, _SwappableView(1, 1)) != "recompute":
        return (f"preemption.mode: {type(preemption).__name__} swaps victims to host memory; "
                f"vLLM V1 preempts by recompute only (preemption=recompute)")
    return None


def request_metadata(extra: Mapping | None) -> dict:
    """The twinserve Request fields a client sent in vLLM's extra arguments, converted; a bad
    value raises ValueError naming its key."""
    fields = {}
    for key, value in (extra or {}).items():
        kind = CLIENT_SCHEDULING_FIELDS.get(key)
        if kind is None or value is None:
            continue
        try:
            fields[key] = (str(value).lower() in ("1", "true") if kind is bool
                           else kind(value))
        except (TypeError, ValueError):
            raise ValueError(f"vllm_xargs.{key} must be {kind.__name__}, got {value!r}") from None
    return fields


class PluginHost:
    """The plug-in scheduler over mirrors of vLLM's requests, keyed by vLLM's request ids."""

    def __init__(self, scheduler, predictor=None):
        reason = unhostable(scheduler, scheduler.preemption)
        if reason is not None:
            raise ValueError(reason)
        self.scheduler = scheduler
        self.predictor = predictor
        self.mirrors: dict[str, Request] = {}
        self._vllm_ids: dict[int, str] = {}
        self._next_id = itertools.count()

    # ---- arrivals ----------------------------------------------------------------------------

    def arrive(self, request_id: str, *, prompt_len: int, max_tokens: int | None,
               arrival_time: float, now: float, priority: int = 0,
               extra: Mapping | None = None, lora_id: int | None = None) -> str | None:
        """Mirror a new vLLM request and queue it with the plug-in; the reason when the plug-in
        (or its metadata) refuses it, which vLLM then aborts."""
        try:
            fields = {"priority": priority, "lora_id": lora_id, **request_metadata(extra)}
        except ValueError as error:
            return str(error)
        if max_tokens is None:   # (vLLM's: up to the model's length)
            max_tokens = self.scheduler.max_model_len - prompt_len
        mirror = Request(next(self._next_id), arrival_time, prompt_len, max_tokens, **fields)
        if mirror.predicted_output_len is None and self.predictor is not None:
            mirror.predicted_output_len = self.predictor.predict(mirror)
        try:
            self.scheduler.add_request(mirror, now)
        except ValueError as error:
            return str(error)
        if mirror.rejected_reason is not None:
            return mirror.rejected_reason
        self.mirrors[request_id] = mirror
        self._vllm_ids[mirror.request_id] = request_id
        return None

    # ---- the waiting queue ----------------------------------------------------------------------

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def is_waiting(self, request_id: str) -> bool:
        mirror = self.mirrors.get(request_id)
        return mirror is not None and mirror.sequences[0].status is SequenceStatus.WAITING

    def waiting_ids(self) -> list[str]:
        return [self._vllm_ids[mirror.request_id] for mirror in self.scheduler.waiting]

    def next_waiting(self, now: float) -> str:
        """The waiting request the plug-in admits next."""
        return self._vllm_ids[self.scheduler.next_waiting(now).request_id]

    def admit(self, request_id: str, now: float) -> None:
        """vLLM took the request off its waiting queue: the plug-in admits its mirror (its
        `_take_waiting` hook runs, seats and first_scheduled_time are counted as in the
        simulator)."""
        scheduler = self.scheduler
        mirror = self.mirrors[request_id]
        budget_left = scheduler.admission.admit(
            mirror, StepPlan(), math.inf, now, True, lambda request: True,
            scheduler._take_waiting)
        if budget_left is None:
            raise RuntimeError(f"the plug-in refused request {request_id} that vLLM admitted "
                               f"(its max_num_seqs={scheduler.max_num_seqs}?)")

    def unadmit(self, request_id: str, now: float) -> None:
        """vLLM put back a request it had taken off the queue without running it (a skip): the
        mirror goes back to the front of the waiting queue, not counted as a preemption."""
        mirror = self.mirrors[request_id]
        if mirror.sequences[0].status is SequenceStatus.RUNNING:
            self.scheduler._preempt(mirror, StepPlan())
            mirror.num_preemptions -= 1

    def preempt(self, request_id: str, now: float) -> None:
        """vLLM preempted the running request: its mirror is preempted by recompute (the
        plug-in's `_preempt` hook runs)."""
        mirror = self.mirrors.get(request_id)
        if mirror is not None and mirror.sequences[0].status is SequenceStatus.RUNNING:
            self.scheduler._preempt(mirror, StepPlan())

    # ---- victims ---------------------------------------------------------------------------------

    def victim(self, candidate_ids: Iterable[str]) -> str:
        """The plug-in's victim among running `candidate_ids` (vLLM's running requests not yet
        scheduled this step, and the one short of memory), as the simulator picks it."""
        scheduler = self.scheduler
        candidates = [self.mirrors[request_id] for request_id in candidate_ids]
        victim = scheduler.preemption.select_victim(scheduler._victim_candidates(candidates))
        return self._vllm_ids[victim.request_id]

    def admission_victim(self, head_fits: Callable[[str], bool], now: float) -> str | None:
        """For a plug-in that preempts to admit (PriorityScheduler's `preempt_to_admit` and
        `rank`): the running request to preempt so that the waiting head, which does not fit
        (`head_fits`), can run; None when the head fits or none ranks below it."""
        scheduler = self.scheduler
        if not (getattr(scheduler, "preempt_to_admit", False) and scheduler.waiting):
            return None
        head = scheduler.next_waiting(now)
        if head_fits(self._vllm_ids[head.request_id]):
            return None
        if scheduler.swapped:
            return None
        head_rank = scheduler.rank(head)
        victims = [request for request in scheduler.running if scheduler.rank(request) > head_rank]
        if not victims:
            return None
        victim = scheduler.preemption.select_victim(scheduler._victim_candidates(victims))
        return self._vllm_ids[victim.request_id]

    # ---- steps -----------------------------------------------------------------------------------

    def step_done(self, scheduled: Iterable[tuple[str, int, int]], stopped: Iterable[str],
                  now: float) -> list[str]:
        """A step ran: `scheduled` holds (request id, tokens computed before it, tokens it
        computed) as vLLM planned it, `stopped` the requests vLLM finished in it (EOS, a stop
        string, max_tokens). The plug-in's `update` advances the mirrors as in the simulator.
        Returns the requests the plug-in rejected meanwhile (EDF's hopeless ones), for vLLM to
        abort."""
        plan = StepPlan()
        for request_id, num_computed, num_new in scheduled:
            mirror = self.mirrors.get(request_id)
            if mirror is None or mirror.sequences[0].status is not SequenceStatus.RUNNING:
                continue   # finished, or preempted since the step was planned
            seq = mirror.sequences[0]
            seq.num_computed_tokens = num_computed
            plan.add(seq, num_new)
        stopped = [request_id for request_id in stopped if request_id in self.mirrors]
        stopped_seq_ids = {self.mirrors[request_id].sequences[0].seq_id
                           for request_id in stopped}
        self.scheduler.update(plan, StepResult(0.0, stopped_seq_ids=stopped_seq_ids), now)
        for request_id in stopped:
            self.finished(request_id, now)
        rejected = [request_id for request_id, mirror in self.mirrors.items()
                    if mirror.rejected_reason is not None]
        for request_id in rejected:
            self._forget(request_id)
        return rejected

    def finished(self, request_id: str, now: float) -> None:
        """vLLM finished or aborted the request: its mirror leaves the plug-in."""
        mirror = self.mirrors.get(request_id)
        if mirror is None:
            return
        if not mirror.is_finished:
            self.scheduler.abort(mirror, now)
        self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        mirror = self.mirrors.pop(request_id)
        del self._vllm_ids[mirror.request_id]
