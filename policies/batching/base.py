"""What every scheduler shares, composed of parts that each own their state:

- `Queues` (queues.py)               waiting, running, swapped; the seats the running hold
- `Admission` (admission.py)         a waiting request joins under the step's token budget
- `PreemptionAndSwap` (preempting.py) who gives way when memory runs out; swap-in
- `KVHandoff` (handoff.py)           prefill/decode disaggregation's hand-offs and transfers
- `KeptTurns` (kept_turns.py)        blocks a KV retention policy keeps between a session's turns
- `SpeculativeDecodes` (speculative.py) decodes with drafts, with a SpeculationPolicy

A subclass decides the order of a step in `schedule` with the building blocks `_admit_waiting`,
`_schedule_running` and `_swap_in` between `_new_plan` and `_finish_plan`, and changes who goes
next through the hooks (`next_waiting(now)`, `_may_admit`, `_take_waiting`,
`_victim_candidates`, `_preempt`, `_on_request_finished`).

The simulator's repeated steps (sim/core/repeated_steps.py) run only for a class that states the
promise `repeated_steps`; a subclass that overrides a hook a promise is about without stating the
promise in its own body withdraws it, so a plug-in that overrides `schedule` is exact by default.
"""
from __future__ import annotations

import math
from collections import deque
from typing import ClassVar

from policies.batching.admission import Admission
from policies.batching.handoff import KVHandoff
from policies.batching.kept_turns import KeptTurns
from policies.batching.preempting import PreemptionAndSwap
from policies.batching.queues import Queues, prefill_chunk
from policies.batching.speculative import SpeculativeDecodes
from policies.capabilities import ExpiringKVRetention, OffloadingKVCache
from policies.checks import has_capability
from policies.protocols import (KVCacheManager, KVRetentionPolicy, LoRAManager,
                                PreemptionPolicy, SpeculationPolicy)
from policies.speculation import max_speculative_tokens
from policies.types import Request, Sequence, SequenceStatus, StepPlan, StepResult
from policies.validators import positive_int


# The hooks with a promise of their own: overriding one withdraws only that promise.
_PROMISE_OF_HOOK = {"next_waiting": "repeated_steps_past_arrivals",
                    "update": "repeated_steps_past_finishes"}


def _overrides_a_planning_hook(cls: type) -> bool:
    """Whether `cls` defines `schedule` in its own body, or a method (or property) that a base
    class defines too, other than a constructor and the hooks with promises of their own: any
    such override (a hook `schedule` reaches, `add_request` read mid-run) may plan by what a
    run skips."""
    for name, value in vars(cls).items():
        if (name.startswith("__") or name in _PROMISE_OF_HOOK
                or not (callable(value) or isinstance(value, (staticmethod, classmethod,
                                                              property)))):
            continue
        if name == "schedule" or any(name in vars(base) for base in cls.__mro__[1:]):
            return True
    return False


