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
    ids = draw_lora_ids([request.lora_id for request in requests],
                        [request.session_id for request in requests], lora, seed,
                        [request.request_id for request in requests])
    for request, adapter in zip(requests, ids):
        request.lora_id = adapter


def draw_lora_ids(lora_ids: list, session_ids: list, lora: LoRAConfig, seed: int,
                  request_ids: list | None = None) -> list[int]:
    """assign_lora_ids on requests' `lora_ids` (None: none yet) and `session_ids`, given as
    lists: each request's adapter. `request_ids` name them in errors (default: their index)."""
    for index, lora_id in enumerate(lora_ids):
        if lora_id is not None and not 0 <= lora_id < lora.num_adapters:
            request_id = index if request_ids is None else request_ids[index]
            raise ValueError(f"request {request_id}: lora_id={lora_id} is not "
                             f"one of lora.num_adapters={lora.num_adapters} adapters (0 .. "
                             f"{lora.num_adapters - 1})")
    bounds = np.cumsum(lora.popularity_weights())
    uniforms = np.random.default_rng([seed, LORA_STREAM_KEY]).random(len(lora_ids))
    drawn = np.minimum(np.searchsorted(bounds, uniforms, side="right"),
                       lora.num_adapters - 1).tolist()
    by_session: dict = {}
    ids = []
    for lora_id, session_id, adapter in zip(lora_ids, session_ids, drawn):
        if lora_id is None and session_id is not None:
            adapter = by_session.setdefault(session_id, adapter)
        ids.append(adapter if lora_id is None else lora_id)
    return ids
