"""What every scheduler shares, composed of parts that each own their state:

- `Queues` (queues.py)               waiting, running, swapped; the seats the running hold
- `Admission` (admission.py)         a waiting request joins under the step's token budget
- `PreemptionAndSwap` (preempting.py) who gives way when memory runs out; swap-in
- `KVHandoff` (handoff.py)           prefill/decode disaggregation's hand-offs and transfers
- `Finishing` (finishing.py)         first tokens and forks, finishes, aborts
- `KeptTurns` (kept_turns.py)        blocks a KV retention policy keeps between a session's turns
- `SpeculativeDecodes` (speculative.py) decodes with drafts, with a SpeculationPolicy

A subclass orders a step in `schedule` (`_admit_waiting`, `_schedule_running`, `_swap_in`
between `_new_plan` and `_finish_plan`) and changes who goes next through the hooks; the
promises the simulator's repeated steps rest on are in promises.py (docs/policies.md).
"""
from __future__ import annotations

from collections import deque
from typing import ClassVar

from policies.batching.admission import Admission
from policies.batching.finishing import Finishing
from policies.batching.handoff import KVHandoff
from policies.batching.kept_turns import KeptTurns
from policies.batching.preempting import PreemptionAndSwap
from policies.batching.promises import (may_repeat_past_finishes, repeated_steps_bounds,
                                        withdraw_unstated_promises)
from policies.batching.queues import Queues, prefill_chunk
from policies.batching.speculative import SpeculativeDecodes
from policies.capabilities import ExpiringKVRetention, OffloadingKVCache
from policies.checks import has_capability
from policies.protocols import (KVCacheManager, KVRetentionPolicy, LoRAManager,
                                PreemptionPolicy, SpeculationPolicy)
from policies.speculation import max_speculative_tokens
from policies.types import Request, Sequence, SequenceStatus, StepPlan, StepResult
from policies.validators import positive_int


