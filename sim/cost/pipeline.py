"""Pipeline parallelism (`cluster.pipeline_parallel_size`): a replica's layers split into stages
as vLLM splits them, and what each stage's share of a step costs (`PipelineCostModel`);
docs/simulator.md, "Pipeline parallelism", says why each term is where it is."""
from __future__ import annotations

import dataclasses

import numpy as np

from policies.checks import has_capability
from policies.protocols import StatesExpectedError
from policies.types import StepPlan
from policies.validators import positive_int
from sim.cost.gpu.collectives import send_recv_cost
from sim.cost.gpu.cost_model import GPUCostModel
from sim.cost.roofline import RooflineCostModel
from sim.cost.token_tables import TABLE_TOKENS, per_token_table
from runtime.specs import ModelSpec

KEY = "cluster.pipeline_parallel_size"


def check_pipeline_parallel_size(stages, model: ModelSpec, key: str = KEY, *,
                                 engine: bool = False, draft_model: str | None = None) -> int:
    """Pipeline stages (`key`, 1 when unset) checked against the model, the backend (`engine`:
    an executor of its own) and speculation (`draft_model`, None without)."""
    stages = positive_int(key, stages)
    if stages == 1:
        return 1
    if stages > model.num_layers:
        raise ValueError(f"{key}={stages} exceeds {model.name}'s num_layers={model.num_layers}: "
                         f"every stage needs at least one layer")
    if engine:
        raise ValueError(f"{key}={stages}: pipeline parallelism is simulated only "
                         f"(backend=sim); the engine runs the whole model on one device")
    if draft_model is not None:
        raise ValueError(f"{key}={stages} with speculative decoding (speculation="
                         f"{draft_model}): not modelled with pipeline stages; use speculation=none")
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
    return stage_shape(model, max(stage_layers(model.num_layers, stages)))


def stage_shape(model: ModelSpec, num_layers: int) -> ModelSpec:
    """`model` cut to `num_layers` layers: what one stage's cost model costs."""
    return dataclasses.replace(model, num_layers=num_layers)


class PipelineCostModel:
    """`stage_times(plan)` from `stages`, the base cost model of each stage's layers first to last,
    and `send_s_per_tokens[n]`, a stage's send of n tokens' activations (linear at
    `send_slope_s` beyond the list)."""

    def __init__(self, stages: list[RooflineCostModel | GPUCostModel],
                 send_s_per_tokens: list[float],
                 send_slope_s: float, send_source: str):
        self.stages = stages
        self.num_stages = len(stages)
        self._send_s, self._send_slope_s = send_s_per_tokens, send_slope_s
        self.send_source = send_source
        # The plan step_time costed last and its stage times (a pipelined replica's executor
        # costs each step once, and the replica's loop runs those times through the stages).
        self.last_plan: StepPlan | None = None
        self.last_stage_times: list[float] = []
        first = stages[0]
        # The run's summary states the kernels' expected error where the base model does.
        self.expected_error_pct = (
            first.expected_error_pct
            if has_capability(first, StatesExpectedError, "cost_model") else None)

    def send_s(self, num_tokens: int) -> float:
        """Seconds of one stage's send of `num_tokens` tokens' activations (0 for none)."""
        if num_tokens < len(self._send_s):
            return self._send_s[num_tokens]
        last = len(self._send_s) - 1
        return self._send_s[last] + (num_tokens - last) * self._send_slope_s

    def stage_times(self, plan: StepPlan) -> list[float]:
        """Seconds each stage, first to last, is busy with the step `plan`: its layers' work and
        memory operations, the first stage's the engine overhead, the last's the LM head, and
        every stage but the last its send; all 0.0 for an empty plan."""
        first, last = self.stages[0], self.stages[-1]
        num_seqs = plan.num_prefill_seqs + plan.num_decode_seqs
        num_tokens = plan.num_prefill_tokens + plan.num_decode_seqs + plan.num_draft_tokens
        overhead_s = first.step_overhead_s + first.per_sequence_overhead_s * num_seqs
        lm_head_s = (last.lm_head_kernels_s(num_seqs + plan.num_draft_tokens)
                     if num_tokens else 0.0)
        send_s = self.send_s(num_tokens)
        times = []
        for index, stage in enumerate(self.stages):
            time = stage.step_time(plan)
            if index:
                time -= overhead_s
            elif time == 0.0:   # nothing to do
                return [0.0] * self.num_stages
            if index < self.num_stages - 1:
                time += send_s - lm_head_s
            times.append(time)
        return times

    def step_time(self, plan: StepPlan) -> float:
        """Seconds the step takes through idle stages (its latency alone; a replica's loop
        runs the stages themselves, sim/core/pipelined_replica.py, reading the stage times
        summed here from `last_stage_times` rather than costing the plan again)."""
        self.last_plan, self.last_stage_times = plan, self.stage_times(plan)
        return sum(self.last_stage_times)


def send_bytes_per_token(model: ModelSpec, tensor_parallel_size: int) -> float:
    """Bytes one tp rank sends per token between stages: hidden states and residual, its
    1/tp share (vLLM all-gathers them over the next stage's ranks)."""
    return 2 * model.hidden_size * model.dtype_bytes / tensor_parallel_size


def pipeline_cost_model(stages: list[RooflineCostModel | GPUCostModel]) -> PipelineCostModel:
    """The pipeline over `stages`, its sends from the NCCL send/recv tables for the GPU cost model,
    else as the roofline costs an all-reduce."""
    first = stages[0]
    if not all(isinstance(stage, (RooflineCostModel, GPUCostModel)) for stage in stages):
        raise ValueError(f"{KEY}={len(stages)} needs cost_model=roofline or gpu, which cost a "
                         f"stage from its layers; got {type(first).__name__}")
    per_token = send_bytes_per_token(first.model, first.tensor_parallel_size)
    message_bytes = [n * per_token for n in range(TABLE_TOKENS + 1)]
    if isinstance(first, GPUCostModel):
        cost = send_recv_cost(first.hardware)
        send_s, slope = per_token_table(cost.seconds(np.asarray(message_bytes[1:])))
        source = cost.source
    else:
        rate = first.hardware.interconnect_bandwidth * first.transfer_efficiency
        send_s = [0.0] + [first.allreduce_latency_s + b / rate for b in message_bytes[1:]]
        slope = per_token / rate
        source = ("roofline: allreduce_latency_s + bytes over interconnect_gbps x "
                  "transfer_efficiency")
    return PipelineCostModel(stages, send_s, slope, source)
