"""Which LoRA adapter each request runs with, drawn by popularity; a session's turns share one,
since a chat or an agent is served by one fine-tune."""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from policies.lora.spec import LoRAConfig
from policies.types import Request

# A generator of its own, so turning LoRA on leaves every other draw as it was.
LORA_STREAM_KEY = 0x10_4A


def assign_lora_ids(requests: Iterable[Request], lora: LoRAConfig | None, seed: int) -> None:
    """Set `lora_id` of each request that has none, and check the ones a trace set."""
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
    """assign_lora_ids on lists of `lora_ids` and `session_ids`: each request's adapter."""
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
