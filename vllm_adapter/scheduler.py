"""vLLM's V1 scheduler with a twinserve plug-in deciding its order and its victims.

`--scheduler-cls vllm_adapter.scheduler.TwinserveScheduler` (or `LLM(scheduler_cls=...)`), with the
plug-in's config in the TWINSERVE_VLLM_PLUGIN environment variable (twinserve-vllm sets both).
vLLM still plans every step (chunked prefill, its KV cache, its runner); the plug-in, run by
vllm_adapter/host.py over mirrors of vLLM's requests, decides:

- which waiting request vLLM admits next: the waiting queue is the plug-in's `next_waiting`;
- which running request gives way when the KV cache runs out: the plug-in's `_victim_candidates`
  and its preemption policy's `select_victim`, among the running requests vLLM has not yet
  scheduled this step and the one short of memory (the simulator's rule);
- for a plug-in that preempts to admit (PriorityScheduler's `preempt_to_admit`), which running
  request leaves so that a more important waiting one fits;
- how many requests run and how many tokens a step computes at most (its max_num_seqs and
  max_num_batched_tokens, where lower than vLLM's).

Imported only in vLLM's process; it refuses, in one line, a vLLM it was not tested with.
"""
from __future__ import annotations

import logging
import time

import vllm
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import RequestQueue, SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from vllm_adapter import version_refusal
from vllm_adapter.config import build_host, config_from_env

# A child of vLLM's logger, so its lines go where vLLM's go.
logger = logging.getLogger("vllm.twinserve_adapter")


# vLLM's scheduler interface is not public and changes between releases.
if version_refusal(vllm.__version__) is not None:
    raise RuntimeError(f"vllm_adapter: {version_refusal(vllm.__version__)}")


class PluginWaitingQueue(RequestQueue):
    """vLLM's waiting queue in the plug-in's order: its head is the plug-in's `next_waiting`,
    taking it admits the mirror and putting it back un-admits it."""

    def __init__(self, scheduler: "TwinserveScheduler"):
        self._scheduler = scheduler
        self._requests: dict[str, Request] = {}

    @property
    def _host(self):
        return self._scheduler.host

    def add_request(self, request: Request) -> None:
        self._requests[request.request_id] = request

    def peek_request(self) -> Request:
        if not self:
            raise IndexError("peek from an empty queue")
        return self._requests[self._host.next_waiting(time.time())]

    def pop_request(self) -> Request:
        request = self.peek_request()
        del self._requests[request.request_id]
        self._host.admit(request.request_id, time.time())
        return request

    def prepend_request(self, request: Request) -> None:
        self._requests[request.request_id] = request
        if not self._host.is_waiting(request.request_id):   # a skip, not a preemption
            self._host.unadmit(request.request_id, time.time())

    def prepend_requests(self, requests) -> None:
        for request in requests:
            self.prepend_request(request)

    def remove_request(self, request: Request) -> None:
        self._requests.pop(request.request_id, None)

    def remove_requests(self, requests) -> None:
        for request in requests:
            self.remove_request(request)

    def __bool__(self) -> bool:
        # Only what the plug-in queued can be admitted; a refused request waits here until
        # update_from_output finishes it as an error.
        return self._host.num_waiting() > 0

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self):
        ordered = [request_id for request_id in self._host.waiting_ids()
                   if request_id in self._requests]
        refused = [request_id for request_id in self._requests if request_id not in ordered]
        return iter([self._requests[request_id] for request_id in ordered + refused])