class BaseScheduler:
    # The promises repeated steps rest on (a run skips the calls they are about).
    # `repeated_steps`: `schedule` and every hook it reaches plan from the queues, the batch and
    # the pool alone (not the clock, not a count of steps); a class that defines `schedule`
    # states it. `repeated_steps_past_arrivals`: next_waiting takes the queue's head, so
    # arrivals queue behind a head kept out. `repeated_steps_past_finishes`: `update` does per
    # step only what a decode's next token needs, so decodes may finish inside a run.
    repeated_steps: ClassVar[bool] = False
    repeated_steps_past_arrivals: ClassVar[bool] = True
    repeated_steps_past_finishes: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # An override whose class does not state the promise about it withdraws that promise.
        own = vars(cls)
        for hook, promise in _PROMISE_OF_HOOK.items():
            if hook in own and promise not in own:
                setattr(cls, promise, False)
        if "repeated_steps" not in own and _overrides_a_planning_hook(cls):
            cls.repeated_steps = False

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
        # What a session's finished turn keeps between turns; None: freed as any request's.
        self.kv_retention = kv_retention
        # Multi-LoRA serving: the replica's adapter slots; None: no request has an adapter.
        self.lora = lora
        self._now = 0.0   # the time of the step being planned
        # Whether the simulator can learn when kept blocks are released by time (else no
        # repeated steps).
        self._retention_expires = kv_retention is None or has_capability(
            kv_retention, ExpiringKVRetention, "kv_retention")

        # A host tier for the prefix cache: its stores and loads go into each plan (without
        # tier slots it never has any: no call each step).
        offloads = (has_capability(kv_cache, OffloadingKVCache, "kv_cache")
                    and kv_cache.num_offload_blocks > 0)
        self._take_pending_offload = kv_cache.take_pending_offload if offloads else None

        self.queues = Queues()
        self.admission = Admission(self.queues, kv_cache, max_num_seqs, lora, kv_retention,
                                   kv_cache.num_loaded_prefix_tokens if offloads else None)
        self.preempting = PreemptionAndSwap(self.queues, kv_cache, preemption, max_num_seqs,
                                            lora)
        self.handoff = KVHandoff(self.queues, kv_cache)
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
        """Admit waiting requests while the budget, max_num_seqs and the KV pool allow (new
        requests keep the watermark free); unchunked, a prefill is never split. Then the turns
        whose sessions' blocks are kept may go ahead of a head that did not fit. Returns the
        budget left."""
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
        """Swap requests back in, oldest first, while memory and max_num_seqs allow; their
        sequences are scheduled in the same step. Returns the budget left."""
        if not self.queues.swapped:
            return token_budget
        return self.preempting.swap_in(plan, token_budget, chunked=chunked,
                                       may_admit=self._may_admit)

    def _preempt_for(self, request: Request, plan: StepPlan, pending: list[Sequence]) -> Request:
        """Preempt the victim that makes room for `request` (`pending`: decodes given slots
        this step, not yet in the plan). Returns the victim."""
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
        """Schedule what every running sequence still needs: one token for a decode, a chunk
        for a partial prefill. Decodes go first, as in Sarathi-Serve, so a long prefill never
        stalls them. On an allocation failure, preempt the policy's victim among the requests
        not yet scheduled this step, and retry.

        Returns the budget left and whether anything was preempted."""
        preempted_any = False
        # The simulator's hot loop: decodes are collected in a comprehension, given slots in
        # one KV-manager call and accounted in one plan call.
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
                # If the victim was `request` itself, some of its samples may have slots.
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
        """The requests stopped after their first token (`Request.handoff`) since the last call;
        their blocks stay allocated until the cluster frees them after the KV transfer."""
        return self.handoff.take()

    def admit_transfer(self, request: Request, now: float) -> bool:
        """Give a request prefilled elsewhere a sequence and blocks here (within max_num_seqs,
        its adapter and the watermark) so its KV can arrive. False: no room now, nothing
        changed; one that can never run here gets its `rejected_reason` too."""
        reason = self._rejection_reason(request)
        if reason is None and request.n != 1:
            reason = f"a KV transfer moves one sequence; n={request.n}"
        if reason is not None:
            request.rejected_reason = reason
            return False
        if self.queues.num_running_seqs + 1 > self.max_num_seqs:
            return False
        if self.lora is not None:
            self.lora.track(self._lora_holders())
            if not self.lora.fits(request.lora_id):
                return False
        return self.handoff.receive(request)

    def finish_transfer(self, request: Request, now: float) -> None:
        """The KV of a request admitted by admit_transfer has arrived: it decodes from now on."""
        self.handoff.arrived(request)

    # ---- the simulator's repeated steps (sim/core/repeated_steps.py) ---------------------------

    def repeated_steps_bounds(self, plan: StepPlan) -> tuple[bool, float] | None:
        """None unless the next steps would plan this decode batch again; else whether they may
        run past arrivals and when kept blocks are released by time (the pool changes)."""
        # (Speculation decides per step and learns from each.)
        if (not plan.num_decode_seqs or self.drafting is not None or not self._retention_expires
                or not self._plans_the_batch_again(plan)):
            return None
        if self.kv_retention is None:
            # A blocked FCFS head keeps every later arrival waiting behind it.
            return bool(self.queues.waiting), math.inf
        # Kept blocks may let a session's next turn go ahead of the head (KeptTurns.admit_turns).
        return False, self.kv_retention.next_expiry()

    def _plans_the_batch_again(self, plan: StepPlan) -> bool:
        """Whether, if no request arrived, `schedule` would plan this same decode batch next
        step, each decode a token further on, unless a decode finishes or the pool runs short:
        every running sequence decodes, nothing is swapped out, nothing was preempted, copied or
        swapped. Waiting requests stay waiting: the head of the queue was not admitted now, and
        what kept it out (max_num_seqs, the token budget, the pool's free blocks, the batch)
        gets no better before a decode finishes; a scheduler that reorders the queue may pick
        another head later, so it waits for none; nor after kept blocks were released for a
        running request this step (the pool grew after the head was refused). Requests whose KV
        is arriving (`receiving`) hold their seats and blocks already; the replica's horizon
        ends the run where they land."""
        queues = self.queues
        num_decoding = queues.num_running_seqs - len(self.handoff.receiving)
        return not (queues.swapped or plan.num_prefill_seqs or plan.blocks_to_copy
                    or plan.blocks_to_swap_out or plan.blocks_to_swap_in
                    or plan.preempted_recompute or plan.blocks_to_offload or plan.blocks_to_load
                    or (plan.lora is not None and plan.lora.to_load) or plan.num_decode_seqs != num_decoding
                    or (self.kept_turns is not None and self.kept_turns.released_for_running)
                    or (queues.waiting and not self.repeated_steps_past_arrivals))

    def may_repeat_past_finishes(self) -> bool:
        """Whether a run's decodes that finish may leave at their step and the rest run on:
        nothing waits, is swapped out or arriving, and `update` keeps the promise."""
        queues = self.queues
        return (self.repeated_steps_past_finishes
                and not (queues.waiting or queues.swapped or self.handoff.receiving))

    def resum_plan(self, plan: StepPlan) -> None:
        """The plan lost its finished decodes (repeated steps): its LoRA sums."""
        if self.lora is not None:
            self.lora.finish_step(plan, self.queues.running)

    def update(self, plan: StepPlan, result: StepResult, now: float) -> list[Request]:
        """Account for what the step computed: tokens appended (a speculating decode's
        accepted drafts and one more), samples forked, sequences and requests finished (their
        blocks freed). Returns the requests that finished."""
        finished_requests: list[Request] = []
        sampled = result.sampled_token_ids
        stopped = result.stopped_seq_ids
        spec_lens = plan.spec_lens
        num_accepted = result.num_accepted
        if spec_lens and num_accepted is None and sampled is None:
            raise ValueError("the executor returned no num_accepted for a plan with spec_lens")
        if (sampled is None and not plan.num_prefill_seqs and not spec_lens
                and self.drafting is None):
            # Decodes alone, without ids or drafts (the simulator's usual step): one pass, and
            # none samples its first token.
            Sequence.advance_decodes(plan.seqs, 1, now)
            finish = self.finish_sequence
            for seq in plan.seqs:
                request = seq.request
                if ((seq.num_output_tokens >= request.output_len
                     or (stopped and seq.seq_id in stopped)) and finish(seq, now)):
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
                # The verification wrote the accepted drafts' KV, the last token's comes next
                # step; the rejected drafts' slots go back.
                seq.advance(num_new + num_sampled - 1, num_sampled, now, new_token_ids)
                self.kv_cache.trim_slots(seq, seq.num_tokens)
            else:
                seq.advance(num_new, num_sampled, now, new_token_ids)
            num_output_tokens = seq.num_output_tokens
            request = seq.request
            done = num_output_tokens >= request.output_len or (stopped and seq.seq_id in stopped)
            if num_output_tokens == num_sampled:
                self._on_first_tokens(seq, result, now, finished_requests)
                if request.handoff and not done:
                    self.handoff.hand_off(seq)
                    continue
            if done and self.finish_sequence(seq, now):
                finished_requests.append(request)
        if self.drafting is not None:
            self.drafting.observe(plan, result)
        return finished_requests

    def _on_first_tokens(self, seq: Sequence, result: StepResult, now: float,
                         finished_requests: list[Request]) -> None:
        """A sequence sampled its first token: time to first token, and for n > 1 the fork of
        the other samples (which may finish at once when output_len is 1)."""
        request = seq.request
        if request.first_token_time is None:
            request.first_token_time = now
        if len(request.sequences) < request.n:
            for child in self._fork(seq, result, now):
                if child.num_output_tokens >= request.output_len:
                    if self.finish_sequence(child, now):
                        finished_requests.append(request)

    def finish_sequence(self, seq: Sequence, now: float) -> bool:
        """Mark a sequence finished and free its blocks; True if its request is now done."""
        seq.status = SequenceStatus.FINISHED
        if self.kv_retention is None:
            self.kv_cache.free(seq)
        else:
            self.kv_retention.turn_finished(seq, now)
        queues = self.queues
        queues.num_running_seqs -= 1
        request = seq.request
        samples = request.sequences
        if len(samples) == 1 or all(s.status is SequenceStatus.FINISHED for s in samples):
            request.finish_time = now
            queues.running.remove(request)
            self._on_request_finished(request)
            return True
        return False

    def abort(self, request: Request, now: float) -> None:
        """Drop unfinished `request` at `now` (policies.protocols.AbortingScheduler): a running
        one through `finish_sequence`, so its blocks and seats go back as at a finish; a waiting
        (no blocks) or swapped (host blocks) one leaves its queue."""
        queues = self.queues
        if request in queues.running:
            # An unforked request with n > 1 holds seats for all its samples.
            unstarted_samples = request.n - len(request.sequences)
            for seq in request.unfinished_sequences():
                self.finish_sequence(seq, now)
            queues.num_running_seqs -= unstarted_samples
            request.finish_time = None   # (finish_sequence stamped it: it did not finish)
        else:
            queue = queues.swapped if request in queues.swapped else queues.waiting
            if request in queue:
                queue.remove(request)
            for seq in request.unfinished_sequences():
                self.kv_cache.free(seq)
                seq.status = SequenceStatus.FINISHED
            # (static batching waits for every member of its batch, a preempted one too)
            self._on_request_finished(request)
        request.abandoned_time = now

    def _fork(self, parent: Sequence, result: StepResult, now: float) -> list[Sequence]:
        """Create the n - 1 other samples of a request from its first sequence, sharing its
        prompt blocks. A child that cannot get blocks (sharing off, pool full) recomputes its
        prompt and first token later instead. Returns the children."""
        request = parent.request
        forked_ids = (result.forked_token_ids or {}).get(parent.seq_id)
        children = []
        for index in range(request.n - 1):
            token_ids = None if forked_ids is None else [forked_ids[index]]
            child = self.queues.new_sequence(request, 1, token_ids)
            child.status = SequenceStatus.RUNNING
            child.last_token_time = now
            if self.kv_cache.fork(parent, child):
                child.num_computed_tokens = parent.num_computed_tokens
            request.sequences.append(child)
            children.append(child)
        return children
