"""Prefill/decode disaggregation on the engine: a prefill and a decode replica of one model in one
process, each with its own scheduler and device KV pool, taking turns a step each; the hand-off is
the simulator's (runtime/handoff.py), the KV copied between the pools' blocks and timed.

    llm = DisaggregatedLLM("tiny-llama", num_gpu_blocks=64, decode_num_gpu_blocks=32)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32))
    llm.last_transfers      # one KVTransfer per request moved: tokens, bytes, measured seconds
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, replace

import torch

from engine.builder import build_scheduler, build_scheduler_executor, names_a_policy
from engine.kv_cache import KVCachePool
from engine.llm import LLM, RequestOutput
from policies.types import Request, Sequence
from runtime.handoff import Handoff, admit_handoffs, land, take_handoffs
from runtime.metrics import MetricsCollector, StepRecorder
from runtime.step import StepLoop

PREFILL_REPLICA, DECODE_REPLICA = 0, 1


@dataclass
class KVTransfer:
    """One request's KV moved from the prefill pool to the decode pool."""

    request_id: int
    num_tokens: int
    num_bytes: int
    seconds: float     # the copy, measured (synchronised on CUDA)


def copy_kv_blocks(source: KVCachePool, source_blocks: list[int], destination: KVCachePool,
                   destination_blocks: list[int]) -> int:
    """Copy the K/V of `source_blocks` of one pool into `destination_blocks` of another, every
    layer (the kernels' swap transfer); returns the bytes copied."""
    if len(source_blocks) != len(destination_blocks):
        raise ValueError(f"{len(source_blocks)} source blocks for {len(destination_blocks)} "
                         f"destination blocks")
    if source.block_size != destination.block_size:
        raise ValueError(f"block sizes differ: {source.block_size} and {destination.block_size}")
    pairs = torch.tensor(list(zip(source_blocks, destination_blocks)), dtype=torch.int64)
    num_bytes = 0
    for source_cache, destination_cache in zip(source.device_caches, destination.device_caches,
                                               strict=True):
        destination.ops.swap_blocks(source_cache, destination_cache, pairs)
        num_bytes += len(source_blocks) * source_cache[:, 0].numel() * source_cache.element_size()
    return num_bytes


class DisaggregatedLLM(LLM):
    def __init__(self, model: str = "tiny-llama", decode_num_gpu_blocks: int | None = None,
                 **kwargs):
        """LLM's arguments, for both replicas; `decode_num_gpu_blocks` sizes the decode replica's
        pool (None: as the prefill's). No speculative decoding."""
        if kwargs.get("speculative_model") is not None:
            raise ValueError("DisaggregatedLLM does not speculate: leave speculative_model unset")
        if kwargs.get("lora") is not None:
            raise ValueError("DisaggregatedLLM does not serve LoRA adapters: leave lora unset")
        super().__init__(model, **kwargs)
        if not names_a_policy(self.config.scheduler) or not names_a_policy(
                self.config.preemption):
            raise ValueError("DisaggregatedLLM builds a scheduler per replica: name the "
                             "scheduler and preemption policies (a conf/ name, a dotted class "
                             "path or a mapping), not objects")
        decode_config = self.config
        if decode_num_gpu_blocks is not None:
            decode_config = replace(self.config, num_gpu_blocks=decode_num_gpu_blocks)
        self.decode_scheduler = build_scheduler(decode_config, self.loaded, self.device,
                                                self.max_model_len)
        # The same model object (its weights once in memory), a pool of its own.
        self.decode_executor = build_scheduler_executor(decode_config, self.loaded,
                                                        self.decode_scheduler, self.device)
        self.last_transfers: list[KVTransfer] = []

    def _make_request(self, prompt, params, priority: int = 0, lora_id: int | None = None,
                      timeout_s: float | None = None):
        if timeout_s is not None:   # (the simulator refuses deadlines with pools too)
            output, _ = super()._make_request(prompt, params, priority, lora_id)
            output.error = "timeout_s: a prefill/decode pair does not abandon requests"
            return output, None
        output, request = super()._make_request(prompt, params, priority, lora_id)
        if request is not None and request.n == 1:
            request.handoff = True   # n > 1 runs whole on the prefill replica
        return output, request

    def _run(self, requests: dict[int, tuple[Request, RequestOutput]], use_tqdm: bool) -> None:
        prefill, decode = self.scheduler, self.decode_scheduler
        metrics = MetricsCollector()
        prefill_steps = StepLoop(prefill, self.executor, StepRecorder(metrics, PREFILL_REPLICA),
                                 self.predictor)
        decode_steps = StepLoop(decode, self.decode_executor,
                                StepRecorder(metrics, DECODE_REPLICA), self.predictor)
        stopped: set[Sequence] = set()
        handoffs: deque[Handoff] = deque()   # waiting for the decode replica
        self.last_transfers = []
        start = time.perf_counter()
        while prefill.has_unfinished() or decode.has_unfinished() or handoffs:
            if prefill.has_unfinished():
                # Its blocks held for waiting hand-offs may keep it from planning: it waits.
                self._step(prefill_steps, stopped, may_idle=bool(handoffs))
                handoffs.extend(take_handoffs(prefill))
            admit_handoffs(handoffs, decode, self._now(), self._copy)
            if decode.has_unfinished():
                self._step(decode_steps, stopped)
        self._fill_outputs(requests, stopped, metrics, time.perf_counter() - start)

    def _copy(self, handoff: Handoff) -> None:
        """Copy an admitted hand-off's KV into the decode replica's blocks, timed; it decodes
        from the decode replica's next step."""
        request, source = handoff.request, handoff.source_seq
        prefill_kv, decode_kv = self.scheduler.kv_cache, self.decode_scheduler.kv_cache
        num_tokens = source.num_computed_tokens
        num_blocks = -(-num_tokens // prefill_kv.block_size)
        copy_start = time.perf_counter()
        num_bytes = copy_kv_blocks(
            self.executor.pool, prefill_kv.block_tables[source.seq_id][:num_blocks],
            self.decode_executor.pool,
            decode_kv.block_tables[request.sequences[0].seq_id][:num_blocks])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last_transfers.append(KVTransfer(request.request_id, num_tokens, num_bytes,
                                              time.perf_counter() - copy_start))
        land(handoff, self.decode_scheduler, DECODE_REPLICA, self._now())
