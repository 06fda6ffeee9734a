"""BaseScheduler's preemption and swap-in: which running request gives way when memory runs out,
how, and how swapped requests come back."""
from __future__ import annotations

from policies.types import Request, Sequence, SequenceStatus, StepPlan


class PreemptionAndSwap:
    """BaseScheduler's `_preempt_for`, `_victim_candidates`, `_preempt` and `_swap_in`, on its
    queues, its KV manager and its PreemptionPolicy."""

    def _preempt_for(self, request: Request, plan: StepPlan, pending: list[Sequence]) -> Request:
        """Preempt and return the policy's victim among the running requests not yet scheduled
        this step (or `request`); `pending`: decodes given slots but not yet in the plan."""
        scheduled = {seq.request.request_id for seq in plan.seqs}
        scheduled.update(seq.request.request_id for seq in pending)
        candidates = [r for r in self.running if r.request_id not in scheduled or r is request]
        victim = self.preemption.select_victim(self._victim_candidates(candidates))
        if victim.request_id in scheduled and victim is not request:
            raise RuntimeError("preemption policy chose a request already scheduled this step")
        if any(seq.request is victim for seq in plan.seqs):
            # Its samples' slots of this step go back first, so a swapped-out table holds only
            # computed tokens.
            for seq in plan.seqs:
                if seq.request is victim:
                    self.kv_cache.trim_slots(seq, max(seq.num_computed_tokens, 1))
            plan.remove_request(victim)
        self._preempt(victim, plan)
        return victim

    def _victim_candidates(self, candidates: list[Request]) -> list[Request]:
        """Hook: the requests the preemption policy may pick its victim among."""
        return candidates

    @staticmethod
    def _highest(candidates: list[Request], key) -> list[Request]:
        """The candidates with the highest `key` (the least favoured, for _victim_candidates)."""
        keys = [key(request) for request in candidates]
        highest = max(keys)
        return [request for request, value in zip(candidates, keys) if value == highest]

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        seqs = request.unfinished_sequences()
        self.running.remove(request)
        self.num_running_seqs -= self._num_live_samples(request)
        if self.lora is not None:
            self.lora.track(self._lora_holders())
        request.num_preemptions += 1
        if self.preemption.mode(request, self.kv_cache) == "swap":
            plan.blocks_to_swap_out.extend(self.kv_cache.swap_out(seqs))
            for seq in seqs:
                seq.status = SequenceStatus.SWAPPED
            self.swapped.append(request)
            plan.preempted_swap.append(request)
        else:
            for seq in seqs:
                self.kv_cache.free(seq)
                seq.num_computed_tokens = 0
                seq.status = SequenceStatus.WAITING
            # To the front, since they arrived before anything waiting.
            self.waiting.appendleft(request)
            plan.preempted_recompute.append(request)

    def _swap_in(self, plan: StepPlan, token_budget: int, *, chunked: bool) -> int:
        """Swap requests back in, oldest first, and schedule them in the same step."""
        while self.swapped and token_budget > 0:
            request = self.swapped[0]
            if not self._may_admit(request):
                break
            if self.lora is not None and not self.lora.fits(request.lora_id):
                break
            seqs = request.unfinished_sequences()
            if self.num_running_seqs + self._num_live_samples(request) > self.max_num_seqs:
                break
            if not self.kv_cache.can_swap_in(seqs):
                break
            plan.blocks_to_swap_in.extend(self.kv_cache.swap_in(seqs))
            self.swapped.popleft()
            self.running.append(request)
            if self.lora is not None:
                self.lora.admitted(request.lora_id)
            self.num_running_seqs += self._num_live_samples(request)
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
                chunk = self._chunk(seq.num_tokens - seq.num_computed_tokens, token_budget,
                                    chunked)
                if chunk <= 0 or not self.kv_cache.allocate_slots(
                        seq, seq.num_computed_tokens + chunk):
                    continue  # swapped in already; it runs in a later step
                plan.add(seq, chunk)
                token_budget -= chunk
        return token_budget
