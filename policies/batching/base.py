"""What every scheduler shares: the queues, admission checks, preemption, swap-in and `update`.

A scheduler only moves requests between queues (waiting, running, swapped) and writes StepPlans;
the KV manager counts blocks; the executor runs the plan. Subclasses decide the order of a step in
`schedule` using the building blocks here:

- `_admit_waiting`     prefill new (or recompute-preempted) requests within a token budget
- `_schedule_running`  give every running sequence the tokens it still needs, preempting on OOM
- `_swap_in`           bring swapped requests back, oldest first (preempting.py, with the
                       preemption itself)

With a SpeculationPolicy (`speculation=`), `_schedule_running` lets decodes propose k draft tokens
(`StepPlan.spec_lens`, slots reserved for them, 1 + k tokens of the budget each) and `update` keeps
the accepted ones, gives the rejected drafts' slots back and tells the policy what was accepted
(speculative.py). Prefill/decode disaggregation's hand-offs and transfers are in handoff.py.

A plug-in that changes only who goes next overrides `next_waiting(now)` (see the README example)
or passes its own PreemptionPolicy.

A KV retention policy that keeps blocks between a session's turns (`kv_retention=pin|offload`)
hears of each turn's arrival, admission and finish (policies/memory/retention.py); what the
scheduler does with the blocks it keeps is in kept_turns.py.

Repeated decode steps (policies/decode_run.py): where the next steps would plan the same decode
batch, `_finish_plan` attaches a DecodeRun to the plan and the simulator runs them as one event.
That rests on three promises of the class, `plain_schedule`, `admits_in_arrival_order` and
`plain_update`; a subclass that overrides a hook a promise is about without stating the promise
in its own body withdraws it, so a plug-in repeats steps only where it said it may.
"""
from __future__ import annotations

from collections import deque
from typing import ClassVar

from policies.batching.handoff import KVHandoff
from policies.batching.kept_turns import KeptTurns
from policies.batching.preempting import PreemptionAndSwap
from policies.batching.speculative import SpeculativeDecodes
from policies.capabilities import AdmissionCheckingKVCache, OffloadingKVCache
from policies.checks import has_capability
from policies.decode_run import DecodeRun, RepeatingKVCache
from policies.protocols import (KVCacheManager, KVRetentionPolicy, LoRAManager,
                                PreemptionPolicy, SpeculationPolicy)
from policies.speculation import max_speculative_tokens
from policies.types import Request, Sequence, SequenceStatus, StepPlan, StepResult
from policies.validators import boolean, positive_int


# The hooks with a promise of their own: overriding one withdraws only that promise.
_PROMISE_OF_HOOK = {"next_waiting": "admits_in_arrival_order", "update": "plain_update"}


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


