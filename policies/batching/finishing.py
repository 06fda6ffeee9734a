"""The end of a sequence's life in the scheduler: its first token (and the fork of its request's
other samples), its finish, and a request's abort."""
from __future__ import annotations

from typing import Callable

from policies.protocols import KVCacheManager, KVRetentionPolicy
from policies.batching.queues import Queues
from policies.types import Request, Sequence, SequenceStatus, StepResult


class Finishing:
    """Finishes sequences and requests, freeing their blocks (or handing a finished turn to the
    retention policy) and calling the scheduler's `_on_request_finished` hook."""

    __slots__ = ("queues", "kv_cache", "kv_retention", "on_request_finished")

    def __init__(self, queues: Queues, kv_cache: KVCacheManager,
                 kv_retention: KVRetentionPolicy | None,
                 on_request_finished: Callable[[Request], None]):
        self.queues = queues
        self.kv_cache = kv_cache
        self.kv_retention = kv_retention
        self.on_request_finished = on_request_finished

    def first_tokens(self, seq: Sequence, result: StepResult, now: float,
                     finished_requests: list[Request]) -> None:
        """Stamp the time to first token and, for n > 1, fork the other samples."""
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
            self.on_request_finished(request)
            return True
        return False

    def abort(self, request: Request, now: float) -> None:
        """Drop unfinished `request` at `now`, giving back its blocks and seats as a finish does."""
        queues = self.queues
        if request in queues.running:
            # An unforked request with n > 1 holds seats for all its samples.
            unstarted_samples = request.n - len(request.sequences)
            for seq in request.unfinished_sequences():
                self.finish_sequence(seq, now)
            queues.num_running_seqs -= unstarted_samples
            request.finish_time = None   # finish_sequence stamped it, but it did not finish
        else:
            queue = queues.swapped if request in queues.swapped else queues.waiting
            if request in queue:
                queue.remove(request)
            for seq in request.unfinished_sequences():
                self.kv_cache.free(seq)
                seq.status = SequenceStatus.FINISHED
            # Static batching waits for every member of its batch, a preempted one too.
            self.on_request_finished(request)
        request.abandoned_time = now

    def _fork(self, parent: Sequence, result: StepResult, now: float) -> list[Sequence]:
        """Fork the n - 1 other samples from the first, sharing its prompt blocks (a child that
        gets none recomputes them later). Returns the children."""
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
