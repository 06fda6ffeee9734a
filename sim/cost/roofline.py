"""The roofline cost model: a step's duration from the model's shape and the hardware's peak rates,
each kernel group max(FLOPs / rate, bytes / bandwidth), the groups added; only the plan's
aggregates are read, so a step costs O(1). docs/cost-models.md lists the terms."""
from __future__ import annotations

from collections.abc import Mapping

from policies import validators
from policies.lora.spec import LoRASpec
from policies.speculation.drafters import DRAFTER_KINDS, drafter_kind
from policies.types import StepPlan
from runtime.specs import HardwareSpec, ModelSpec
from runtime.kv_sizing import offload_seconds_per_block
from sim.cost.drafting import DraftCost
from sim.cost.experts import ExpertLayout, RooflineExperts, check_expert_parallel_size
from sim.cost.lora import lora_step_cost
from sim.cost.overheads import StepOverheads
from sim.cost.terms_file import with_fitted_terms
from sim.cost.work import ModelStepWork


def efficiency(name: str, value) -> float:
    """An achieved share of a spec-sheet rate: (0, 1]."""
    return float(validators.number_in(f"RooflineCostModel.{name}", value, 0, 1, low_open=True))


def _non_negative(name: str, value) -> float:
    """A fixed cost in seconds: >= 0."""
    return float(validators.non_negative_number(f"RooflineCostModel.{name}", value))


def model_spec(model: ModelSpec | Mapping) -> ModelSpec:
    return model if isinstance(model, ModelSpec) else ModelSpec.from_config(model)


def hardware_spec(hardware: HardwareSpec | Mapping) -> HardwareSpec:
    return hardware if isinstance(hardware, HardwareSpec) else HardwareSpec.from_config(hardware)


def roofline_overheads(model: ModelSpec, hardware: HardwareSpec, tensor_parallel_size: int,
                       block_size: int, step_overhead_s: float, per_sequence_overhead_s: float,
                       memory_efficiency: float, transfer_efficiency: float,
                       offload_bandwidth_gbps: float | None,
                       lora: LoRASpec | Mapping | None, lora_rates: tuple[float, float]
                       ) -> StepOverheads:
    """The step's overheads and memory operations at the spec-sheet rates times the achieved
    shares; the adapters' matmuls at `lora_rates` (FLOP/s, bytes/s) and their loads over the host
    link. A swap crosses the host link once; a copy-on-write copy reads and writes a block."""
    kv_bytes_per_block = block_size * model.kv_bytes_per_token_per_gpu(tensor_parallel_size)
    host_rate = hardware.host_to_device_bandwidth * transfer_efficiency
    return StepOverheads(
        step_overhead_s, per_sequence_overhead_s,
        swap_s_per_block=kv_bytes_per_block / host_rate,
        copy_s_per_block=2 * kv_bytes_per_block / (hardware.memory_bandwidth * memory_efficiency),
        offload_s_per_block=offload_seconds_per_block(model, hardware, block_size,
                                                      tensor_parallel_size,
                                                      offload_bandwidth_gbps),
        lora=lora_step_cost(lora, model, tensor_parallel_size, *lora_rates, host_rate))