class BaseScheduler(KVHandoff, SpeculativeDecodes, KeptTurns, PreemptionAndSwap):
    # The promises repeated decode steps rest on. `plain_schedule`: `schedule` and every hook it
    # reaches plan from the queues, the batch and the pool alone (not the clock, not a count of
    # steps), so with those unchanged the next step plans the same decode batch (without it, no
    # run at all: a run skips those calls). `admits_in_arrival_order`: next_waiting takes the
    # queue's head, so a head kept out stays out and arrivals queue behind it (a run goes on
    # while requests wait). `plain_update`: `update` does per step only what a DecodeRun
    # applies (a run goes on past the steps where some of its decodes finish).
    plain_schedule: ClassVar[bool] = True
    admits_in_arrival_order: ClassVar[bool] = True
    plain_update: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # An override whose class does not state the promise about it withdraws that promise.
        own = vars(cls)
        for hook, promise in _PROMISE_OF_HOOK.items():
            if hook in own and promise not in own:
                setattr(cls, promise, False)
        if "plain_schedule" not in own and _overrides_a_planning_hook(cls):
            cls.plain_schedule = False

    def __init__(self, kv_cache: KVCacheManager, preemption: PreemptionPolicy,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 max_model_len: int = 4096, *, speculation: SpeculationPolicy | None = None,
                 coalesce: bool = True, kv_retention: KVRetentionPolicy | None = None,
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
        self._replanning = False   # planning again after releasing kept blocks (_finish_plan)
        # Kept blocks released for a running request in the plan being made: the pool changed
        # after the queue's head was refused, so the next step may admit it.
        self._released_for_running = False
        self._short_of_blocks = False   # why `_admit` last refused: the pool (else seats, budget)
        # A policy that never drafts (NoSpeculation) leaves the plain decode path untouched.
        self._speculates = (speculation is not None
                            and max_speculative_tokens(speculation) > 0)
        # Speculation decides per step (and learns from each), so its steps never repeat.
        self.coalesce = (boolean("scheduler.coalesce", coalesce) and self.plain_schedule
                         and not self._speculates
                         and has_capability(kv_cache, RepeatingKVCache, "kv_cache"))

        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is preempted first
        self.swapped: deque[Request] = deque()
        # Prefill/decode disaggregation: requests stopped after their first token whose blocks
        # wait for the KV transfer (until take_handoffs), and requests whose KV is arriving here.
        self.handed_off: list[Request] = []
        self.receiving: list[Request] = []
        # Sequences the running requests hold or will hold: an unforked request with n > 1
        # counts n, so its samples never push the batch past max_num_seqs.
        self.num_running_seqs = 0
        self._next_seq_id = 0
        self._now = 0.0  # the time of the step being planned
        # A KV manager with a host tier for its prefix cache: its stores and loads go into each
        # plan, its loaded tokens into the request.
        # (Without tier slots it never stores or loads: no call each step.)
        offloads = (has_capability(kv_cache, OffloadingKVCache, "kv_cache")
                    and kv_cache.num_offload_blocks > 0)
        self._take_pending_offload = kv_cache.take_pending_offload if offloads else None
        self._num_loaded_prefix_tokens = kv_cache.num_loaded_prefix_tokens if offloads else None
        # A KV manager that can tell an admission's allocation fails before it is tried.
        self._may_allocate_new = (
            kv_cache.may_allocate_new
            if has_capability(kv_cache, AdmissionCheckingKVCache, "kv_cache") else None)

    # ---- queues -------------------------------------------------------------------------------

    @property
    def num_outstanding(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped) + len(self.receiving)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def queue_lengths(self) -> tuple[int, int, int]:
        return len(self.waiting), len(self.running), len(self.swapped)

    def add_request(self, request: Request, now: float) -> None:
        """Queue a request, or reject it (setting `rejected_reason`) if it can never run."""
        reason = self._rejection_reason(request)
        if reason is not None:
            request.rejected_reason = reason
            return
        request.sequences = [self._new_sequence(request)]
        self.waiting.append(request)
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

    def _new_sequence(self, request: Request, num_output_tokens: int = 0,
                      output_token_ids: list[int] | None = None) -> Sequence:
        seq = Sequence(self._next_seq_id, request, num_output_tokens, output_token_ids)
        self._next_seq_id += 1
        return seq

    def next_waiting(self, now: float) -> Request:
        """The waiting request to admit next in the step planned at `now`. FCFS; override to
        reorder admission."""
        return self.waiting[0]

    # ---- building blocks for schedule() ---------------------------------------------------------

    def _admit_waiting(self, plan: StepPlan, token_budget: int, *, chunked: bool) -> int:
        """Admit waiting requests while the budget, max_num_seqs and the KV pool allow (new
        requests keep the watermark free). Without chunking a sequence's prefill is never split.
        Then, with a retention policy, the waiting turns whose sessions' blocks it keeps may go
        ahead of a head that did not fit (`_admit_kept_turns`). Returns the budget left."""
        while self.waiting and token_budget > 0:
            budget_left = self._admit(self.next_waiting(self._now), plan, token_budget,
                                      chunked=chunked)
            if budget_left is None:
                break
            token_budget = budget_left
        if self.kv_retention is not None and self.waiting and token_budget > 0:
            token_budget = self._admit_kept_turns(plan, token_budget, chunked=chunked)
        return token_budget

    def _admit(self, request: Request, plan: StepPlan, token_budget: int, *,
               chunked: bool) -> int | None:
        """Admit waiting `request` into `plan` if the budget, max_num_seqs and the pool allow:
        the budget left, or None (nothing changed)."""
        if not self._may_admit(request):
            return None
        if self.lora is not None and not self.lora.fits(request.lora_id):
            return None   # the batch holds max_loras other adapters: it waits, as for memory
        seqs = request.unfinished_sequences()
        # _num_live_samples without a second pass: n less the finished, those not in `seqs`.
        num_live_samples = request.n - len(request.sequences) + len(seqs)
        if self.num_running_seqs + num_live_samples > self.max_num_seqs:
            return None
        if (self._may_allocate_new is not None and not self._may_allocate_new(
                self._uncached_chunks(seqs, token_budget, chunked))):
            self._short_of_blocks = True
            return None   # the allocation below would fail: skip taking and freeing its blocks
        num_cached = [self.kv_cache.allocate_prefix(seq) for seq in seqs]
        chunks = []
        budget_left = token_budget
        for seq, cached in zip(seqs, num_cached):
            seq.num_computed_tokens = cached
            # The samples of a group (recomputed after preemption) may start in later steps.
            chunk = self._chunk(seq.num_tokens - cached, budget_left, chunked)
            chunks.append(chunk)
            budget_left -= chunk
        fits_budget = chunks[0] > 0
        if not fits_budget or not self._allocate_all(seqs, chunks):
            for seq in seqs:
                self.kv_cache.free(seq)
                seq.num_computed_tokens = 0
            self._short_of_blocks = fits_budget
            return None
        self._take_waiting(request)
        for seq, chunk in zip(seqs, chunks):
            seq.status = SequenceStatus.RUNNING
            if chunk > 0:
                plan.add(seq, chunk)
        self.running.append(request)
        self.num_running_seqs += num_live_samples
        if self.lora is not None:
            self.lora.admitted(request.lora_id)
        if request.first_scheduled_time is None:
            request.first_scheduled_time = self._now
            request.num_cached_tokens = num_cached[0]
            if self._num_loaded_prefix_tokens is not None:
                request.num_host_cached_tokens = self._num_loaded_prefix_tokens(seqs[0])
            if self.kv_retention is not None:
                self.kv_retention.turn_admitted(request, self._now)
        return budget_left

    def _lora_holders(self) -> list[Request]:
        """The requests whose adapters the batch holds: running, and arriving by KV transfer."""
        return self.running + self.receiving if self.receiving else self.running

    def _uncached_chunks(self, seqs: list[Sequence], token_budget: int,
                         chunked: bool) -> list[int]:
        """The nonzero prefill chunks `_admit_waiting` would give `seqs` if nothing were cached
        (what `may_allocate_new` is asked about)."""
        chunks = []
        for seq in seqs:
            chunk = self._chunk(seq.num_tokens, token_budget, chunked)
            if chunk > 0:
                chunks.append(chunk)
                token_budget -= chunk
        return chunks

    @staticmethod
    def _chunk(need: int, token_budget: int, chunked: bool) -> int:
        """Tokens of a sequence's `need` to compute this step. Unchunked, a prefill is never
        split: it runs whole or waits (0)."""
        if chunked:
            return min(need, token_budget)
        return need if need <= token_budget else 0

    def _may_admit(self, request: Request) -> bool:
        """Hook for schedulers that hold admission back (static batching)."""
        return True

    def _allocate_all(self, seqs: list[Sequence], chunks: list[int]) -> bool:
        """Allocate slots for every new chunk, respecting the watermark, all or nothing."""
        for seq, chunk in zip(seqs, chunks):
            if chunk > 0 and not self.kv_cache.allocate_slots(
                    seq, seq.num_computed_tokens + chunk, watermark=True):
                return False
        return True

    @staticmethod
    def _num_live_samples(request: Request) -> int:
        return request.n - [seq.status for seq in request.sequences].count(
            SequenceStatus.FINISHED)

    def _take_waiting(self, request: Request) -> None:
        if self.waiting[0] is request:
            self.waiting.popleft()
        else:
            self.waiting.remove(request)

    def _schedule_running(self, plan: StepPlan, token_budget: int, *,
                          chunked: bool) -> tuple[int, bool]:
        """Schedule what every running sequence still needs: one token for a decode, a chunk
        for a partial prefill (the rest of a chunked prompt, or samples of a group that start
        after it). Decodes go first, as in Sarathi-Serve, so a long prefill never stalls them.
        On an allocation failure, preempt the policy's victim among the requests not yet
        scheduled this step, and retry.

        Returns the budget left and whether anything was preempted."""
        preempted_any = False
        # The hot loop of the simulator, once per sequence per step: decodes are collected (in a
        # comprehension), given their slots in one KV-manager call, and accounted in one plan
        # call. Usually every running sequence decodes: num_running_seqs bounds their number.
        running_status = SequenceStatus.RUNNING
        decodes = [seq for request in self.running for seq in request.sequences
                   if seq.status is running_status   # not finished
                   and seq.num_tokens - seq.num_computed_tokens == 1 and seq.num_output_tokens]
        partial_prefills = ([] if len(decodes) == self.num_running_seqs else
                            [seq for request in self.running for seq in request.sequences
                             if seq.status is running_status
                             and (seq.num_tokens - seq.num_computed_tokens != 1
                                  or not seq.num_output_tokens)])
        del decodes[max(token_budget, 0):]
        if self._speculates:
            num_scheduled, preempted_any = self._schedule_speculative_decodes(plan, decodes,
                                                                              token_budget)
        else:
            num_allocated = 0
            while ((num_allocated := self.kv_cache.append_slots(decodes, num_allocated))
                   < len(decodes)):
                if self._release_kept_blocks():
                    continue   # an idle session's kept blocks go before a running request
                preempted_any = True
                request = decodes[num_allocated].request
                victim = self._preempt_for(request, plan, decodes[:num_allocated])
                # The victim's sequences leave the batch; if it was `request` itself, some of
                # its samples may be among those already given slots.
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
            chunk = self._chunk(seq.num_tokens - seq.num_computed_tokens, token_budget, chunked)
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
        if self.kv_retention is not None:
            self.kv_retention.expire(now)
            self._released_for_running = False
        if self.lora is not None:
            self.lora.track(self._lora_holders())
        return StepPlan(block_tables=self.kv_cache.block_tables)

    def _finish_plan(self, plan: StepPlan) -> StepPlan:
        if (self.kv_retention is not None and plan.is_empty and not self._replanning
                and self.has_unfinished()):
            replanned = self._plan_releasing_kept_blocks()
            if replanned is not None:
                return replanned
        if self.lora is not None:
            self.lora.finish_step(plan, self.running)
        plan.blocks_to_copy.extend(self.kv_cache.take_pending_copies())
        if self._take_pending_offload is not None:
            stores, loads = self._take_pending_offload()
            plan.blocks_to_offload.extend(stores)
            plan.blocks_to_load.extend(loads)
        if self.coalesce and plan.num_decode_seqs and self._plans_the_batch_again(plan):
            # A blocked FCFS head keeps every later arrival waiting behind it, unless kept
            # blocks let a session's next turn go ahead of it (_admit_kept_turns).
            plan.decode_run = DecodeRun.plan(
                self, plan, past_arrivals=bool(self.waiting) and self.kv_retention is None)
            if plan.decode_run is not None and self.kv_retention is not None:
                # Blocks released by time change the pool: steps one by one would see it.
                plan.decode_run.until = self.kv_retention.next_expiry()
        return plan

    # ---- repeated decode steps (policies/decode_run.py) ------------------------------------------

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
        return not (self.swapped or plan.num_prefill_seqs or plan.blocks_to_copy
                    or plan.blocks_to_swap_out or plan.blocks_to_swap_in
                    or plan.preempted_recompute or plan.blocks_to_offload or plan.blocks_to_load
                    or plan.lora_to_load
                    or plan.num_decode_seqs != self.num_running_seqs - len(self.receiving)
                    or self._released_for_running
                    or (self.waiting and not self.admits_in_arrival_order))

    def runs_past_finishes(self) -> bool:
        """Whether a run's decodes that finish may leave at their step and the rest run on:
        nothing waits, is swapped out or arriving, and `update` keeps the promise."""
        return (self.plain_update
                and not (self.waiting or self.swapped or self.receiving))

    def rest_of_run(self, plan: StepPlan) -> None:
        """(policies/decode_run.py) The run's plan lost its finished decodes: its LoRA sums."""
        if self.lora is not None:
            self.lora.finish_step(plan, self.running)

    def update(self, plan: StepPlan, result: StepResult, now: float) -> list[Request]:
        """Account for what the step computed: tokens appended (a speculating decode's
        accepted drafts and one more), samples forked, sequences and requests finished (their
        blocks freed). Returns the requests that finished."""
        if result.step_durations:
            if plan.decode_run is None:
                raise ValueError(f"the executor ran a plan {len(result.step_durations)} times; "
                                 f"its scheduler planned no DecodeRun")
            return plan.decode_run.apply(plan, len(result.step_durations), now)
        finished_requests: list[Request] = []
        sampled = result.sampled_token_ids
        stopped = result.stopped_seq_ids
        spec_lens = plan.spec_lens
        num_accepted = result.num_accepted
        if spec_lens and num_accepted is None and sampled is None:
            raise ValueError("the executor returned no num_accepted for a plan with spec_lens")
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
                    self._hand_off(seq)
                    continue
            if done and self.finish_sequence(seq, now):
                finished_requests.append(request)
        if self._speculates:
            self._observe_drafts(plan, result)
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
        self.num_running_seqs -= 1
        request = seq.request
        samples = request.sequences
        if len(samples) == 1 or all(s.status is SequenceStatus.FINISHED for s in samples):
            request.finish_time = now
            self.running.remove(request)
            self._on_request_finished(request)
            return True
        return False

    def abort(self, request: Request, now: float) -> None:
        """Drop unfinished `request` at `now` (policies.protocols.AbortingScheduler): a running
        one through `finish_sequence`, so its blocks and seats go back as at a finish; a waiting
        (no blocks) or swapped (host blocks) one leaves its queue."""
        if request in self.running:
            # An unforked request with n > 1 holds seats for all its samples (num_running_seqs).
            unstarted_samples = request.n - len(request.sequences)
            for seq in request.unfinished_sequences():
                self.finish_sequence(seq, now)
            self.num_running_seqs -= unstarted_samples
            request.finish_time = None   # (finish_sequence stamped it: it did not finish)
        else:
            queue = self.swapped if request in self.swapped else self.waiting
            if request in queue:
                queue.remove(request)
            for seq in request.unfinished_sequences():
                self.kv_cache.free(seq)
                seq.status = SequenceStatus.FINISHED
            # (static batching waits for every member of its batch, a preempted one too)
            self._on_request_finished(request)
        request.abandoned_time = now

    def _on_request_finished(self, request: Request) -> None:
        """Hook for schedulers that track batches."""

    def _fork(self, parent: Sequence, result: StepResult, now: float) -> list[Sequence]:
        """Create the n - 1 other samples of a request from its first sequence, sharing its
        prompt blocks. A child that cannot get blocks (sharing off, pool full) recomputes its
        prompt and first token later instead. Returns the children."""
        request = parent.request
        forked_ids = (result.forked_token_ids or {}).get(parent.seq_id)
        children = []
        for index in range(request.n - 1):
            token_ids = None if forked_ids is None else [forked_ids[index]]
            child = self._new_sequence(request, 1, token_ids)
            child.status = SequenceStatus.RUNNING
            child.last_token_time = now
            if self.kv_cache.fork(parent, child):
                child.num_computed_tokens = parent.num_computed_tokens
            request.sequences.append(child)
            children.append(child)
        return children
