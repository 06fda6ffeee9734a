"""Batching schedulers: static, continuous and chunked prefill; priority, shortest job first,
virtual token counter (tenant fairness), earliest deadline first, multi-level feedback queues
and LoRA-adapter affinity on continuous batching."""
from policies.batching.base import BaseScheduler
from policies.batching.chunked_prefill import ChunkedPrefillScheduler
from policies.batching.continuous import ContinuousBatchingScheduler
from policies.batching.edf import EarliestDeadlineFirstScheduler
from policies.batching.lora_affinity import LoRAAffinityScheduler
from policies.batching.mlfq import MLFQScheduler
from policies.batching.priority import PriorityScheduler
from policies.batching.sjf import ShortestJobFirstScheduler
from policies.batching.static import StaticBatchingScheduler
from policies.batching.vtc import VirtualTokenCounterScheduler

__all__ = ["BaseScheduler", "ChunkedPrefillScheduler", "ContinuousBatchingScheduler",
           "EarliestDeadlineFirstScheduler", "LoRAAffinityScheduler", "MLFQScheduler",
           "PriorityScheduler", "ShortestJobFirstScheduler", "StaticBatchingScheduler",
           "VirtualTokenCounterScheduler"]
