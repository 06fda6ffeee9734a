"""Preemption and swap-in: which running request gives way when memory runs out, how it leaves
(swapped out, or freed for recompute) and how swapped requests come back."""
from __future__ import annotations

from collections.abc import Callable

from policies.batching.queues import Queues, num_live_samples, prefill_chunk
from policies.protocols import KVCacheManager, LoRAManager, PreemptionPolicy
from policies.types import Request, Sequence, SequenceStatus, StepPlan


class PreemptionAndSwap:
    """Moves requests between the running and the swapped or waiting queues, with the
    scheduler's PreemptionPolicy; it holds no state of its own."""

    __slots__ = ("queues", "kv_cache", "policy", "max_num_seqs", "lora")

    def __init__(self, queues: Queues, kv_cache: KVCacheManager, policy: PreemptionPolicy,
                 max_num_seqs: int, lora: LoRAManager | None):
        self.queues = queues
        self.kv_cache = kv_cache
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.lora = lora

    def victim_for(self, request: Request, plan: StepPlan, pending: list[Sequence],
                   victim_candidates: Callable[[list[Request]], list[Request]]) -> Request:
        """The policy's pick among the running requests not yet scheduled this step (or `request`
        itself) to make room for `request`; its scheduled samples leave the plan."""
        scheduled = {seq.request.request_id for seq in plan.seqs}
        scheduled.update(seq.request.request_id for seq in pending)
        candidates = [r for r in self.queues.running
                      if r.request_id not in scheduled or r is request]
        victim = self.policy.select_victim(victim_candidates(candidates))
        if victim.request_id in scheduled and victim is not request:
            raise RuntimeError("preemption policy chose a request already scheduled this step")
        if any(seq.request is victim for seq in plan.seqs):
            # Swapped out, a table holds only computed tokens, so never more than the chunk it
            # is given after its swap-in.
            for seq in plan.seqs:
                if seq.request is victim:
                    self.kv_cache.trim_slots(seq, max(seq.num_computed_tokens, 1))
            plan.remove_request(victim)
        return victim

    def preempt(self, request: Request, plan: StepPlan) -> None:
        """Take running `request` out: swapped out, or freed and back at the queue's front."""
        queues = self.queues
        seqs = request.unfinished_sequences()
        queues.running.remove(request)
        queues.num_running_seqs -= num_live_samples(request)
        request.num_preemptions += 1
        if self.policy.mode(request, self.kv_cache) == "swap":
            plan.blocks_to_swap_out.extend(self.kv_cache.swap_out(seqs))
            for seq in seqs:
                seq.status = SequenceStatus.SWAPPED
            queues.swapped.append(request)
            plan.preempted_swap.append(request)
        else:
            for seq in seqs:
                self.kv_cache.free(seq)
                seq.num_computed_tokens = 0
                seq.status = SequenceStatus.WAITING
            # Recomputed requests go back to the front: they arrived before anything waiting.
            queues.waiting.appendleft(request)
            plan.preempted_recompute.append(request)

    def swap_in(self, plan: StepPlan, token_budget: int, *, chunked: bool,
                may_admit: Callable[[Request], bool]) -> int:
        """Swap requests back in, oldest first, while the scheduler's `may_admit`, adapters,
        seats and memory allow, scheduling their sequences in the same step; the budget left."""
        queues, kv_cache, lora = self.queues, self.kv_cache, self.lora
        while queues.swapped and token_budget > 0:
            request = queues.swapped[0]
            if not may_admit(request):
                break
            if lora is not None and not lora.fits(request.lora_id):
                break
            seqs = request.unfinished_sequences()
            if queues.num_running_seqs + num_live_samples(request) > self.max_num_seqs:
                break
            if not kv_cache.can_swap_in(seqs):
                break
            plan.blocks_to_swap_in.extend(kv_cache.swap_in(seqs))
            queues.swapped.popleft()
            queues.running.append(request)
            if lora is not None:
                lora.admitted(request.lora_id)
            queues.num_running_seqs += num_live_samples(request)
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
                chunk = prefill_chunk(seq.num_tokens - seq.num_computed_tokens, token_budget,
                                      chunked)
                if chunk <= 0 or not kv_cache.allocate_slots(
                        seq, seq.num_computed_tokens + chunk):
                    continue  # swapped in already; it runs in a later step
                plan.add(seq, chunk)
                token_budget -= chunk
        return token_budget