class TwinserveScheduler(Scheduler):
    """vLLM's scheduler with a twinserve plug-in's order, victims and limits. vLLM's async
    scheduling gets the same hosting over its AsyncScheduler (TwinserveAsyncScheduler)."""

    def __new__(cls, vllm_config, *args, **kwargs):
        if cls is TwinserveScheduler and vllm_config.scheduler_config.async_scheduling:
            cls = TwinserveAsyncScheduler
        return super().__new__(cls)

    def __init__(self, vllm_config, *args, **kwargs):
        super().__init__(vllm_config, *args, **kwargs)
        if self.policy is not SchedulingPolicy.FCFS:
            raise ValueError(f"--scheduling-policy {self.policy.value}: the twinserve plug-in "
                             f"orders vLLM's queue; leave vLLM's policy at fcfs "
                             f"(scheduler=priority is the plug-in's)")
        self.waiting = PluginWaitingQueue(self)
        self._vllm_limits = self.max_num_active_reqs, self.max_num_scheduled_tokens
        self.use_plugin(config_from_env())
        # vLLM's victim is the last of its running list: the plug-in's is moved there.
        allocate_slots = self.kv_cache_manager.allocate_slots

        def allocate_or_place_victim(request, *args, **kwargs):
            blocks = allocate_slots(request, *args, **kwargs)
            if blocks is None and request.status == RequestStatus.RUNNING:
                self._place_victim(request)
            return blocks

        self.kv_cache_manager.allocate_slots = allocate_or_place_victim
        # Per planned step: (request id, tokens computed before it, tokens it computes).
        self._planned: dict[int, list[tuple[str, int, int]]] = {}
        self._stopped: list[str] | None = None   # the requests finished while an output is read

    def use_plugin(self, config) -> None:
        """Host the plug-in of `config` (vllm_adapter.config.plugin_config's) from now on; only
        while no request is outstanding, since the mirrors live in the plug-in."""
        if self.requests:
            raise RuntimeError("use_plugin: requests are outstanding")
        self.host = build_host(config, block_size=self.block_size,
                               num_blocks=self.cache_config.num_gpu_blocks,
                               max_model_len=self.max_model_len,
                               num_free_blocks=self.kv_cache_manager.block_pool.get_num_free_blocks)
        plugin = self.host.scheduler
        max_num_active_reqs, max_num_scheduled_tokens = self._vllm_limits
        self.max_num_active_reqs = min(max_num_active_reqs, plugin.max_num_seqs)
        self.max_num_scheduled_tokens = max_num_scheduled_tokens
        if config["scheduler"].get("max_num_batched_tokens") is not None:
            self.max_num_scheduled_tokens = min(max_num_scheduled_tokens,
                                                plugin.max_num_batched_tokens)
        logger.info("twinserve plug-in %s with %s in vLLM %s (max_num_seqs %d, token budget %d)",
                    type(plugin).__name__, type(plugin.preemption).__name__, vllm.__version__,
                    self.max_num_active_reqs, self.max_num_scheduled_tokens)

    def _place_victim(self, request: Request) -> None:
        """Move the plug-in's victim, among `request` and the running requests after it (those
        not yet scheduled this step), to the end of the running list, where vLLM takes it."""
        start = self.running.index(request)
        victim_id = self.host.victim([r.request_id for r in self.running[start:]])
        victim = self.requests[victim_id]
        self.running.remove(victim)
        self.running.append(victim)

    def add_request(self, request: Request) -> None:
        if request.request_id not in self.requests:
            sampling = request.sampling_params
            reason = self.host.arrive(
                request.request_id, prompt_len=request.num_prompt_tokens,
                max_tokens=request.max_tokens, arrival_time=request.arrival_time,
                now=time.time(), priority=request.priority,
                extra=sampling.extra_args if sampling is not None else None,
                lora_id=(request.lora_request.lora_int_id - 1
                         if request.lora_request is not None else None))
            if reason is not None:
                logger.warning("twinserve plug-in refused request %s: %s",
                               request.request_id, reason)
                # vLLM's path for finishing a request as an error from inside its scheduler.
                self.grammar_compile_error_reqs.add(request.request_id)
        super().add_request(request)

    def schedule(self, *args, **kwargs):
        now = time.time()
        while (victim_id := self.host.admission_victim(self._head_fits, now)) is not None:
            victim = self.requests[victim_id]
            self.running.remove(victim)
            self._preempt_request(victim, time.monotonic())
        output = super().schedule(*args, **kwargs)
        self._planned[id(output)] = [
            (request_id, self.requests[request_id].num_computed_tokens - num_tokens, num_tokens)
            for request_id, num_tokens in output.num_scheduled_tokens.items()]
        return output

    def _head_fits(self, request_id: str) -> bool:
        """Whether the waiting request could be admitted now: a seat, and free blocks for its
        tokens."""
        request = self.requests[request_id]
        num_blocks = -(-request.num_tokens // self.block_size)
        return (len(self.running) < self.max_num_active_reqs
                and num_blocks <= self.kv_cache_manager.block_pool.get_num_free_blocks())

    def _preempt_request(self, request: Request, timestamp: float,
                         drop_stale_output: bool = False) -> None:
        self.host.preempt(request.request_id, time.time())
        super()._preempt_request(request, timestamp, drop_stale_output)

    def update_from_output(self, scheduler_output, model_runner_output):
        self._stopped = []
        try:
            outputs = super().update_from_output(scheduler_output, model_runner_output)
        finally:
            stopped, self._stopped = self._stopped, None
        rejected = self.host.step_done(self._planned.pop(id(scheduler_output), ()), stopped,
                                       time.time())
        for request_id in rejected:
            logger.warning("twinserve plug-in rejected request %s", request_id)
            self.grammar_compile_error_reqs.add(request_id)
        return outputs

    def _free_request(self, request: Request, delay_free_blocks: bool = False):
        if self._stopped is not None:
            self._stopped.append(request.request_id)
        else:
            self.host.finished(request.request_id, time.time())
        return super()._free_request(request, delay_free_blocks)


class TwinserveAsyncScheduler(TwinserveScheduler, AsyncScheduler):
    """TwinserveScheduler over vLLM's AsyncScheduler, chosen when async scheduling is on."""
