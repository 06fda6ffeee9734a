"""GPUCostModel: a step's duration as a sum of terms, each fitted to the GPU measurement that
determines it (data/gpu/), with the engine's own costs as a few named, fittable terms. Every term
is a precomputed list per token count, so a step costs O(1); docs/gpu-cost-model.md gives the
formula and where each term comes from."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from policies import validators
from policies.lora.spec import LoRASpec
from policies.types import StepPlan
from runtime.specs import HardwareSpec, ModelSpec
from sim.core.say_once import say_once
from sim.cost.experts import ExpertLayout, check_expert_parallel_size
from sim.cost.roofline import (efficiency, hardware_spec, model_spec, roofline_drafting,
                               roofline_overheads)
from sim.cost.terms_file import with_fitted_terms
from sim.cost.token_tables import TABLE_TOKENS, per_token_table
from sim.cost.work import ModelStepWork
from sim.cost.gpu.attention import attention_cost
from sim.cost.gpu.collectives import allreduce_cost
from sim.cost.gpu.cuda_graphs import padded_index
from sim.cost.gpu.experts import MLP_OPS, ExpertKernels
from sim.cost.gpu.linear import (covering_tables, describe_transfer, nearest_op_table,
                                 predict_layer_ms, predict_lm_head_ms, predict_step_ops_ms)
from sim.cost.gpu.tables import LAYER_OPS, LayerShape, attention_tables
from sim.cost.gpu.engine_terms import engine_terms
from sim.cost.gpu.expected_errors import expected_errors_for, kind_of
from sim.cost.gpu.transfer_errors import expected_errors
from sim.cost.gpu.vllm_kernels import VllmKernels
from sim.cost.gpu.term_sources import term_sources
from sim.cost.gpu.vllm_tables import NoKernelTables, resolve_version, runs_v1_engine

# Where the kernels come from: vLLM's own per version (aiconfigurator), or Vidur's profiles.
KERNEL_TABLES = ("vllm", "vidur")


def _routing_exponent(routing) -> float:
    """cost_model.routing as a Zipf exponent (uniform or a histogram: 0, balanced)."""
    if routing == "skewed":
        return 1.0
    if isinstance(routing, Mapping):
        return float(routing.get("skewed", 0.0))
    return 0.0


class GPUCostModel:
    """Predicts `step_time(plan)` in seconds for `model` on `tensor_parallel_size` GPUs of
    `hardware` from measured operator, attention and NCCL tables. `twinserve-calibrate` fits
    step_overhead_s, per_sequence_overhead_s and eager_launch_overhead_s_per_layer."""

    costs_repeated_steps = True   # step_time reads the plan's features, never its sequences

    def __init__(self, model: ModelSpec | Mapping, hardware: HardwareSpec | Mapping,
                 tensor_parallel_size: int = 1,
                 block_size: int = 16,
                 step_overhead_s: float | None = None,
                 per_sequence_overhead_s: float | None = None,
                 eager_launch_overhead_s_per_layer: float = 6e-5,
                 cuda_graph_max_tokens: int = 512,
                 attention_backend: str = "FLASH_ATTENTION",
                 workstation_bandwidth_efficiency: float = 1.0,
                 terms_file: str | None = None,
                 engine_version: str | None = None,
                 kernel_tables: str = "vllm",
                 compute_efficiency: float = 0.55,
                 memory_efficiency: float = 0.85,
                 transfer_efficiency: float = 0.75,
                 draft_model: ModelSpec | Mapping | str | None = None,
                 draft_step_overhead_s: float = 3e-4,
                 ngram_overhead_s_per_seq: float = 20e-6,
                 medusa_num_heads: int = 4,
                 offload_bandwidth_gbps: float | None = None,
                 routing="uniform",
                 expert_parallel_size: int = 1,
                 lora: LoRASpec | Mapping | None = None):
        # Hardware no table covers fails first: the roofline the run falls back to reads the
        # terms file, which may be the roofline's.
        self.hardware = hardware_spec(hardware)
        covering_tables(self.hardware, key=f"hardware={self.hardware.name}")
        self.terms_file = terms_file
        self._set_engine_terms(engine_version, step_overhead_s, per_sequence_overhead_s,
                               eager_launch_overhead_s_per_layer,
                               workstation_bandwidth_efficiency, cuda_graph_max_tokens,
                               attention_backend, kernel_tables)
        self.model = model_spec(model)
        self.model.check_tensor_parallel_size(tensor_parallel_size)
        self.tensor_parallel_size = tensor_parallel_size
        self.block_size = validators.positive_int("GPUCostModel.block_size", block_size)
        self.routing = routing
        self._set_spec_sheet_parts(
            dict(compute_efficiency=compute_efficiency, memory_efficiency=memory_efficiency,
                 transfer_efficiency=transfer_efficiency), draft_model, draft_step_overhead_s,
            ngram_overhead_s_per_seq, medusa_num_heads, expert_parallel_size)
        shape = LayerShape.of_model(self.model)
        self.op_table = nearest_op_table(self.hardware, shape, tensor_parallel_size,
                                         key=f"hardware={self.hardware.name}")
        self.linear_transfer_kind, linear_source = describe_transfer(
            self.op_table, self.hardware, shape, tensor_parallel_size)
        # The kernels run at a workstation board's achieved rates, the adapters' matmuls too.
        hw = self.achieved_rates(self.hardware)
        self.overheads = roofline_overheads(
            self.model, self.hardware, tensor_parallel_size, self.block_size,
            self.step_overhead_s, self.per_sequence_overhead_s, self.memory_efficiency,
            self.transfer_efficiency, offload_bandwidth_gbps, lora,
            (hw.peak_flops, hw.memory_bandwidth))
        tokens = np.arange(1, TABLE_TOKENS + 1, dtype=float)
        terms = self._vllm_tables(tokens, engine_version) if kernel_tables == "vllm" else None
        if kernel_tables != "vllm":
            self.kernel_source = "Vidur/Frontier operator tables (cost_model.kernel_tables=vidur)"
        if terms is None:
            terms = self._vidur_tables(tokens, hw, shape)
        self._set_tables(*terms)
        self._set_expected_errors()
        self._sources = term_sources(self, linear_source)
        # Bound once: step_time runs every step, and the energy meter asks each step's work
        # (policies.protocols.StepWorkCostModel, DecodeWorkCostModel).
        self._step_start = self.overheads.step_start
        self._repeated_start = self.overheads.repeated_start
        self.step_work, self.decode_work_terms = (self.work.step_work,
                                                  self.work.decode_work_terms)

    def _set_spec_sheet_parts(self, efficiencies: dict, draft_model, draft_step_overhead_s,
                              ngram_overhead_s_per_seq, medusa_num_heads,
                              expert_parallel_size) -> None:
        """What costs as the roofline's, at `efficiencies` of the spec-sheet rates: drafting, a
        mixture's expert layout and the steps' work."""
        m, hw, tp = self.model, self.hardware, self.tensor_parallel_size
        for name, value in efficiencies.items():
            setattr(self, name, efficiency(name, value))
        self.draft_model = (model_spec(draft_model) if isinstance(draft_model, Mapping)
                            else draft_model)
        self.drafting = roofline_drafting(
            m, hw, self.block_size, draft_model, draft_step_overhead_s, ngram_overhead_s_per_seq,
            medusa_num_heads, hw.peak_flops * self.compute_efficiency,
            hw.memory_bandwidth * self.memory_efficiency, efficiencies)
        check_expert_parallel_size(m, expert_parallel_size, tp)
        self.expert_layout = (ExpertLayout.of(m, self.routing, tp, expert_parallel_size)
                              if m.is_moe else None)
        self.work = ModelStepWork(m, tp, self.block_size, self.expert_layout)

    def _set_engine_terms(self, engine_version, step_overhead_s, per_sequence_overhead_s,
                          eager_launch_overhead_s_per_layer, workstation_bandwidth_efficiency,
                          cuda_graph_max_tokens, attention_backend, kernel_tables) -> None:
        """The engine's own terms (the version's fitted ones where not given, a terms file's
        over both) and settings, checked."""
        owner = "GPUCostModel"
        version_terms, self.engine_terms_source = engine_terms(engine_version)
        terms = with_fitted_terms(
            "gpu", self.terms_file,
            step_overhead_s=(version_terms["step_overhead_s"] if step_overhead_s is None
                             else step_overhead_s),
            per_sequence_overhead_s=(version_terms["per_sequence_overhead_s"]
                                     if per_sequence_overhead_s is None
                                     else per_sequence_overhead_s),
            eager_launch_overhead_s_per_layer=eager_launch_overhead_s_per_layer,
            workstation_bandwidth_efficiency=workstation_bandwidth_efficiency)
        self.workstation_bandwidth_efficiency = float(validators.positive_number(
            f"{owner}.workstation_bandwidth_efficiency", terms["workstation_bandwidth_efficiency"]))
        self.step_overhead_s = float(validators.non_negative_number(
            f"{owner}.step_overhead_s", terms["step_overhead_s"]))
        self.per_sequence_overhead_s = float(validators.non_negative_number(
            f"{owner}.per_sequence_overhead_s", terms["per_sequence_overhead_s"]))
        self.eager_launch_overhead_s_per_layer = float(validators.non_negative_number(
            f"{owner}.eager_launch_overhead_s_per_layer",
            terms["eager_launch_overhead_s_per_layer"]))
        self.cuda_graph_max_tokens = int(validators.number_in(
            f"{owner}.cuda_graph_max_tokens", validators.non_negative_int(
                f"{owner}.cuda_graph_max_tokens", cuda_graph_max_tokens), 0, TABLE_TOKENS))
        backends = sorted({t.backend for t in attention_tables()})
        if attention_backend not in backends:
            raise ValueError(f"{owner}.attention_backend must be one of {backends}, "
                             f"got {attention_backend!r}")
        self.attention_backend = attention_backend
        if kernel_tables not in KERNEL_TABLES:
            raise ValueError(f"{owner}.kernel_tables must be one of {list(KERNEL_TABLES)}, "
                             f"got {kernel_tables!r}")

    def _vllm_tables(self, tokens: np.ndarray, engine_version: str | None):
        """_set_tables' terms from vLLM's kernel tables, and their sources; None where a table
        lacks a kernel (e.g. an fp8 KV cache on the A100): the Vidur tables stand in."""
        self.kernels = None
        try:
            system, version, self.kernel_source = resolve_version(self.hardware.name,
                                                                  engine_version)
            self.kernels = self._vllm_kernels(system, version, runs_v1_engine(engine_version))
            forward_ms, lm_head_ms, attention, decode_grid = self._vllm_terms(tokens)
        except NoKernelTables as missing:
            self.kernels = None
            self.kernel_source = f"Vidur/Frontier operator tables ({missing})"
            say_once(f"twinserve: {missing}; cost_model=gpu uses the Vidur/Frontier operator "
                     f"tables (cost_model.kernel_tables=vidur)")
            return None
        m, k, tp = self.model, self.kernels, self.tensor_parallel_size
        self.kernels_used = f"vLLM {version} on {system}"
        self._allreduce_source = ("none (tensor_parallel_size 1)" if tp == 1 else
                                  f"{system} vLLM {version} custom all-reduce (CUDA graph up to "
                                  f"{self.cuda_graph_max_tokens} tokens, eager beyond), NCCL "
                                  f"past its size limit")
        self._linear_source = (f"{self.kernel_source}: QKV, O, gate+up, down GEMMs "
                               f"({k.gemm_dtype})" + (", router + fused MoE" if m.is_moe else "")
                               + f" at the tp={tp} shard; norms, rope, act, add from "
                               f"{self.op_table.name} by bytes")
        return forward_ms, lm_head_ms, attention, decode_grid

    def _vidur_tables(self, tokens: np.ndarray, hw: HardwareSpec, shape: LayerShape):
        """_set_tables' terms from the Vidur/Frontier operator, attention and NCCL tables."""
        m, tp, layers = self.model, self.tensor_parallel_size, self.model.num_layers
        self.kernels, self.kernels_used, self._linear_source = None, "Vidur/Frontier tables", None
        self._expert_kernels = None
        if m.is_moe:   # the expert kernels replace the dense MLP's (sim/cost/gpu/experts.py)
            self._expert_kernels = ExpertKernels(self.op_table, hw, self.expert_layout, shape)
            forward_ms = layers * (self._expert_kernels.layer_ms(tokens) + predict_layer_ms(
                self.op_table, tokens, hw, shape, tp, m.dtype_bytes,
                ops=tuple(op for op in LAYER_OPS if op not in MLP_OPS)))
        else:
            forward_ms = layers * predict_layer_ms(self.op_table, tokens, hw, shape, tp,
                                                   m.dtype_bytes)
        forward_ms += predict_step_ops_ms(self.op_table, tokens, hw, shape, tp, m.dtype_bytes)
        self._allreduce_source = "none (tensor_parallel_size 1)"
        if tp > 1:
            allreduce = allreduce_cost(hw, tp)
            self._allreduce_source = allreduce.source
            forward_ms += 2 * layers * 1e3 * allreduce.seconds(tokens * m.hidden_size
                                                               * m.dtype_bytes)
        lm_head_ms = predict_lm_head_ms(self.op_table, tokens, hw, m.hidden_size, m.vocab_size,
                                        tp, m.dtype_bytes)
        attention = attention_cost(hw, shape, tp, m.dtype_bytes, self.attention_backend)
        return forward_ms, lm_head_ms, attention, None

    def _set_tables(self, forward_ms: np.ndarray, lm_head_ms: np.ndarray, attention,
                    decode_grid) -> None:
        """Seconds per token count of the forward kernels (a CUDA graph's batch at its capture
        size) and the LM head, and the attention terms times the layers."""
        layers = self.model.num_layers
        self._forward_s, self._forward_slope_s = per_token_table(forward_ms * 1e-3)
        for n, padded in enumerate(padded_index(self.cuda_graph_max_tokens)):
            self._forward_s[n] = self._forward_s[padded]
        self._lm_head_s, self._lm_head_slope_s = per_token_table(lm_head_ms * 1e-3)
        self._eager_launch_s = layers * self.eager_launch_overhead_s_per_layer
        self._attention, self._decode_grid = attention, decode_grid
        self._decode_fixed_s = layers * attention.decode_fixed_s
        self._decode_s_per_token = layers * attention.decode_s_per_context_token
        self._decode_s_per_seq = layers * attention.decode_s_per_seq
        self._prefill_fixed_s = layers * attention.prefill_fixed_s
        self._prefill_s_per_context_pair = layers * attention.prefill_s_per_context_pair
        self._prefill_s_per_causal_pair = layers * attention.prefill_s_per_causal_pair
        self._prefill_s_per_token = layers * attention.prefill_s_per_token
        self._mixed_decode_s_per_token = layers * attention.mixed_decode_s_per_context_token

    def _set_expected_errors(self) -> None:
        """The leave-one-out error of the linear layers' transfer, and the end-to-end error of
        runs of this kind in leave-out checks (TTFT, TPOT, E2E)."""
        m = self.model
        self.expected_errors = expected_errors()
        self.prediction_kind = kind_of(
            "vllm" if self.kernels is not None else "vidur",
            "nearest measured" not in self.kernel_source, self.tensor_parallel_size, m.is_moe,
            m.quantization is not None)
        self.expected_error_pct = expected_errors_for(self.prediction_kind)

    def _vllm_kernels(self, system: str, version: str, v1_engine: bool) -> VllmKernels:
        m, tp = self.model, self.tensor_parallel_size
        ep = self.expert_layout.expert_parallel_size if m.is_moe else 1
        return VllmKernels(m, self.hardware, system, version, tp, self.cuda_graph_max_tokens,
                           moe_tp_size=max(1, tp // ep), moe_ep_size=ep,
                           moe_tokens_per_token=(self.expert_layout.group_tokens_per_token
                                                 if m.is_moe else 1.0),
                           routing_exponent=_routing_exponent(self.routing) if m.is_moe else 0.0,
                           one_varlen_attention_call=(
                               v1_engine and self.attention_backend == "FLASH_ATTENTION"))

    def _vllm_terms(self, tokens: np.ndarray):
        """(forward ms, LM head ms per token count, the prefill attention terms, the decode
        grid) from vLLM's kernel tables; NoKernelTables where a table lacks one."""
        m, k, layers = self.model, self.kernels, self.model.num_layers
        forward_ms = (layers * (k.layer_ms(tokens) + 2 * k.allreduce_ms(tokens))
                      + k.step_ops_ms(tokens))
        if m.is_moe and self.expert_layout.expert_parallel_size > 1:
            forward_ms += layers * k.expert_dispatch_ms(tokens)
        # The measured decode grid itself: a linear fit misses its cache and occupancy steps.
        return (forward_ms, k.lm_head_ms(tokens), k.prefill_attention(),
                k.decode_attention_grid(layers))

    def draft_time(self, plan: StepPlan) -> float:
        """Seconds spent proposing the plan's drafts (sim/cost/drafting.py)."""
        return self.drafting.seconds(plan)

    def achieved_rates(self, hardware: HardwareSpec) -> HardwareSpec:
        """`hardware` with the rates its kernels are predicted at: its spec FLOP/s scaled by its
        own measured compute_efficiency, and a workstation board's bandwidth by the workstation
        efficiency (the measured tables are all datacenter boards)."""
        peak_tflops = hardware.peak_tflops * hardware.compute_efficiency
        if hardware.board != "workstation":
            return dataclasses.replace(hardware, peak_tflops=peak_tflops)
        return dataclasses.replace(
            hardware,
            memory_bandwidth_gbps=hardware.memory_bandwidth_gbps
            * self.workstation_bandwidth_efficiency, peak_tflops=peak_tflops)

    def describe(self) -> dict[str, str]:
        """Per term, what it was taken from."""
        return dict(self._sources)

    # --- per step ------------------------------------------------------------------------------

    def forward_kernels_s(self, num_tokens: int) -> float:
        """Seconds of the forward pass's non-attention kernels (all-reduces included) at
        `num_tokens` batched tokens, padded as a CUDA graph would."""
        if num_tokens <= TABLE_TOKENS:
            return self._forward_s[num_tokens]
        return self._forward_s[TABLE_TOKENS] + (num_tokens - TABLE_TOKENS) * self._forward_slope_s

    def lm_head_kernels_s(self, num_rows: int) -> float:
        """Seconds of the LM head over `num_rows` sampling rows."""
        if num_rows <= TABLE_TOKENS:
            return self._lm_head_s[num_rows]
        return self._lm_head_s[TABLE_TOKENS] + (num_rows - TABLE_TOKENS) * self._lm_head_slope_s

    def _decode_attention_s(self, context_tokens: int, num_decodes: int, num_drafts: int) -> float:
        """The decodes' context is read once however many queries (drafts) each has; drafts add
        their own K/V."""
        if self._decode_grid is not None:
            return self._decode_grid(num_decodes, context_tokens + num_drafts)
        return (self._decode_fixed_s + (context_tokens + num_drafts) * self._decode_s_per_token
                + num_decodes * self._decode_s_per_seq)

    def _prefill_attention_s(self, plan: StepPlan) -> float:
        # prefill_attention_work = sum c (k + c); the chunk-by-cached rectangle is sum c k, the
        # chunk's own causal triangle sum c^2 / 2 pairs.
        context_pairs = plan.prefill_attention_work - plan.sum_squared_prefill_chunks
        return (self._prefill_fixed_s + context_pairs * self._prefill_s_per_context_pair
                + plan.sum_squared_prefill_chunks / 2 * self._prefill_s_per_causal_pair
                + plan.num_prefill_tokens * self._prefill_s_per_token)

    def step_time(self, plan: StepPlan) -> float:
        """Seconds the step takes. An empty plan takes 0; one with only swaps or copies costs
        those plus the fixed overhead."""
        num_tokens, time = self._step_start(plan)
        if not num_tokens:
            return time
        num_sampling = plan.num_decode_seqs + plan.num_prefill_seqs + plan.num_draft_tokens
        gpu = self.forward_kernels_s(num_tokens) + self.lm_head_kernels_s(num_sampling)
        if plan.num_prefill_tokens:
            gpu += self._prefill_attention_s(plan)
        if plan.num_decode_seqs:
            decode_s = self._decode_attention_s(plan.decode_context_tokens, plan.num_decode_seqs,
                                                plan.num_draft_tokens)
            if plan.num_prefill_tokens:   # (decodes in the prompts' attention call)
                decode_s = max(decode_s, self._mixed_decode_s_per_token
                               * (plan.decode_context_tokens + plan.num_draft_tokens))
            gpu += decode_s
        if num_tokens > self.cuda_graph_max_tokens and self._eager_launch_s > gpu:
            gpu = self._eager_launch_s
        time += gpu
        if plan.spec_lens:
            time += self.draft_time(plan)
        return time

    def repeated_step_times(self, plan: StepPlan, num_steps: int):
        """step_time of the decode batch `plan` and of the same batch in each of the next
        `num_steps - 1` steps, every decode's context a token longer each step: the same sums
        step_time makes, with the parts that do not move computed once."""
        num_decodes, overhead = self._repeated_start(plan)
        kernels = self.forward_kernels_s(num_decodes) + self.lm_head_kernels_s(num_decodes)
        eager_floor = self._eager_launch_s if num_decodes > self.cuda_graph_max_tokens else 0.0
        context = plan.decode_context_tokens
        if self._decode_grid is not None:   # (one generator: the grid's, the step's sums in it)
            return self._decode_grid.along_run(num_decodes, context, num_steps, kernels,
                                               eager_floor, overhead)
        return self._step_times_from_terms(num_decodes, context, num_steps, kernels,
                                           eager_floor, overhead)

    def _step_times_from_terms(self, num_decodes: int, context: int, num_steps: int,
                               kernels: float, eager_floor: float, overhead: float):
        """repeated_step_times with the decode attention's fitted terms (no measured grid)."""
        for step in range(num_steps):
            gpu = kernels + self._decode_attention_s(context + step * num_decodes, num_decodes, 0)
            if eager_floor > gpu:
                gpu = eager_floor
            yield overhead + gpu