def roofline_drafting(model: ModelSpec, hardware: HardwareSpec, block_size: int,
                      draft_model: ModelSpec | Mapping | str | None, draft_step_overhead_s: float,
                      ngram_overhead_s_per_seq: float, medusa_num_heads: int,
                      flop_rate: float, byte_rate: float,
                      draft_efficiencies: dict[str, float]) -> DraftCost:
    """The drafter's cost: a draft model as its own roofline on one GPU at
    `draft_efficiencies`, its launches at draft_step_overhead_s; Medusa's heads (a hidden x hidden
    block and an LM-head-sized projection each) at `flop_rate` and `byte_rate`."""
    draft_step_time = kind = None
    if isinstance(draft_model, (ModelSpec, Mapping)):
        draft_step_time = RooflineCostModel(
            draft_model, hardware, block_size=block_size, step_overhead_s=draft_step_overhead_s,
            per_sequence_overhead_s=0.0, **draft_efficiencies).step_time
    elif draft_model is not None and draft_model not in DRAFTER_KINDS:
        raise ValueError(f"RooflineCostModel.draft_model must be "
                         f"{', '.join(map(repr, DRAFTER_KINDS))}, a model spec or null, got "
                         f"{draft_model!r}")
    else:
        kind = None if draft_model is None else drafter_kind(draft_model).draft_cost
    num_heads = validators.positive_int("RooflineCostModel.medusa_num_heads", medusa_num_heads)
    heads_params = num_heads * (model.hidden_size ** 2 + model.lm_head_parameters)
    return DraftCost(kind, _non_negative("ngram_overhead_s_per_seq", ngram_overhead_s_per_seq),
                     _non_negative("draft_step_overhead_s", draft_step_overhead_s),
                     medusa_s_per_seq=2 * heads_params / flop_rate,
                     medusa_weights_s=heads_params * model.dtype_bytes / byte_rate,
                     draft_step_time=draft_step_time)


