"""The roofline cost model: a step's duration from the model's shape and the hardware's peak rates.

Each kernel group of a forward pass takes max(FLOPs / achieved FLOP rate, bytes / achieved
bandwidth), and the groups run one after another, so their times add:

    step = overhead (fixed + per sequence) + swaps + copies + host-tier stores and loads
         + LoRA adapters (multi-LoRA: grouped matmuls and loads, sim/core/lora_cost.py)
         + linear layers   (all batched tokens; weights read once: decode memory-bound, prefill compute-bound)
         + routed experts  (a mixture of experts: T·k tokens' FLOPs, the touched experts' weights,
                            the all-to-alls of expert parallelism; sim/core/experts.py)
         + LM head         (only the sequences that sample)
         + prefill attention (causal query-key pairs vs KV read)
         + decode attention  (one query per sequence vs its whole context's KV read)
         + tensor-parallel all-reduces (2 per layer)
         + drafting          (speculative decoding: max_draft_len sequential decode steps of the
                              draft model over the speculating sequences, or an n-gram lookup)

With speculative decoding the k drafts of a sequence are verified in the same forward pass: they
count as batched tokens (linear layers, LM head rows), and as k more decode-attention queries over
the sequence's context (taken as the step's mean decode context). Only the StepPlan's aggregate
features are used, so a step costs O(1) however large the batch.
"""
from __future__ import annotations

from collections.abc import Mapping

from policies import validators
from policies.lora.spec import LoRASpec
from policies.speculation.drafters import DRAFTER_KINDS, drafter_kind
from policies.types import StepPlan
from sim.core.energy.work import ModelStepWork
from sim.core.experts import ExpertLayout, RooflineExperts, check_expert_parallel_size
from sim.core.lora_cost import lora_step_cost
from runtime.specs import HardwareSpec, ModelSpec, offload_seconds_per_block
from sim.core.terms_file import with_fitted_terms


def _efficiency(name: str, value) -> float:
    """An achieved share of a spec-sheet rate: (0, 1]."""
    return float(validators.number_in(f"RooflineCostModel.{name}", value, 0, 1, low_open=True))


def _non_negative(name: str, value) -> float:
    """A fixed cost in seconds: >= 0."""
    return float(validators.non_negative_number(f"RooflineCostModel.{name}", value))


