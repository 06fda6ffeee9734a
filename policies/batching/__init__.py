"""Batching schedulers: static, continuous and chunked prefill; priority and shortest job first
on continuous batching."""
from policies.batching.base import BaseScheduler
from policies.batching.chunked_prefill import ChunkedPrefillScheduler
from policies.batching.continuous import ContinuousBatchingScheduler
from policies.batching.priority import PriorityScheduler
from policies.batching.sjf import ShortestJobFirstScheduler
from policies.batching.static import StaticBatchingScheduler

__all__ = ["BaseScheduler", "ChunkedPrefillScheduler", "ContinuousBatchingScheduler",
           "PriorityScheduler", "ShortestJobFirstScheduler", "StaticBatchingScheduler"]