class RooflineCostModel:
    """Predicts `step_time(plan)` in seconds for `model` on `tensor_parallel_size` GPUs of
    `hardware`; the knobs (conf/cost_model/roofline.yaml) are achieved fractions of the spec
    sheet's rates and fixed costs the roofline cannot see."""

    costs_repeated_steps = True   # step_time reads the plan's features, never its sequences

    def __init__(self, model: ModelSpec | Mapping, hardware: HardwareSpec | Mapping,
                 tensor_parallel_size: int = 1,
                 block_size: int = 16,
                 compute_efficiency: float = 0.55,
                 memory_efficiency: float = 0.85,
                 transfer_efficiency: float = 0.75,
                 step_overhead_s: float = 0.002,
                 per_sequence_overhead_s: float = 20e-6,
                 allreduce_latency_s: float = 10e-6,
                 draft_model: ModelSpec | Mapping | str | None = None,
                 draft_step_overhead_s: float = 3e-4,
                 ngram_overhead_s_per_seq: float = 20e-6,
                 medusa_num_heads: int = 4,
                 offload_bandwidth_gbps: float | None = None,
                 routing="uniform",
                 expert_parallel_size: int = 1,
                 lora: LoRASpec | Mapping | None = None,
                 terms_file: str | None = None):
        self.model, self.hardware = model_spec(model), hardware_spec(hardware)
        self.model.check_tensor_parallel_size(tensor_parallel_size)
        self.tensor_parallel_size = tensor_parallel_size
        self.block_size = validators.positive_int("RooflineCostModel.block_size", block_size)
        self.terms_file = terms_file
        self._set_terms(with_fitted_terms(
            "roofline", terms_file, compute_efficiency=compute_efficiency,
            memory_efficiency=memory_efficiency, transfer_efficiency=transfer_efficiency,
            step_overhead_s=step_overhead_s, per_sequence_overhead_s=per_sequence_overhead_s,
            allreduce_latency_s=allreduce_latency_s))
        flop_rate = self.hardware.peak_flops * self.compute_efficiency
        byte_rate = self.hardware.memory_bandwidth * self.memory_efficiency
        self.routing = routing
        self._set_forward_pass(flop_rate, byte_rate, expert_parallel_size)
        self.overheads = roofline_overheads(
            self.model, self.hardware, tensor_parallel_size, self.block_size,
            self.step_overhead_s, self.per_sequence_overhead_s, self.memory_efficiency,
            self.transfer_efficiency, offload_bandwidth_gbps, lora, (flop_rate, byte_rate))
        self.draft_model = (model_spec(draft_model) if isinstance(draft_model, Mapping)
                            else draft_model)
        # The draft model runs at the given efficiencies, not a terms file's.
        self.drafting = roofline_drafting(
            self.model, self.hardware, block_size, draft_model, draft_step_overhead_s,
            ngram_overhead_s_per_seq, medusa_num_heads, flop_rate, byte_rate,
            dict(compute_efficiency=compute_efficiency, memory_efficiency=memory_efficiency,
                 transfer_efficiency=transfer_efficiency))
        self.work = ModelStepWork(self.model, tensor_parallel_size, self.block_size,
                                  self.expert_layout)
        # Bound once: step_time runs every step, and the energy meter asks each step's work
        # (policies.protocols.StepWorkCostModel, DecodeWorkCostModel).
        self._step_start = self.overheads.step_start
        self._repeated_start = self.overheads.repeated_start
        self.step_work, self.decode_work_terms = (self.work.step_work,
                                                  self.work.decode_work_terms)

    def _set_terms(self, terms: dict) -> None:
        """The achieved shares of the spec-sheet rates and the fixed costs, checked."""
        self.compute_efficiency = efficiency("compute_efficiency", terms["compute_efficiency"])
        self.memory_efficiency = efficiency("memory_efficiency", terms["memory_efficiency"])
        self.transfer_efficiency = efficiency("transfer_efficiency",
                                               terms["transfer_efficiency"])
        self.step_overhead_s = _non_negative("step_overhead_s", terms["step_overhead_s"])
        self.per_sequence_overhead_s = _non_negative("per_sequence_overhead_s",
                                                     terms["per_sequence_overhead_s"])
        self.allreduce_latency_s = _non_negative("allreduce_latency_s",
                                                 terms["allreduce_latency_s"])

    def _set_forward_pass(self, flop_rate: float, byte_rate: float,
                          expert_parallel_size: int) -> None:
        """Seconds per unit of each forward-pass term on one GPU (weights, heads and KV heads
        split over tp); a mixture's routed experts are their own term (sim/cost/experts.py)."""
        m, hw, tp = self.model, self.hardware, self.tensor_parallel_size
        check_expert_parallel_size(m, expert_parallel_size, tp)
        linear_params = m.num_layers * m.linear_parameters_per_layer / tp
        self._experts = self.expert_layout = None
        if m.is_moe:
            linear_params = m.num_layers * (m.attention_parameters_per_layer
                                            + m.always_active_mlp_parameters_per_layer) / tp
            self.expert_layout = ExpertLayout.of(m, self.routing, tp, expert_parallel_size)
            self._experts = RooflineExperts(
                self.expert_layout, hw, self.compute_efficiency, self.memory_efficiency,
                self.transfer_efficiency, self.allreduce_latency_s)
        self._linear_s_per_token = 2 * linear_params / flop_rate
        self._linear_weights_s = linear_params * m.linear_weight_bytes / byte_rate
        lm_head_params = m.lm_head_parameters / tp
        self._lm_head_s_per_seq = 2 * lm_head_params / flop_rate
        self._lm_head_weights_s = lm_head_params * m.dtype_bytes / byte_rate
        # QK^T and PV: 2 FLOPs per multiply-add, 2 matmuls, every head, every layer.
        self._attention_s_per_pair = (4 * m.num_layers * (m.num_attention_heads // tp)
                                      * m.head_dim / flop_rate)
        self._kv_s_per_token = m.kv_bytes_per_token_per_gpu(tp) / byte_rate
        self._allreduce_s_per_token = self._allreduce_fixed_s = 0.0
        if tp > 1:
            # Two all-reduces a layer of tokens x hidden values; a ring moves 2(tp-1)/tp of it.
            ring_bytes_per_token = 2 * (tp - 1) / tp * m.hidden_size * m.dtype_bytes
            link_rate = hw.interconnect_bandwidth * self.transfer_efficiency
            self._allreduce_s_per_token = 2 * m.num_layers * ring_bytes_per_token / link_rate
            self._allreduce_fixed_s = 2 * m.num_layers * self.allreduce_latency_s

    @property
    def kv_bytes_per_block(self) -> int:
        """KV bytes of one block on one GPU."""
        return self.block_size * self.model.kv_bytes_per_token_per_gpu(self.tensor_parallel_size)

    def step_time(self, plan: StepPlan) -> float:
        """Seconds the step takes. An empty plan takes 0; one with only swaps or copies costs
        those plus the fixed overhead."""
        num_tokens, time = self._step_start(plan)
        if not num_tokens:
            return time
        time = self._add_batched_work(time, plan, num_tokens)
        if plan.num_decode_seqs:
            time += self._decode_attention_s(plan.decode_context_tokens, plan.num_decode_seqs,
                                             plan.num_draft_tokens)
        time += self._allreduce_fixed_s + num_tokens * self._allreduce_s_per_token
        if plan.spec_lens:
            time += self.draft_time(plan)
        return time

    def repeated_step_times(self, plan: StepPlan, num_steps: int):
        """step_time of the decode batch `plan` and of the same batch in each of the next
        `num_steps - 1` steps, every decode's context a token longer each step: the same sums
        step_time makes, with the parts that do not move computed once."""
        num_decodes, overhead = self._repeated_start(plan)
        num_tokens = num_decodes
        before_attention = self._add_batched_work(overhead, plan, num_tokens)
        after_attention = self._allreduce_fixed_s + num_tokens * self._allreduce_s_per_token
        # _decode_attention_s without drafts, inlined: pairs = context, KV read = context +
        # one write per decode.
        s_per_pair, kv_s_per_token = self._attention_s_per_pair, self._kv_s_per_token
        context = plan.decode_context_tokens
        for _ in range(num_steps):
            compute_s, memory_s = context * s_per_pair, (context + num_decodes) * kv_s_per_token
            # max(compute_s, memory_s), as max picks (the first unless the second is larger).
            yield (before_attention + (memory_s if memory_s > compute_s else compute_s)
                   + after_attention)
            context += num_decodes

    def lm_head_kernels_s(self, num_rows: int) -> float:
        """Seconds of the LM head over `num_rows` sampling rows (what a pipeline's last stage
        runs and the others do not)."""
        return max(num_rows * self._lm_head_s_per_seq, self._lm_head_weights_s)

    def _decode_attention_s(self, context_tokens: int, num_decodes: int, num_drafts: int) -> float:
        """Decode attention: the context is read once per sequence however many queries it has;
        the drafts' queries each visit about the mean context, and their K/V are written."""
        pairs = context_tokens
        if num_drafts:
            pairs += num_drafts * context_tokens / num_decodes
        kv_tokens = context_tokens + num_decodes + num_drafts
        return max(pairs * self._attention_s_per_pair, kv_tokens * self._kv_s_per_token)

    def _add_batched_work(self, time: float, plan: StepPlan, num_tokens: int) -> float:
        """`time` plus the linear layers, the LM head and prefill attention, in step_time's
        order of sums."""
        time += max(num_tokens * self._linear_s_per_token, self._linear_weights_s)
        if self._experts is not None:
            time += self._experts.seconds(num_tokens)
        # Every decode sequence samples (a speculating one at each draft too); a prefill chunk
        # samples only if it ends the prompt, which the aggregates do not say, so count them all
        # (an upper bound of a few rows).
        num_sampling = plan.num_decode_seqs + plan.num_prefill_seqs + plan.num_draft_tokens
        time += max(num_sampling * self._lm_head_s_per_seq, self._lm_head_weights_s)
        if plan.num_prefill_tokens:
            # Causal masking: a chunk of c tokens after k cached ones visits c*k + c²/2 pairs,
            # i.e. chunk × context_after − c²/2. KV read for the whole context plus the chunk's writes.
            pairs = plan.prefill_attention_work - plan.sum_squared_prefill_chunks / 2
            kv_tokens = plan.prefill_context_tokens + plan.num_prefill_tokens
            time += max(pairs * self._attention_s_per_pair, kv_tokens * self._kv_s_per_token)
        return time

    def draft_time(self, plan: StepPlan) -> float:
        """Seconds spent proposing the plan's drafts (sim/cost/drafting.py)."""
        return self.drafting.seconds(plan)
