"""Built-in disaggregation policies (`cluster.disaggregate`): whether a request runs its prefill
and its decode on separate pools, with a KV transfer between them, or colocated on one replica."""
from __future__ import annotations

from typing import Mapping, Sequence as Seq

from policies.protocols import ReplicaView
from policies.types import Request
from policies.validators import positive_int


class AlwaysDisaggregate:
    def disaggregate(self, request: Request, pools: Mapping[str, Seq[ReplicaView]]) -> bool:
        return True


class NeverDisaggregate:
    def disaggregate(self, request: Request, pools: Mapping[str, Seq[ReplicaView]]) -> bool:
        return False


class LongPromptsDisaggregate:
    """Disaggregate prompts of at least `min_prompt_len` tokens: a short prompt's prefill barely
    stalls the decodes beside it, and its transfer would cost more than it saves."""

    def __init__(self, min_prompt_len: int = 1024):
        self.min_prompt_len = positive_int("cluster.disaggregate.min_prompt_len", min_prompt_len)

    def disaggregate(self, request: Request, pools: Mapping[str, Seq[ReplicaView]]) -> bool:
        return request.prompt_len >= self.min_prompt_len