class RooflineCostModel:
    """Predicts `step_time(plan)` in seconds for `model` on `tensor_parallel_size` GPUs of
    `hardware`.

    The knobs are achieved fractions of the spec-sheet rates and fixed costs the roofline cannot
    see. Their defaults aim at vLLM on an A100 running Llama-2-7B (see conf/cost_model/roofline.yaml).
    `model` and `hardware` may be specs or mappings of their fields (as Hydra passes them).
    """

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
        self.model = model if isinstance(model, ModelSpec) else ModelSpec.from_config(model)
        self.hardware = hardware if isinstance(hardware, HardwareSpec) else HardwareSpec.from_config(hardware)
        self.model.check_tensor_parallel_size(tensor_parallel_size)
        self.tensor_parallel_size = tp = tensor_parallel_size
        # Swaps and copies move whole blocks; the plan lists them, the KV manager knows their size.
        self.block_size = validators.positive_int("RooflineCostModel.block_size", block_size)
        terms = with_fitted_terms(   # a twinserve-calibrate fit: its terms replace these values
            "roofline", terms_file, compute_efficiency=compute_efficiency,
            memory_efficiency=memory_efficiency, transfer_efficiency=transfer_efficiency,
            step_overhead_s=step_overhead_s, per_sequence_overhead_s=per_sequence_overhead_s,
            allreduce_latency_s=allreduce_latency_s)
        self.terms_file = terms_file
        # Large fp16 GEMMs and flash attention reach ~50-70% of tensor-core peak on A100/H100.
        self.compute_efficiency = _efficiency("compute_efficiency", terms["compute_efficiency"])
        # Streaming weights/KV from HBM reaches ~80-90% of the spec bandwidth.
        self.memory_efficiency = _efficiency("memory_efficiency", terms["memory_efficiency"])
        # Pinned PCIe copies get ~25 of 32 GB/s; NCCL all-reduce bus bandwidth ~230 of 300 on A100.
        self.transfer_efficiency = _efficiency("transfer_efficiency", terms["transfer_efficiency"])
        # Scheduling, input preparation and kernel launches: a few ms per step in vLLM (v0).
        self.step_overhead_s = _non_negative("step_overhead_s", terms["step_overhead_s"])
        # Per-sequence Python work (block tables, sampling metadata, output processing).
        self.per_sequence_overhead_s = _non_negative("per_sequence_overhead_s", terms["per_sequence_overhead_s"])
        # Fixed cost of one small NCCL/custom all-reduce over NVLink.
        self.allreduce_latency_s = _non_negative("allreduce_latency_s", terms["allreduce_latency_s"])
        # Speculative decoding's drafter: "ngram" (a lookup in the sequence's own tokens, CPU
        # work per sequence), a small model (its own roofline on one GPU, its launches cheaper
        # than a full step's), "medusa" (medusa_num_heads heads on the last hidden state: a
        # hidden x hidden block and an LM-head-sized projection each, one launch), "lookahead"
        # (its window runs inside the verification forward: the tree's tokens are the plan's
        # draft tokens, costed there; the pool lookup is per sequence, as n-gram's), or None (no
        # drafting cost: the plans do not speculate).
        self.draft_step_overhead_s = _non_negative("draft_step_overhead_s", draft_step_overhead_s)
        self.ngram_overhead_s_per_seq = _non_negative("ngram_overhead_s_per_seq",
                                                      ngram_overhead_s_per_seq)
        self.draft_model = draft_model
        self._draft_cost_model = None
        if isinstance(draft_model, (ModelSpec, Mapping)):
            self._draft_cost_model = RooflineCostModel(
                draft_model, self.hardware, block_size=block_size,
                compute_efficiency=compute_efficiency, memory_efficiency=memory_efficiency,
                transfer_efficiency=transfer_efficiency, step_overhead_s=draft_step_overhead_s,
                per_sequence_overhead_s=0.0)
            self.draft_model = self._draft_cost_model.model
        elif draft_model is not None and draft_model not in DRAFTER_KINDS:
            raise ValueError(f"RooflineCostModel.draft_model must be "
                             f"{', '.join(map(repr, DRAFTER_KINDS))}, a model spec or null, got "
                             f"{draft_model!r}")
        # How drafts are charged (policies.speculation.drafters): None without a drafter.
        self._draft_cost = (drafter_kind(draft_model).draft_cost
                            if isinstance(draft_model, str) else None)
        self.medusa_num_heads = validators.positive_int("RooflineCostModel.medusa_num_heads",
                                                        medusa_num_heads)

        m, hw = self.model, self.hardware
        flop_rate = hw.peak_flops * self.compute_efficiency
        byte_rate = hw.memory_bandwidth * self.memory_efficiency
        # Everything below is per GPU: weights, heads and KV heads are split over tp.
        linear_params = m.num_layers * m.linear_parameters_per_layer / tp
        # A mixture's routed experts are their own term (sim/core/experts.py): the linear layers
        # here are those every token runs through.
        self.routing, self._experts = routing, None
        check_expert_parallel_size(m, expert_parallel_size, tp)
        if m.is_moe:
            linear_params = m.num_layers * (m.attention_parameters_per_layer
                                            + m.always_active_mlp_parameters_per_layer) / tp
            self._experts = RooflineExperts(
                ExpertLayout.of(m, routing, tp, expert_parallel_size), hw, self.compute_efficiency,
                self.memory_efficiency, self.transfer_efficiency, self.allreduce_latency_s)
        self._linear_s_per_token = 2 * linear_params / flop_rate
        self._linear_weights_s = linear_params * m.linear_weight_bytes / byte_rate
        lm_head_params = m.lm_head_parameters / tp
        self._lm_head_s_per_seq = 2 * lm_head_params / flop_rate
        self._lm_head_weights_s = lm_head_params * m.dtype_bytes / byte_rate
        # QK^T and PV: 2 FLOPs per multiply-add, 2 matmuls, every head, every layer.
        self._attention_s_per_pair = 4 * m.num_layers * (m.num_attention_heads // tp) * m.head_dim / flop_rate
        self._kv_s_per_token = m.kv_bytes_per_token_per_gpu(tp) / byte_rate
        if tp > 1:
            # Two all-reduces per layer (after attention and after the MLP) of tokens × hidden
            # values; a ring moves 2(tp-1)/tp of the message over each link.
            ring_bytes_per_token = 2 * (tp - 1) / tp * m.hidden_size * m.dtype_bytes
            link_rate = hw.interconnect_bandwidth * self.transfer_efficiency
            self._allreduce_s_per_token = 2 * m.num_layers * ring_bytes_per_token / link_rate
            self._allreduce_fixed_s = 2 * m.num_layers * self.allreduce_latency_s
        else:
            self._allreduce_s_per_token = 0.0
            self._allreduce_fixed_s = 0.0
        heads_params = self.medusa_num_heads * (m.hidden_size ** 2 + m.lm_head_parameters)
        self._medusa_s_per_seq = 2 * heads_params / flop_rate
        self._medusa_weights_s = heads_params * m.dtype_bytes / byte_rate
        # Swaps cross PCIe once; a copy-on-write copy reads and writes a block in device memory.
        self._swap_s_per_block = self.kv_bytes_per_block / (hw.host_to_device_bandwidth * self.transfer_efficiency)
        self._copy_s_per_block = 2 * self.kv_bytes_per_block / byte_rate
        # The prefix cache's host tier moves blocks at its own configured bandwidth.
        self._offload_s_per_block = offload_seconds_per_block(m, hw, self.block_size, tp,
                                                              offload_bandwidth_gbps)
        # Multi-LoRA (a policies.lora.spec.LoRASpec; None: off): sim/core/lora_cost.py.
        self._lora = lora_step_cost(lora, m, tp, flop_rate, byte_rate,
                                    hw.host_to_device_bandwidth * self.transfer_efficiency)
        # The FLOPs and bytes of a step (sim/core/energy/work.py): the power model's input.
        self.work = ModelStepWork(m, tp, self.block_size,
                                   None if self._experts is None else self._experts.layout)

    def step_work(self, plan: StepPlan) -> tuple[float, float]:
        """(FLOPs, device-memory bytes) of the step on one GPU (energy.work.StepWorkCostModel)."""
        return self.work.step_work(plan)

    @property
    def kv_bytes_per_block(self) -> int:
        """KV bytes of one block on one GPU."""
        return self.block_size * self.model.kv_bytes_per_token_per_gpu(self.tensor_parallel_size)

    def _step_start(self, plan: StepPlan) -> tuple[int, float]:
        """(the step's batched tokens, its overheads and memory operations in seconds): 0 and 0
        for an empty plan; step_time adds the forward pass when there are tokens."""
        num_tokens = plan.num_prefill_tokens + plan.num_decode_seqs + plan.num_draft_tokens
        num_swapped = len(plan.blocks_to_swap_out) + len(plan.blocks_to_swap_in)
        num_copied = len(plan.blocks_to_copy)
        if not (num_tokens or num_swapped or num_copied or plan.blocks_to_offload
                or plan.blocks_to_load or plan.preempted_recompute):
            return 0, 0.0   # (a step that only preempts costs the overhead)
        return num_tokens, self._overhead_s(plan, num_swapped, num_copied)

    def _repeated_start(self, plan: StepPlan) -> tuple[int, float]:
        """(the decodes of the batch `plan`, its overheads and memory operations): what
        repeated_step_times computes once; a ValueError unless the plan is decodes only."""
        if plan.num_prefill_tokens or plan.spec_lens or not plan.num_decode_seqs:
            raise ValueError("repeated_step_times takes a plan of decodes only, without drafts")
        num_swapped = len(plan.blocks_to_swap_out) + len(plan.blocks_to_swap_in)
        return plan.num_decode_seqs, self._overhead_s(plan, num_swapped, len(plan.blocks_to_copy))

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

    def _overhead_s(self, plan: StepPlan, num_swapped: int, num_copied: int) -> float:
        """The fixed and per-sequence overheads, `num_swapped` blocks swapped, `num_copied`
        copied, and the plan's blocks stored to and loaded from the prefix cache's host tier."""
        time = self.step_overhead_s + self.per_sequence_overhead_s * (plan.num_prefill_seqs + plan.num_decode_seqs)
        time += num_swapped * self._swap_s_per_block + num_copied * self._copy_s_per_block
        num_offload_moves = len(plan.blocks_to_offload) + len(plan.blocks_to_load)
        if num_offload_moves:
            time += num_offload_moves * self._offload_s_per_block
        if plan.num_loras:   # the adapters' grouped matmuls and loads (sim/core/lora_cost.py)
            time += self._lora.seconds(plan)
        return time

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
        """Seconds spent proposing the plan's drafts: an n-gram lookup per speculating sequence,
        or max_draft_len sequential decode steps of the draft model over them (at the step's mean
        decode context). The draft model's catch-up on accepted tokens is not counted."""
        num_speculating = len(plan.spec_lens)
        if self._draft_cost == "lookup":
            return num_speculating * self.ngram_overhead_s_per_seq
        if self._draft_cost == "heads":
            return (self.draft_step_overhead_s
                    + max(num_speculating * self._medusa_s_per_seq, self._medusa_weights_s))
        if self._draft_cost_model is None:
            return 0.0
        mean_context = plan.decode_context_tokens / max(plan.num_decode_seqs, 1)
        draft_step = StepPlan(num_decode_seqs=num_speculating,
                              decode_context_tokens=round(num_speculating * mean_context))
        return plan.max_draft_len * self._draft_cost_model.step_time(draft_step)
