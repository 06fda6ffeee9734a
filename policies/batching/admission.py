"""Admission under the step's token budget: a waiting request joins the batch when its seats,
its adapter, its prefill chunks and their blocks all fit."""
from __future__ import annotations

from collections.abc import Callable

from policies.batching.queues import Queues, prefill_chunk
from policies.capabilities import AdmissionCheckingKVCache
from policies.checks import has_capability
from policies.protocols import KVCacheManager, KVRetentionPolicy, LoRAManager
from policies.types import Request, Sequence, SequenceStatus, StepPlan


class Admission:
    """Admits one waiting request at a time into a plan; `short_of_blocks` says whether the last
    refusal was the pool's (else seats, adapters or the budget)."""

    __slots__ = ("queues", "kv_cache", "max_num_seqs", "lora", "kv_retention",
                 "short_of_blocks", "_may_allocate_new", "_num_loaded_prefix_tokens")

    def __init__(self, queues: Queues, kv_cache: KVCacheManager, max_num_seqs: int,
                 lora: LoRAManager | None, kv_retention: KVRetentionPolicy | None,
                 num_loaded_prefix_tokens: Callable[[Sequence], int] | None):
        self.queues = queues
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
        self.lora = lora
        self.kv_retention = kv_retention
        self.short_of_blocks = False
        # A KV manager that can tell an admission's allocation fails before it is tried.
        self._may_allocate_new = (
            kv_cache.may_allocate_new
            if has_capability(kv_cache, AdmissionCheckingKVCache, "kv_cache") else None)
        # A host tier for the prefix cache: the prompt tokens loaded back go into the request.
        self._num_loaded_prefix_tokens = num_loaded_prefix_tokens

    def admit(self, request: Request, plan: StepPlan, token_budget: int, now: float,
              chunked: bool, may_admit: Callable[[Request], bool],
              take_waiting: Callable[[Request], None]) -> int | None:
        """Admit waiting `request` into `plan` if the scheduler's `may_admit`, the seats, its
        adapter, the budget and the pool allow: the budget left, or None (nothing changed)."""
        if not may_admit(request):
            return None
        lora = self.lora
        if lora is not None and not lora.fits(request.lora_id):
            return None   # the batch holds max_loras other adapters: it waits, as for memory
        queues = self.queues
        seqs = request.unfinished_sequences()
        # num_live_samples without a second pass: n less the finished, those not in `seqs`.
        num_live_samples = request.n - len(request.sequences) + len(seqs)
        if queues.num_running_seqs + num_live_samples > self.max_num_seqs:
            return None
        kv_cache = self.kv_cache
        if (self._may_allocate_new is not None and not self._may_allocate_new(
                _uncached_chunks(seqs, token_budget, chunked))):
            self.short_of_blocks = True
            return None   # the allocation below would fail: skip taking and freeing its blocks
        num_cached = [kv_cache.allocate_prefix(seq) for seq in seqs]
        chunks = []
        budget_left = token_budget
        for seq, cached in zip(seqs, num_cached):
            seq.num_computed_tokens = cached
            # The samples of a group (recomputed after preemption) may start in later steps.
            chunk = prefill_chunk(seq.num_tokens - cached, budget_left, chunked)
            chunks.append(chunk)
            budget_left -= chunk
        fits_budget = chunks[0] > 0
        if not fits_budget or not self._allocate_all(seqs, chunks):
            for seq in seqs:
                kv_cache.free(seq)
                seq.num_computed_tokens = 0
            self.short_of_blocks = fits_budget
            return None
        take_waiting(request)
        for seq, chunk in zip(seqs, chunks):
            seq.status = SequenceStatus.RUNNING
            if chunk > 0:
                plan.add(seq, chunk)
        queues.running.append(request)
        queues.num_running_seqs += num_live_samples
        if lora is not None:
            lora.admitted(request.lora_id)
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now
            request.num_cached_tokens = num_cached[0]
            if self._num_loaded_prefix_tokens is not None:
                request.num_host_cached_tokens = self._num_loaded_prefix_tokens(seqs[0])
            if self.kv_retention is not None:
                self.kv_retention.turn_admitted(request, now)
        return budget_left

    def _allocate_all(self, seqs: list[Sequence], chunks: list[int]) -> bool:
        """Slots for every new chunk, keeping the watermark free, all or nothing."""
        for seq, chunk in zip(seqs, chunks):
            if chunk > 0 and not self.kv_cache.allocate_slots(
                    seq, seq.num_computed_tokens + chunk, watermark=True):
                return False
        return True


def _uncached_chunks(seqs: list[Sequence], token_budget: int, chunked: bool) -> list[int]:
    """The nonzero chunks `seqs` would get if nothing were cached (what `may_allocate_new` is
    asked about)."""
    chunks = []
    for seq in seqs:
        chunk = prefill_chunk(seq.num_tokens, token_budget, chunked)
        if chunk > 0:
            chunks.append(chunk)
            token_budget -= chunk
    return chunks
