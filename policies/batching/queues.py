"""The scheduler's queues: where each request is, and the seats (sequences) the running hold."""
from __future__ import annotations

from collections import deque

from policies.types import Request, Sequence, SequenceStatus


class Queues:
    """Waiting, running (in admission order: the last is preempted first) and swapped-out
    requests, the seats the running ones hold and the next sequence id."""

    __slots__ = ("waiting", "running", "swapped", "num_running_seqs", "_next_seq_id")

    def __init__(self):
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        # An unforked request with n > 1 holds n seats, so its samples never pass max_num_seqs.
        self.num_running_seqs = 0
        self._next_seq_id = 0

    def new_sequence(self, request: Request, num_output_tokens: int = 0,
                     output_token_ids: list[int] | None = None) -> Sequence:
        seq = Sequence(self._next_seq_id, request, num_output_tokens, output_token_ids)
        self._next_seq_id += 1
        return seq

    def take_waiting(self, request: Request) -> None:
        if self.waiting[0] is request:
            self.waiting.popleft()
        else:
            self.waiting.remove(request)


def num_live_samples(request: Request) -> int:
    """The seats a request holds while running: its samples not finished."""
    return request.n - [seq.status for seq in request.sequences].count(SequenceStatus.FINISHED)


def prefill_chunk(need: int, token_budget: int, chunked: bool) -> int:
    """Tokens of a sequence's `need` to compute this step; unchunked, a prefill runs whole or
    waits (0)."""
    if chunked:
        return min(need, token_budget)
    return need if need <= token_budget else 0
