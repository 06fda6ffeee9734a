"""Pipeline parallelism (`cluster.pipeline_parallel_size`): a replica's layers split into stages,
each on its own GPUs (tensor_parallel_size of them), and a step's cost as micro-batches flow
through the stages.

The stages: vLLM's split (`get_pp_indices`), num_layers // pp layers each and the remainder one
more each on the stages before the last; the first stage also runs the embedding, the last the
final norm, the LM head and sampling. Between stages a point-to-point send of the micro-batch's
activations (hidden states and residual: 2 x tokens x hidden x dtype bytes, each of the tp
ranks sending its 1/tp share over its own link).

The step (a steady-state model; docs/architecture.md, "Pipeline parallelism"): the scheduler
plans one step as now, and it runs as m = min(pp, sequences) micro-batches, each carrying 1/m
of the step's work (vLLM V0's virtual engines, which each schedule a share of the requests; a
sequence is in one micro-batch at a time). Each sequence gets its next token once its
micro-batch is back out of the last stage, and the next micro-batch of the same sequences can
enter the first stage only then, so the step lasts the longer of

    latency     = one micro-batch through every stage: the whole model's step at the
                  micro-batch's size + (pp - 1) sends, and
    throughput  = m micro-batches through the slowest stage: m x (a stage's step at the
                  micro-batch's size + one send);

with m < pp the stages idle for part of the step (the bubble: a lone sequence gains nothing
from pp and pays the sends), with m = pp every stage works all the time. The slowest stage is
taken as the largest one (ceil(L / pp) layers) charged the step's overhead, the embedding, the
LM head and its send, an upper bound by whichever of the LM head and the send its stage skips.
Memory operations (swaps, copies, host-tier moves, LoRA adapter loads) run once per step, every
stage moving its own layers' share of each block or adapter; every micro-batch reads all the
step's adapters.

KV capacity: each GPU holds its stage's layers, so per-GPU KV bytes of a block and weights shrink
by about pp (`stage_model` sizes the pool: the largest stage, counting the embedding and the LM
head both, an upper bound on any stage's weights).
"""
from __future__ import annotations

import dataclasses

from omegaconf import DictConfig

from policies.checks import has_capability
from policies.decode_run import step_times_one_by_one
from policies.protocols import StatesExpectedError
from policies.types import StepPlan
from policies.validators import positive_int
from sim.core.roofline import RooflineCostModel
from sim.core.specs import ModelSpec
from sim.core.speculation_setup import speculation_setup

KEY = "cluster.pipeline_parallel_size"
# Send times precomputed per token count up to here; beyond, linear in tokens.
DENSE_SEND_TOKENS = 8192


def pipeline_parallel_size(cfg: DictConfig, model: ModelSpec, key: str = KEY) -> int:
    """cluster.pipeline_parallel_size (1 when unset), checked against the model and the run;
    errors name `key` (a pool's own setting, where it has one)."""
    stages = positive_int(key, cfg.cluster.get("pipeline_parallel_size", 1))
    if stages == 1:
        return 1
    if stages > model.num_layers:
        raise ValueError(f"{key}={stages} exceeds {model.name}'s num_layers={model.num_layers}: "
                         f"every stage needs at least one layer")
    if cfg.backend.get("executor") is not None:
        raise ValueError(f"{key}={stages}: pipeline parallelism is simulated only "
                         f"(backend=sim); the engine runs the whole model on one device")
    if speculation_setup(cfg) is not None:
        raise ValueError(f"{key}={stages} with speculative decoding (speculation="
                         f"{cfg.speculation.get('draft_model')}): not modelled with pipeline "
                         f"stages; use speculation=none")
    return stages


def stage_layers(num_layers: int, stages: int) -> list[int]:
    """Layers per stage, first to last, as vLLM splits them: num_layers // stages each, the
    remainder one more each on the stages just before the last (which holds the LM head)."""
    per_stage, remainder = divmod(num_layers, stages)
    layers = [per_stage] * stages
    for index in range(stages - 1 - remainder, stages - 1):
        layers[index] += 1
    return layers


