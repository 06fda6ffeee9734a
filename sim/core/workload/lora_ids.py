"""Which LoRA adapter each request of a workload runs with (`Request.lora_id`), drawn from the
`lora` group's popularity over its adapters (policies/lora/spec.py). A session's turns share one
adapter (a chat or an agent is served by one fine-tune); a trace's `lora_id` column, where a row
has one, is kept. With LoRA off nothing is drawn and no request changes."""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from policies.lora.spec import LoRAConfig
from policies.types import Request

# The adapter draws' own generator, apart from the workload's streams, so turning LoRA on leaves
# every other draw of the workload as it was.
LORA_STREAM_KEY = 0x10_4A


def assign_lora_ids(requests: Iterable[Request], lora: LoRAConfig | None, seed: int) -> None:
    """Set `lora_id` of each request that has none, in order, from the popularity (inverse CDF on
    one uniform per request or session); check the ones a trace set against the adapter count."""
    if lora is None:
        return
    requests = list(requests)
    for request in requests:
        if request.lora_id is not None and not 0 <= request.lora_id < lora.num_adapters:
            raise ValueError(f"request {request.request_id}: lora_id={request.lora_id} is not "
                             f"one of lora.num_adapters={lora.num_adapters} adapters (0 .. "
                             f"{lora.num_adapters - 1})")
    bounds = np.cumsum(lora.popularity_weights())
    uniforms = np.random.default_rng([seed, LORA_STREAM_KEY]).random(len(requests))
    drawn = np.minimum(np.searchsorted(bounds, uniforms, side="right"),
                       lora.num_adapters - 1).tolist()
    by_session: dict = {}
    for request, adapter in zip(requests, drawn):
        if request.lora_id is not None:
            continue
        if request.session_id is not None:
            adapter = by_session.setdefault(request.session_id, adapter)
        request.lora_id = adapter
