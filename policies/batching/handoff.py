"""Prefill/decode disaggregation's KV hand-off (sim/core/cluster.py): a prefill replica hands
requests over after their first token, a decode replica admits their KV."""
from __future__ import annotations

from collections.abc import Callable

from policies.batching.queues import Queues
from policies.protocols import KVCacheManager, LoRAManager
from policies.types import Request, Sequence, SequenceStatus


class KVHandoff:
    """The requests stopped after their first token whose blocks wait for the KV transfer
    (`handed_off`, until taken) and those whose KV is arriving here (`receiving`)."""

    __slots__ = ("queues", "kv_cache", "handed_off", "receiving")

    def __init__(self, queues: Queues, kv_cache: KVCacheManager):
        self.queues = queues
        self.kv_cache = kv_cache
        self.handed_off: list[Request] = []
        self.receiving: list[Request] = []

    def take(self) -> list[Request]:
        """The requests handed off since the last call; the cluster frees their blocks after
        the KV transfer."""
        handed_off, self.handed_off = self.handed_off, []
        return handed_off

    def admit(self, request: Request, rejection_reason: str | None, max_num_seqs: int,
              lora: LoRAManager | None, lora_holders: Callable[[], list[Request]]) -> bool:
        """BaseScheduler.admit_transfer: receive `request` if it may ever run here (else
        `rejected_reason` set) and a seat, its adapter and blocks are free now."""
        if rejection_reason is None and request.n != 1:
            rejection_reason = f"a KV transfer moves one sequence; n={request.n}"
        if rejection_reason is not None:
            request.rejected_reason = rejection_reason
            return False
        if self.queues.num_running_seqs + 1 > max_num_seqs:
            return False
        if lora is not None:
            lora.track(lora_holders())
            if not lora.fits(request.lora_id):
                return False
        return self.receive(request)

    def receive(self, request: Request) -> bool:
        """Give a request prefilled elsewhere a sequence of this replica's and blocks for the KV
        it computed there (keeping the watermark free); False: no blocks now, nothing changed."""
        source = request.sequences[0]
        # A sequence id of this scheduler's: the block tables are keyed by it.
        seq = self.queues.new_sequence(request, source.num_output_tokens,
                                       None if source.output_token_ids is None
                                       else list(source.output_token_ids))
        seq.num_computed_tokens = source.num_computed_tokens
        seq.last_token_time = source.last_token_time
        if not self.kv_cache.allocate_slots(seq, seq.num_computed_tokens, watermark=True):
            return False
        request.sequences = [seq]
        self.receiving.append(request)
        self.queues.num_running_seqs += 1
        return True

    def arrived(self, request: Request) -> None:
        """The KV of a received request has arrived: it decodes from the next step."""
        self.receiving.remove(request)
        request.sequences[0].status = SequenceStatus.RUNNING
        self.queues.running.append(request)

    def hand_off(self, seq: Sequence) -> None:
        """Stop a request after its first token, its blocks kept for the KV transfer."""
        request = seq.request
        self.queues.running.remove(request)
        self.queues.num_running_seqs -= 1
        seq.status = SequenceStatus.WAITING
        self.handed_off.append(request)