def stage_model(model: ModelSpec, stages: int) -> ModelSpec:
    """The shape one GPU holds: the largest stage's layers (the model itself for one stage)."""
    if stages == 1:
        return model
    return dataclasses.replace(model, num_layers=max(stage_layers(model.num_layers, stages)))


def gpu_model(cfg: DictConfig, model: ModelSpec) -> ModelSpec:
    """The shape one GPU of the run holds (what its KV pools are sized from): stage_model at
    cluster.pipeline_parallel_size."""
    return stage_model(model, pipeline_parallel_size(cfg, model))


def pipeline_period_s(latency_s: float, slowest_stage_s: float, num_micro_batches: int) -> float:
    """Seconds between a micro-batch's entries into the first stage when `num_micro_batches`
    circulate, each re-entering once it has left the last stage (its tokens are needed), through
    stages that each work on one at a time: the way through (`latency_s`) or, when the
    micro-batches queue, the slowest stage's work on all of them."""
    return max(latency_s, num_micro_batches * slowest_stage_s)


def _share(value: int, num_micro_batches: int) -> int:
    return -(-value // num_micro_batches)


def micro_batch(plan: StepPlan, num_micro_batches: int, with_memory_ops: bool) -> StepPlan:
    """One of `num_micro_batches` equal shares of the step's work (counts rounded up), with the
    plan's memory operations (block moves, LoRA adapter loads) or without. Every micro-batch
    reads all the step's LoRA adapters (an upper bound: they may fall in fewer)."""
    m = num_micro_batches
    share = StepPlan(
        num_prefill_tokens=_share(plan.num_prefill_tokens, m),
        num_prefill_seqs=_share(plan.num_prefill_seqs, m),
        prefill_attention_work=_share(plan.prefill_attention_work, m),
        prefill_context_tokens=_share(plan.prefill_context_tokens, m),
        sum_squared_prefill_chunks=_share(plan.sum_squared_prefill_chunks, m),
        num_decode_seqs=_share(plan.num_decode_seqs, m),
        decode_context_tokens=_share(plan.decode_context_tokens, m),
        num_loras=plan.num_loras, lora_rank_sum=plan.lora_rank_sum,
        lora_token_rank_sum=_share(plan.lora_token_rank_sum, m))
    if with_memory_ops:
        share.blocks_to_copy, share.blocks_to_swap_out = plan.blocks_to_copy, plan.blocks_to_swap_out
        share.blocks_to_swap_in = plan.blocks_to_swap_in
        share.blocks_to_offload, share.blocks_to_load = plan.blocks_to_offload, plan.blocks_to_load
        share.lora_to_load, share.lora_load_rank_sum = plan.lora_to_load, plan.lora_load_rank_sum
    return share


def _has_memory_ops(plan: StepPlan) -> bool:
    return bool(plan.blocks_to_copy or plan.blocks_to_swap_out or plan.blocks_to_swap_in
                or plan.blocks_to_offload or plan.blocks_to_load or plan.lora_load_rank_sum)


class PipelineCostModel:
    """`step_time(plan)` of a replica of `num_stages` pipeline stages (the module docstring's
    model), from two cost models of the same kind: `whole` (every layer) and `stage` (the
    largest stage's layers), and `send_s_per_tokens[n]`, a stage's send of n tokens'
    activations (linear at `send_slope_s` per token beyond the list; `send_source` says where
    those times come from)."""

    reads_only_aggregates = True

    def __init__(self, whole: RooflineCostModel, stage: RooflineCostModel, num_stages: int,
                 send_s_per_tokens: list[float], send_slope_s: float, send_source: str):
        self.whole, self.stage = whole, stage
        self.num_stages = num_stages
        self._send_s, self._send_slope_s = send_s_per_tokens, send_slope_s
        self.send_source = send_source
        # The run's summary states the kernels' expected error where the base model does.
        self.expected_error_pct = (
            whole.expected_error_pct
            if has_capability(whole, StatesExpectedError, "cost_model") else None)

    def send_s(self, num_tokens: int) -> float:
        """Seconds of one stage's send of `num_tokens` tokens' activations (0 for none)."""
        if num_tokens < len(self._send_s):
            return self._send_s[num_tokens]
        last = len(self._send_s) - 1
        return self._send_s[last] + (num_tokens - last) * self._send_slope_s

    def step_time(self, plan: StepPlan) -> float:
        """Seconds the step takes: the longer of one micro-batch's way through the stages and
        the slowest stage's work on every micro-batch, plus the step's memory operations."""
        num_seqs = plan.num_prefill_seqs + plan.num_decode_seqs
        m = min(self.num_stages, num_seqs) or 1
        micro = micro_batch(plan, m, False)
        send = self.send_s(micro.num_prefill_tokens + micro.num_decode_seqs)
        stage_s = self.stage.step_time(micro)
        time = pipeline_period_s(self.whole.step_time(micro) + (self.num_stages - 1) * send,
                                 stage_s + send, m)
        if _has_memory_ops(plan):
            # What the memory operations add to one stage's step (each stage moves its share).
            time += self.stage.step_time(micro_batch(plan, m, True)) - stage_s
        return time

    def step_work(self, plan: StepPlan) -> tuple[float, float]:
        """(FLOPs, device-memory bytes) of the step on one GPU (the energy meter's input,
        sim/core/energy/work.py): its stage's work on every micro-batch, the memory operations'
        once."""
        m = min(self.num_stages, plan.num_prefill_seqs + plan.num_decode_seqs) or 1
        flops, moved = self.stage.step_work(micro_batch(plan, m, True))
        if m > 1:
            other_flops, other_moved = self.stage.step_work(micro_batch(plan, m, False))
            flops, moved = flops + (m - 1) * other_flops, moved + (m - 1) * other_moved
        return flops, moved

    def repeated_step_times(self, plan: StepPlan, num_steps: int):
        """step_time of the decode batch `plan` over `num_steps` steps, context growing."""
        return step_times_one_by_one(self, plan, num_steps)


def send_bytes_per_token(model: ModelSpec, tensor_parallel_size: int) -> float:
    """Bytes one tp rank sends per token between stages: hidden states and residual, its
    1/tp share (vLLM all-gathers them over the next stage's ranks)."""
    return 2 * model.hidden_size * model.dtype_bytes / tensor_parallel_size


def pipeline_cost_model(whole: RooflineCostModel, stage: RooflineCostModel,
                        num_stages: int) -> PipelineCostModel:
    """The pipeline over `whole` and `stage`: stage sends from the measured NCCL send/recv
    tables for the GPU cost model, else latency + bytes over the interconnect as the roofline
    costs an all-reduce's (allreduce_latency_s, transfer_efficiency)."""
    from sim.gpu.cost_model import GPUCostModel   # (sim/gpu builds on sim/core)

    if not isinstance(whole, RooflineCostModel) or not isinstance(stage, RooflineCostModel):
        raise ValueError(f"{KEY}={num_stages} needs cost_model=roofline or gpu, which cost a "
                         f"stage from its layers; got {type(whole).__name__}")
    per_token = send_bytes_per_token(whole.model, whole.tensor_parallel_size)
    message_bytes = [n * per_token for n in range(DENSE_SEND_TOKENS + 1)]
    if isinstance(whole, GPUCostModel):
        import numpy as np

        from sim.gpu.collectives import send_recv_cost
        cost = send_recv_cost(whole.hardware)
        seconds = cost.seconds(np.asarray(message_bytes[1:])).tolist()
        send_s = [0.0] + seconds
        slope = (seconds[-1] - seconds[len(seconds) // 2 - 1]) / (len(seconds) - len(seconds) // 2)
        source = cost.source
    else:
        rate = whole.hardware.interconnect_bandwidth * whole.transfer_efficiency
        send_s = [0.0] + [whole.allreduce_latency_s + b / rate for b in message_bytes[1:]]
        slope = per_token / rate
        source = (f"roofline: allreduce_latency_s + bytes over interconnect_gbps x "
                  f"transfer_efficiency")
    return PipelineCostModel(whole, stage, num_stages, send_s, slope, source)
