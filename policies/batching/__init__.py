"""Batching schedulers: static, continuous and chunked prefill."""
from policies.batching.base import BaseScheduler
from policies.batching.chunked_prefill import ChunkedPrefillScheduler
from policies.batching.continuous import ContinuousBatchingScheduler
from policies.batching.static import StaticBatchingScheduler

__all__ = ["BaseScheduler", "ChunkedPrefillScheduler", "ContinuousBatchingScheduler",
           "StaticBatchingScheduler"]
