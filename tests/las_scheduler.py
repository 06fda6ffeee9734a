"""A plug-in written from scratch against `policies.protocols.Scheduler` (no BaseScheduler), as
issue 41's author wrote one: least attained service first, chunked prefill, recompute
preemption. Each step ranks every request by the tokens it has been served so far; a request
short of memory preempts the most-served running ones. Used by tests/test_progress.py: it thrashes,
and the run must show it (complete with its preemptions counted, or stop with the reason)."""
from __future__ import annotations

from policies.types import Sequence, StepPlan


class LeastAttainedService:
    """Least attained service first, chunked prefill, recompute preemption."""

    def __init__(self, kv_cache, preemption=None, max_num_seqs=256, max_num_batched_tokens=512,
                 max_model_len=4096):
        self.kv_cache, self.speculation = kv_cache, None   # it never drafts
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting, self.running = [], []
        self.attained: dict[int, int] = {}                 # request id -> tokens computed

    @property
    def num_outstanding(self):
        return len(self.waiting) + len(self.running)

    def has_unfinished(self):
        return self.num_outstanding > 0

    def queue_lengths(self):
        return len(self.waiting), len(self.running), 0     # waiting, running, swapped

    def add_request(self, request, now):
        if request.n != 1 or not self.kv_cache.can_ever_fit(request.prompt_len + request.output_len):
            request.rejected_reason = "LeastAttainedService runs only n=1 requests that fit"
            return
        request.sequences = [Sequence(request.request_id, request)]
        self.attained[request.request_id] = 0
        self.waiting.append(request)

    def _preempt(self, victim, plan):
        seq = victim.sequences[0]
        self.kv_cache.free(seq)
        seq.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.running.remove(victim)
        self.waiting.append(victim)
        plan.preempted_recompute.append(victim)

    def schedule(self, now):
        plan, kv_cache = StepPlan(block_tables=self.kv_cache.block_tables), self.kv_cache
        budget = self.max_num_batched_tokens
        ranked = sorted(self.running + self.waiting, key=lambda r: self.attained[r.request_id])
        for request in ranked:
            if budget == 0 or request in plan.preempted_recompute:
                continue
            seq = request.sequences[0]
            chunk = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if request not in self.running and len(self.running) >= self.max_num_seqs:
                continue
            # Short of memory: the most-served running requests not yet planned give way.
            planned = {s.seq_id for s in plan.seqs}
            victims = [r for r in reversed(ranked) if r in self.running and r is not request
                       and r.sequences[0].seq_id not in planned]
            while not kv_cache.allocate_slots(seq, seq.num_computed_tokens + chunk):
                if not victims:
                    break
                self._preempt(victims.pop(0), plan)
            else:
                if request not in self.running:
                    self.waiting.remove(request)
                    self.running.append(request)
                    if request.first_scheduled_time is None:
                        request.first_scheduled_time = now
                plan.add(seq, chunk)
                budget -= chunk
        return plan

    def update(self, plan, result, now):
        finished = []
        for seq, num_new in zip(plan.seqs, plan.num_new_tokens):
            request = seq.request
            self.attained[request.request_id] += num_new
            if seq.num_computed_tokens + num_new < seq.num_tokens:
                seq.advance(num_new, 0, now)               # a prefill chunk short of the end
                continue
            new_ids = (result.sampled_token_ids or {}).get(seq.seq_id)   # the engine's tokens
            seq.advance(num_new, len(new_ids) if new_ids else 1, now, new_ids)   # the sim's one
            if request.first_token_time is None:
                request.first_token_time = now
            if (seq.num_output_tokens >= request.output_len
                    or seq.seq_id in (result.stopped_seq_ids or ())):
                self.kv_cache.free(seq)
                request.finish_time = now
                self.running.remove(request)
                del self.attained[request.request_id]
                finished.append(request)
        return finished