class BaseScheduler:
    # The promises repeated steps rest on (promises.py says what each means).
    repeated_steps: ClassVar[bool] = False
    repeated_steps_past_arrivals: ClassVar[bool] = True
    repeated_steps_past_finishes: ClassVar[bool] = True
    repeated_steps_pause_for_prefills: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        withdraw_unstated_promises(cls)

    def __init__(self, kv_cache: KVCacheManager, preemption: PreemptionPolicy,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 max_model_len: int = 4096, *, speculation: SpeculationPolicy | None = None,
                 kv_retention: KVRetentionPolicy | None = None,
                 lora: LoRAManager | None = None):
        positive_int("scheduler.max_num_seqs", max_num_seqs)
        positive_int("scheduler.max_num_batched_tokens", max_num_batched_tokens)
        positive_int("scheduler.max_model_len", max_model_len)
        self.kv_cache = kv_cache
        self.preemption = preemption
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.speculation = speculation
        self.kv_retention = kv_retention   # None: a finished turn is freed as any request's
        self.lora = lora                   # None: no request has an adapter
        self._now = 0.0   # the time of the step being planned
        # Repeated steps need to know when kept blocks are released by time.
        self._retention_expires = kv_retention is None or has_capability(
            kv_retention, ExpiringKVRetention, "kv_retention")

        # Without host-tier slots there are never stores or loads: no call each step.
        offloads = (has_capability(kv_cache, OffloadingKVCache, "kv_cache")
                    and kv_cache.num_offload_blocks > 0)
        self._take_pending_offload = kv_cache.take_pending_offload if offloads else None

        self.queues = Queues()
        self.admission = Admission(self.queues, kv_cache, max_num_seqs, lora, kv_retention,
                                   kv_cache.num_loaded_prefix_tokens if offloads else None)
        self.preempting = PreemptionAndSwap(self.queues, kv_cache, preemption, max_num_seqs,
                                            lora)
        self.handoff = KVHandoff(self.queues, kv_cache)
        self.finishing = Finishing(self.queues, kv_cache, kv_retention, self._on_request_finished)
        self.kept_turns = (None if kv_retention is None
                           else KeptTurns(kv_retention, self.admission))
        # A policy that never drafts (NoSpeculation) leaves the plain decode path untouched.
        self.drafting = (SpeculativeDecodes(speculation, kv_cache, max_model_len)
                         if speculation is not None and max_speculative_tokens(speculation) > 0
                         else None)

    # ---- queues -------------------------------------------------------------------------------

    @property
    def waiting(self) -> deque[Request]:
        return self.queues.waiting

    @property
    def running(self) -> list[Request]:
        return self.queues.running

    @property
    def swapped(self) -> deque[Request]:
        return self.queues.swapped

    @property
    def num_running_seqs(self) -> int:
        return self.queues.num_running_seqs

    @property
    def receiving(self) -> list[Request]:
        return self.handoff.receiving

    @property
    def num_outstanding(self) -> int:
        queues = self.queues
        return (len(queues.waiting) + len(queues.running) + len(queues.swapped)
                + len(self.handoff.receiving))

    def has_unfinished(self) -> bool:
        queues = self.queues
        return bool(queues.waiting or queues.running or queues.swapped)

    def queue_lengths(self) -> tuple[int, int, int]:
        queues = self.queues
        return len(queues.waiting), len(queues.running), len(queues.swapped)

    def add_request(self, request: Request, now: float) -> None:
        """Queue a request, or reject it (setting `rejected_reason`) if it can never run."""
        reason = self._rejection_reason(request)
        if reason is not None:
            request.rejected_reason = reason
            return
        request.sequences = [self.queues.new_sequence(request)]
        self.queues.waiting.append(request)
        if self.kv_retention is not None:
            self.kv_retention.turn_arrived(request, now)

    def _rejection_reason(self, request: Request) -> str | None:
        total_len = request.prompt_len + request.output_len
        if request.prompt_len <= 0:
            return f"prompt_len must be positive, got {request.prompt_len}"
        if request.output_len <= 0:
            return f"output_len must be positive, got {request.output_len}"
        if request.n <= 0 or request.n > self.max_num_seqs:
            return f"n={request.n} must be in [1, max_num_seqs={self.max_num_seqs}]"
        if total_len > self.max_model_len:
            return (f"prompt_len + output_len = {total_len} exceeds "
                    f"max_model_len={self.max_model_len}")
        if not self.kv_cache.can_ever_fit(total_len, request.n):
            return (f"{request.n} x {total_len} tokens can never fit in the KV cache of "
                    f"{self.kv_cache.num_blocks} blocks")
        return None

    # ---- hooks a subclass overrides -----------------------------------------------------------

    def next_waiting(self, now: float) -> Request:
        """The waiting request to admit next in the step planned at `now`. FCFS; override to
        reorder admission."""
        return self.queues.waiting[0]

    def _may_admit(self, request: Request) -> bool:
        """Whether `request` may join the batch now (static batching holds admission back)."""
        return True

    def _take_waiting(self, request: Request) -> None:
        """`request` leaves the waiting queue, admitted."""
        self.queues.take_waiting(request)

    def _victim_candidates(self, candidates: list[Request]) -> list[Request]:
        """The requests the preemption policy may pick its victim among."""
        return candidates

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        """Take running `request` out of the batch (swapped out or recomputed)."""
        self.preempting.preempt(request, plan)
        if self.lora is not None:
            self.lora.track(self._lora_holders())

    def _on_request_finished(self, request: Request) -> None:
        """A request finished or was aborted (static batching tracks its batch)."""

    @staticmethod
    def _highest(candidates: list[Request], key) -> list[Request]:
        """The candidates with the highest `key` (the least favoured, for _victim_candidates)."""
        keys = [key(request) for request in candidates]
        highest = max(keys)
        return [request for request, value in zip(candidates, keys) if value == highest]

    # ---- building blocks for schedule() ---------------------------------------------------------

    def _admit_waiting(self, plan: StepPlan, token_budget: int, *, chunked: bool) -> int:
        """Admit waiting requests while the budget, max_num_seqs and the KV pool allow, then kept
        turns that may pass a head that did not fit. Returns the budget left."""
        waiting = self.queues.waiting
        if not waiting or token_budget <= 0:
            return token_budget
        admit, now = self.admission.admit, self._now
        may_admit, take_waiting = self._may_admit, self._take_waiting
        while waiting and token_budget > 0:
            budget_left = admit(self.next_waiting(now), plan, token_budget, now, chunked,
                                may_admit, take_waiting)
            if budget_left is None:
                break
            token_budget = budget_left
        if self.kept_turns is not None and waiting and token_budget > 0:
            token_budget = self.kept_turns.admit_turns(plan, token_budget, now, chunked=chunked,
                                                       may_admit=may_admit,
                                                       take_waiting=take_waiting)
        return token_budget

    def _swap_in(self, plan: StepPlan, token_budget: int, *, chunked: bool) -> int:
        """Swap requests back in, oldest first, scheduled this step. Returns the budget left."""
        if not self.queues.swapped:
            return token_budget
        return self.preempting.swap_in(plan, token_budget, chunked=chunked,
                                       may_admit=self._may_admit)

    def _preempt_for(self, request: Request, plan: StepPlan, pending: list[Sequence]) -> Request:
        """Preempt the victim that makes room for `request` (`pending`: decodes given slots but
        not yet planned). Returns the victim."""
        victim = self.preempting.victim_for(request, plan, pending, self._victim_candidates)
        self._preempt(victim, plan)
        return victim

    def _lora_holders(self) -> list[Request]:
        """The requests whose adapters the batch holds: running, and arriving by KV transfer."""
        running, receiving = self.queues.running, self.handoff.receiving
        return running + receiving if receiving else running

    def _release_kept_blocks(self) -> bool:
        """Whether kept blocks were released for a running request short of memory."""
        return self.kept_turns is not None and self.kept_turns.release_for_running(self._now)

    def _schedule_running(self, plan: StepPlan, token_budget: int, *,
                          chunked: bool) -> tuple[int, bool]:
        """Schedule a token for each decode, then a chunk for each partial prefill (decodes
        first, as in Sarathi-Serve, so a long prefill never stalls them), preempting on an
        allocation failure. Returns the budget left and whether anything was preempted."""
        preempted_any = False
        # The simulator's hot loop: one comprehension, one KV-manager call, one plan call.
        queues = self.queues
        running_status = SequenceStatus.RUNNING
        decodes = [seq for request in queues.running for seq in request.sequences
                   if seq.status is running_status   # not finished
                   and seq.num_tokens - seq.num_computed_tokens == 1 and seq.num_output_tokens]
        partial_prefills = ([] if len(decodes) == queues.num_running_seqs else
                            [seq for request in queues.running for seq in request.sequences
                             if seq.status is running_status
                             and (seq.num_tokens - seq.num_computed_tokens != 1
                                  or not seq.num_output_tokens)])
        del decodes[max(token_budget, 0):]
        if self.drafting is not None:
            num_scheduled, preempted_any = self.drafting.schedule_decodes(
                plan, decodes, token_budget, self._preempt_for)
        else:
            num_allocated = 0
            while ((num_allocated := self.kv_cache.append_slots(decodes, num_allocated))
                   < len(decodes)):
                if self._release_kept_blocks():
                    continue   # an idle session's kept blocks go before a running request
                preempted_any = True
                request = decodes[num_allocated].request
                victim = self._preempt_for(request, plan, decodes[:num_allocated])
                # The victim may be `request` itself, some of whose samples have slots.
                num_allocated -= sum(1 for seq in decodes[:num_allocated] if seq.request is victim)
                decodes[:] = [seq for seq in decodes if seq.request is not victim]
            plan.add_decodes(decodes, drafted=False)   # without speculation no lag arises
            num_scheduled = len(decodes)
        token_budget -= num_scheduled
        for seq in partial_prefills:
            if token_budget < 1:
                break
            if seq.status is not running_status:
                continue  # preempted meanwhile
            chunk = prefill_chunk(seq.num_tokens - seq.num_computed_tokens, token_budget,
                                  chunked)
            if chunk == 0:
                continue  # unchunked and too long for what is left: whole, in a later step
            request = seq.request
            while not self.kv_cache.allocate_slots(seq, seq.num_computed_tokens + chunk):
                if self._release_kept_blocks():
                    continue
                preempted_any = True
                if self._preempt_for(request, plan, []) is request:
                    break
            else:
                plan.add(seq, chunk)
                token_budget -= chunk
        return token_budget, preempted_any

    def _new_plan(self, now: float) -> StepPlan:
        self._now = now
        if self.kept_turns is not None:
            self.kept_turns.new_step(now)
        if self.lora is not None:
            self.lora.track(self._lora_holders())
        return StepPlan(block_tables=self.kv_cache.block_tables)

    def _finish_plan(self, plan: StepPlan) -> StepPlan:
        kept_turns = self.kept_turns
        if (kept_turns is not None and plan.is_empty and not kept_turns.replanning
                and self.has_unfinished()):
            replanned = kept_turns.plan_releasing(self.schedule, self._now)
            if replanned is not None:
                return replanned
        if self.lora is not None:
            self.lora.finish_step(plan, self.queues.running)
        plan.blocks_to_copy.extend(self.kv_cache.take_pending_copies())
        if self._take_pending_offload is not None:
            stores, loads = self._take_pending_offload()
            plan.blocks_to_offload.extend(stores)
            plan.blocks_to_load.extend(loads)
        return plan

    # ---- prefill/decode disaggregation (policies/protocols.py's optional members) -------------

    def take_handoffs(self) -> list[Request]:
        """The requests stopped after their first token since the last call, blocks kept."""
        return self.handoff.take()

    def admit_transfer(self, request: Request, now: float) -> bool:
        """Give a request prefilled elsewhere a sequence and blocks here. False: no room now (or
        never: `rejected_reason` set)."""
        return self.handoff.admit(request, self._rejection_reason(request), self.max_num_seqs,
                                  self.lora, self._lora_holders)

    def finish_transfer(self, request: Request, now: float) -> None:
        """The KV of a request admitted by admit_transfer has arrived: it decodes from now on."""
        self.handoff.arrived(request)

    # ---- the simulator's repeated steps (sim/core/repeated_steps.py; promises.py answers) ----

    # Class attributes, not wrappers: the simulator asks them before every run.
    repeated_steps_bounds = repeated_steps_bounds
    may_repeat_past_finishes = may_repeat_past_finishes

    def resum_plan(self, plan: StepPlan) -> None:
        """The plan lost its finished decodes (repeated steps): its LoRA sums."""
        if self.lora is not None:
            self.lora.finish_step(plan, self.queues.running)

    def update(self, plan: StepPlan, result: StepResult, now: float) -> list[Request]:
        """Append the step's tokens, fork samples and finish sequences. Returns the requests that
        finished."""
        finished_requests: list[Request] = []
        sampled = result.sampled_token_ids
        stopped = result.stopped_seq_ids
        spec_lens = plan.spec_lens
        num_accepted = result.num_accepted
        finish_sequence = self.finishing.finish_sequence
        if spec_lens and num_accepted is None and sampled is None:
            raise ValueError("the executor returned no num_accepted for a plan with spec_lens")
        if (sampled is None and not plan.num_prefill_seqs and not spec_lens
                and self.drafting is None):
            # Decodes alone, without ids or drafts (the simulator's usual step): one pass, and
            # none samples its first token.
            Sequence.advance_decodes(plan.seqs, 1, now)
            for seq in plan.seqs:
                request = seq.request
                if ((seq.num_output_tokens >= request.output_len
                     or (stopped and seq.seq_id in stopped)) and finish_sequence(seq, now)):
                    finished_requests.append(request)
            return finished_requests
        for seq, num_new in zip(plan.seqs, plan.num_new_tokens):
            if seq.num_computed_tokens + num_new < seq.num_tokens:
                seq.advance(num_new, 0, now)   # a prefill chunk short of the end samples nothing
                continue
            new_token_ids = None if sampled is None else sampled[seq.seq_id]
            num_sampled = 1 if new_token_ids is None else len(new_token_ids)
            if spec_lens and seq.seq_id in spec_lens:
                if sampled is None:
                    num_sampled += num_accepted[seq.seq_id]
                # The last token's KV comes next step; the rejected drafts' slots go back.
                seq.advance(num_new + num_sampled - 1, num_sampled, now, new_token_ids)
                self.kv_cache.trim_slots(seq, seq.num_tokens)
            else:
                seq.advance(num_new, num_sampled, now, new_token_ids)
            num_output_tokens = seq.num_output_tokens
            request = seq.request
            done = num_output_tokens >= request.output_len or (stopped and seq.seq_id in stopped)
            if num_output_tokens == num_sampled:
                self.finishing.first_tokens(seq, result, now, finished_requests)
                if request.handoff and not done:
                    self.handoff.hand_off(seq)
                    continue
            if done and finish_sequence(seq, now):
                finished_requests.append(request)
        if self.drafting is not None:
            self.drafting.observe(plan, result)
        return finished_requests

    def finish_sequence(self, seq: Sequence, now: float) -> bool:
        """Mark a sequence finished and free its blocks; True if its request is now done."""
        return self.finishing.finish_sequence(seq, now)

    def abort(self, request: Request, now: float) -> None:
        """Drop unfinished `request` at `now`, giving back its blocks and seats as a finish does."""
        self.finishing.abort(request, now)
