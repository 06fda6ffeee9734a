"""Prefill/decode disaggregation's part of BaseScheduler (sim/core/cluster.py): a prefill
replica hands requests over after their first token, a decode replica admits their KV."""
from __future__ import annotations

from policies.types import Request, Sequence, SequenceStatus


class KVHandoff:
    """BaseScheduler's `take_handoffs`, `admit_transfer` and `finish_transfer` (the optional
    disaggregation members of policies/protocols.py), on its queues."""

    def take_handoffs(self) -> list[Request]:
        """The requests stopped after their first token (`Request.handoff`) since the last call;
        their blocks stay allocated until the cluster frees them after the KV transfer."""
        handed_off, self.handed_off = self.handed_off, []
        return handed_off

    def admit_transfer(self, request: Request, now: float) -> bool:
        """Give a request prefilled elsewhere a sequence and blocks here so its KV can arrive;
        False when there is no room now (with `rejected_reason` set if there never will be)."""
        reason = self._rejection_reason(request)
        if reason is not None:
            request.rejected_reason = reason
            return False
        if request.n != 1:
            request.rejected_reason = f"a KV transfer moves one sequence; n={request.n}"
            return False
        if self.num_running_seqs + 1 > self.max_num_seqs:
            return False
        if self.lora is not None:
            self.lora.track(self._lora_holders())
            if not self.lora.fits(request.lora_id):
                return False
        source = request.sequences[0]
        # A sequence id of this scheduler's, since the block tables are keyed by it.
        seq = self._new_sequence(request, source.num_output_tokens,
                                 None if source.output_token_ids is None
                                 else list(source.output_token_ids))
        seq.num_computed_tokens = source.num_computed_tokens
        seq.last_token_time = source.last_token_time
        if not self.kv_cache.allocate_slots(seq, seq.num_computed_tokens, watermark=True):
            return False
        request.sequences = [seq]
        self.receiving.append(request)
        self.num_running_seqs += 1
        return True

    def finish_transfer(self, request: Request, now: float) -> None:
        """The KV of a request admitted by admit_transfer has arrived: it decodes from now on."""
        self.receiving.remove(request)
        request.sequences[0].status = SequenceStatus.RUNNING
        self.running.append(request)

    def _hand_off(self, seq: Sequence) -> None:
        """Stop a request after its first token, its blocks kept for the KV transfer."""
        request = seq.request
        self.running.remove(request)
        self.num_running_seqs -= 1
        seq.status = SequenceStatus.WAITING
        self.handed_off.append(request)
