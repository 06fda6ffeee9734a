"""One step's kernels assembled from the kernel tables of the vLLM version being predicted
(vllm_tables.py) at the model's tensor-parallel shard, per batched token count: GEMMs,
all-reduces, small kernels, attention and the LM head (docs/gpu-cost-model.md derives each)."""
from __future__ import annotations

import bisect
import dataclasses
import functools
import math
from collections.abc import Iterator
from itertools import repeat

import numpy as np

from runtime.specs import HardwareSpec, ModelSpec
from sim.cost.gpu.attention import AttentionCost
from sim.cost.gpu.linear import nearest_op_table, predict_op_ms
from sim.cost.gpu.tables import LayerShape
from sim.cost.gpu.vllm_tables import (CUSTOM_ALLREDUCE_MAX_BYTES, FA2_QUERY_TILE_ROWS, FA2_SYSTEMS,
                                 OTHER_CUSTOM_ALLREDUCE_MAX_BYTES,
                                 SYMM_MEM_ALLREDUCE_MAX_BYTES, SYMM_MEM_SYSTEMS, AttentionRows,
                                 NoKernelTables,
                                 attention_rows, curve_ms, custom_allreduce_curve, gemm_grid,
                                 moe_table, nccl_curve)

GEMM_DTYPES = {None: "bfloat16", "fp8": "fp8", "fp8_block": "fp8_block"}
SMALL_LAYER_OPS = ("input_layernorm", "attn_rope", "post_attention_layernorm", "mlp_act", "add")


def _relative_fit(columns: list[np.ndarray], ms: np.ndarray) -> tuple[np.ndarray, float]:
    """Non-negative coefficients minimising the relative error of sum(c x column) to `ms`, and
    the fit's mean relative error (%)."""
    from scipy.optimize import nnls
    a = np.column_stack(columns) / ms[:, None]
    coefficients, _ = nnls(a, np.ones_like(ms))
    predicted = np.column_stack(columns) @ coefficients
    return [float(c) for c in coefficients], float(100 * np.mean(np.abs(predicted - ms) / ms))


def _exponent(distribution: str) -> float:
    """A MoE table's routing as a Zipf exponent: balanced 0, power_law_1.2 1.2."""
    return 0.0 if distribution == "balanced" else float(distribution.rsplit("_", 1)[-1])


@dataclasses.dataclass(frozen=True)
class DecodeAttentionGrid:
    """A decode batch's attention (s, all layers) measured on a (batch, context) grid: bilinear
    between measured points (exact where time ~ batch x context), in proportion beyond them.
    The step looks it up at the batch's size and mean context, O(1)."""

    heads: tuple[int, int, int]                 # the measured (query, KV heads, head_dim)
    batch: tuple[float, ...]
    context: tuple[float, ...]
    seconds: tuple[tuple[float, ...], ...]      # [batch][context]

    def __call__(self, num_decodes: int, context_tokens: float) -> float:
        return next(self.along_run(num_decodes, context_tokens))

    def along_run(self, num_decodes: int, context_tokens: float, num_steps: int | None = None,
                  kernels_s: float = 0.0, floor_s: float = 0.0,
                  overhead_s: float = 0.0) -> Iterator[float]:
        """The seconds at `context_tokens`, then at each next step of the same batch (every decode
        a token further), the batch's row looked up once; `num_steps` of them (None: no end)."""
        bi, bw, bs = _position(self.batch, float(num_decodes))
        row, nxt = self.seconds[bi], self.seconds[min(bi + 1, len(self.batch) - 1)]
        grid, last = self.context, len(self.context) - 1
        lowest, highest = grid[0], grid[last]
        # The mean context only grows along a run: the bracketing points and their differences
        # are found again only when it passes the upper one (_position's arithmetic otherwise).
        upper, top = 0, -math.inf
        for _ in repeat(None) if num_steps is None else repeat(None, num_steps):
            value = context_tokens / num_decodes
            if value <= lowest:
                attention = (row[0] + bw * (nxt[0] - row[0])) * bs
            elif value >= highest:
                attention = (row[last] + bw * (nxt[last] - row[last])) * bs * (value / highest)
            else:
                if value > top:
                    while grid[upper] < value:
                        upper += 1
                    bottom, top = grid[upper - 1], grid[upper]
                    width = top - bottom
                    row_low, row_rise = row[upper - 1], row[upper] - row[upper - 1]
                    nxt_low, nxt_rise = nxt[upper - 1], nxt[upper] - nxt[upper - 1]
                weight = (value - bottom) / width
                low = row_low + weight * row_rise
                high = nxt_low + weight * nxt_rise
                attention = (low + bw * (high - low)) * bs
            gpu = kernels_s + attention
            yield overhead_s + (floor_s if floor_s > gpu else gpu)
            context_tokens += num_decodes


def _position(grid: tuple[float, ...], value: float) -> tuple[int, float, float]:
    """(lower index, weight of the next point, scale beyond the grid's ends) of `value`."""
    if value <= grid[0]:
        return 0, 0.0, 1.0
    if value >= grid[-1]:
        return len(grid) - 1, 0.0, value / grid[-1]
    upper = bisect.bisect_left(grid, value)
    return upper - 1, (value - grid[upper - 1]) / (grid[upper] - grid[upper - 1]), 1.0


def _filled_grid(rows: AttentionRows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(batches, contexts, ms[batch][context]) of decode rows; a hole takes its batch row's
    neighbour in context scaled by context."""
    batches, contexts = np.unique(rows.batch), np.unique(rows.context)
    grid = np.full((len(batches), len(contexts)), np.nan)
    grid[np.searchsorted(batches, rows.batch), np.searchsorted(contexts, rows.context)] = rows.ms
    for i in range(len(batches)):
        known = ~np.isnan(grid[i])
        if not known.all():
            last = np.flatnonzero(known)[-1]
            grid[i, ~known] = np.interp(contexts[~known], contexts[known], grid[i, known])
            grid[i, last + 1:] = grid[i, last] * contexts[last + 1:] / contexts[last]
    return batches, contexts, grid


@dataclasses.dataclass(frozen=True)
class VllmKernels:
    """A model's kernels on one GPU of `system` under vLLM `version` (module docstring)."""

    model: ModelSpec
    hardware: HardwareSpec
    system: str
    version: str
    tensor_parallel_size: int
    cuda_graph_max_tokens: int
    moe_tp_size: int = 1
    moe_ep_size: int = 1
    moe_tokens_per_token: float = 1.0       # tokens a GPU's experts see per token of the replica
    routing_exponent: float = 0.0           # the routing's Zipf exponent (0: balanced)
    one_varlen_attention_call: bool = True  # V1's FLASH_ATTN backend (V0 ran decodes apart)

    @property
    def gemm_dtype(self) -> str:
        return GEMM_DTYPES[self.model.quantization]

    @property
    def kv_dtype(self) -> str:
        return "fp8" if self.model.kv_cache_dtype == "fp8" else "bfloat16"

    def _gemm_ms(self, tokens: np.ndarray, n: int, k: int, dtype: str | None = None) -> np.ndarray:
        return gemm_grid(self.system, self.version, dtype or self.gemm_dtype).latency_ms(tokens, n, k)

    # --- per layer -----------------------------------------------------------------------------

    def layer_ms(self, tokens: np.ndarray) -> np.ndarray:
        """One layer's kernels but attention and all-reduces (ms) at each of `tokens`."""
        m, tp = self.model, self.tensor_parallel_size
        q = m.num_attention_heads // tp * m.head_dim
        kv = m.kv_heads_per_gpu(tp) * m.head_dim
        ms = (self._gemm_ms(tokens, q + 2 * kv, m.hidden_size)
              + self._gemm_ms(tokens, m.hidden_size, q))
        if m.is_moe:
            ms = ms + self._gemm_ms(tokens, m.num_experts, m.hidden_size, "bfloat16") \
                + self.moe_ms(tokens)
        else:
            width = m.intermediate_size // tp
            ms = ms + self._gemm_ms(tokens, (2 if m.mlp == "gated" else 1) * width, m.hidden_size) \
                + self._gemm_ms(tokens, m.hidden_size, width)
        return ms + self._small_ms(tokens, SMALL_LAYER_OPS)

    def _small_ms(self, tokens: np.ndarray, ops: tuple[str, ...]) -> np.ndarray:
        m, tp = self.model, self.tensor_parallel_size
        shape = LayerShape.of_model(m)
        table = nearest_op_table(self.hardware, shape, tp, key=f"hardware={self.hardware.name}")
        return sum(predict_op_ms(table, op, tokens, self.hardware, shape, tp, m.dtype_bytes)
                   for op in ops)

    def moe_ms(self, tokens: np.ndarray) -> np.ndarray:
        """The fused MoE layer (ms): the measured configuration of this model's experts, or the
        nearest measured one scaled by expert FLOPs and weight bytes."""
        m = self.model
        data = moe_table(self.system, self.version)
        dtype = {"bfloat16": "bfloat16", "fp8": "fp8", "fp8_block": "fp8_block"}[self.gemm_dtype]
        rows = ((data["moe_dtype"] == dtype) & (data["moe_tp_size"] == self.moe_tp_size)
                & (data["moe_ep_size"] == self.moe_ep_size))
        if rows.any():   # the measured routing nearest the run's (balanced is exponent 0)
            measured = set(data["distribution"][rows].tolist())
            distribution = min(measured, key=lambda d: abs(_exponent(d) - self.routing_exponent))
            rows &= data["distribution"] == distribution
        if not rows.any():
            raise NoKernelTables(f"{self.system} vLLM {self.version}: no {dtype} MoE layer at "
                                 f"moe_tp {self.moe_tp_size}, moe_ep {self.moe_ep_size}")
        configs = {tuple(int(data[c][i]) for c in ("hidden_size", "inter_size", "topk", "num_experts"))
                   for i in np.flatnonzero(rows)}
        want = (m.hidden_size, m.moe_intermediate_size, m.num_experts_per_tok, m.num_experts)
        config = min(configs, key=lambda c: sum(abs(np.log(a / b)) for a, b in zip(c, want)))
        rows &= ((data["hidden_size"] == config[0]) & (data["inter_size"] == config[1])
                 & (data["topk"] == config[2]) & (data["num_experts"] == config[3]))
        order = np.argsort(data["num_tokens"][rows])
        measured_tokens = data["num_tokens"][rows][order].astype(float)
        measured_ms = data["latency"][rows][order].astype(float)
        seen = np.asarray(tokens, dtype=float) * self.moe_tokens_per_token
        ms = np.interp(seen, measured_tokens, measured_ms)
        slope = (measured_ms[-1] - measured_ms[-2]) / (measured_tokens[-1] - measured_tokens[-2])
        ms = np.where(seen > measured_tokens[-1], measured_ms[-1] + (seen - measured_tokens[-1]) * slope, ms)
        if config != want:   # work per token and weights both scale with hidden x width x experts
            flops = want[0] * want[1] * want[2] / (config[0] * config[1] * config[2])
            weights = want[0] * want[1] * want[3] / (config[0] * config[1] * config[3])
            ms = ms * np.where(seen * want[2] > want[3], flops, weights)
        return ms

    # --- collectives ---------------------------------------------------------------------------

    def allreduce_ms(self, tokens: np.ndarray) -> np.ndarray:
        """One tensor-parallel all-reduce of tokens x hidden activations (ms)."""
        tp = self.tensor_parallel_size
        if tp == 1:
            return np.zeros_like(np.asarray(tokens, dtype=float))
        elements = np.asarray(tokens, dtype=float) * self.model.hidden_size
        nccl = nccl_curve(self.system, "all_reduce", tp)
        graph = custom_allreduce_curve(self.system, self.version, tp, "vllm_graph")
        eager = custom_allreduce_curve(self.system, self.version, tp, "vllm_eager")
        if not len(graph[0]):   # no custom all-reduce on this system (PCIe boards): NCCL
            return curve_ms(nccl, elements)
        custom = np.where(np.asarray(tokens) <= self.cuda_graph_max_tokens,
                          curve_ms(graph, elements), curve_ms(eager, elements))
        nccl_ms = curve_ms(nccl, elements)
        message = elements * self.model.dtype_bytes
        if self.system not in SYMM_MEM_SYSTEMS:
            return np.where(message <= OTHER_CUSTOM_ALLREDUCE_MAX_BYTES, custom, nccl_ms)
        # Symmetric memory (unmeasured) at the faster of the two measured NVLink all-reduces.
        return np.where(message <= CUSTOM_ALLREDUCE_MAX_BYTES.get(tp, 0), custom,
                        np.where(message <= SYMM_MEM_ALLREDUCE_MAX_BYTES.get(tp, 0),
                                 np.minimum(custom, nccl_ms), nccl_ms))

    def expert_dispatch_ms(self, tokens: np.ndarray) -> np.ndarray:
        """A MoE layer's dispatch and combine (ms): with data parallelism vLLM's
        allgather_reducescatter at the gathered size; none within one replica."""
        group = self.moe_ep_size // self.tensor_parallel_size
        if group <= 1:
            return np.zeros_like(np.asarray(tokens, dtype=float))
        elements = (np.asarray(tokens, dtype=float) * self.moe_tokens_per_token
                    * self.model.hidden_size)
        return sum(curve_ms(nccl_curve(self.system, op, group), elements)
                   for op in ("all_gather", "reduce_scatter"))

    # --- per step ------------------------------------------------------------------------------

    def step_ops_ms(self, tokens: np.ndarray) -> np.ndarray:
        """The embedding and the final norm (ms)."""
        return self._small_ms(tokens, ("emb", "input_layernorm"))

    def lm_head_ms(self, rows: np.ndarray) -> np.ndarray:
        """The LM head over the sampling rows (its weights stay bf16 under fp8), and at tp > 1
        the logits' all-gather (ms)."""
        m, tp = self.model, self.tensor_parallel_size
        ms = self._gemm_ms(rows, -(-m.vocab_size // tp), m.hidden_size, "bfloat16")
        if tp > 1:
            ms = ms + curve_ms(nccl_curve(self.system, "all_gather", tp),
                               np.asarray(rows, dtype=float) * m.vocab_size)
        return ms

    # --- attention -----------------------------------------------------------------------------

    def _rows(self, kind: str) -> tuple[AttentionRows, float]:
        """The table rows for the model's heads on one GPU and the factor that carries them
        there (KV heads for decode, which reads the cache; query heads for prefill)."""
        m, tp = self.model, self.tensor_parallel_size
        query, kv = m.num_attention_heads // tp, m.kv_heads_per_gpu(tp)
        rows = attention_rows(self.system, self.version, kind, query, kv, m.head_dim, self.kv_dtype)
        scale = (kv / rows.heads[1]) if kind == "generation" else (query / rows.heads[0])
        return rows, scale * m.head_dim / rows.heads[2]

    # (Cached, as the tables are: every run of a sweep builds its cost model from the same.)
    @functools.lru_cache(maxsize=None)
    def decode_attention_grid(self, num_layers: int) -> DecodeAttentionGrid:
        """The decode table of the model's heads as a (batch, context) grid, all layers, in
        seconds. Where the heads times m were measured too, the faster of the two: split-KV cuts
        a context into m parts, which reads the same bytes with m times the thread blocks."""
        rows, scale = self._rows("generation")
        batches, contexts, ms = _filled_grid(rows)
        query, kv, head_dim = rows.heads
        for m in (2, 4, 8, 16, 32, 64):
            split = attention_rows(self.system, self.version, "generation", query * m, kv * m,
                                   head_dim, self.kv_dtype)
            if split.heads != (query * m, kv * m, head_dim):
                continue
            split_batches, split_contexts, split_ms = _filled_grid(split)
            for i, batch in enumerate(batches):
                j = np.searchsorted(split_batches, batch)
                if j < len(split_batches) and split_batches[j] == batch:
                    inside = contexts / m >= split_contexts[0]
                    ms[i, inside] = np.minimum(ms[i, inside], np.interp(
                        contexts[inside] / m, split_contexts, split_ms[j], right=np.inf))
        seconds = ms * scale * 1e-3 * num_layers
        return DecodeAttentionGrid(rows.heads, tuple(batches.tolist()), tuple(contexts.tolist()),
                                   tuple(tuple(row) for row in seconds.tolist()))

    @functools.lru_cache(maxsize=None)
    def prefill_attention(self) -> AttentionCost:
        """Per-layer prefill attention terms in seconds (decode is looked up in
        decode_attention_grid, so its terms here are 0)."""
        prefill, scale = self._rows("context")
        b, s, ms = prefill.batch, prefill.context, prefill.ms
        (fixed, per_pair, per_token), error = _relative_fit(
            [np.ones_like(ms), b * s * (s + 1) / 2, b * s], ms)
        unpacked_decodes = self.one_varlen_attention_call and self.system in FA2_SYSTEMS
        return AttentionCost(
            decode_fixed_s=0.0, decode_s_per_context_token=0.0, decode_s_per_seq=0.0,
            prefill_fixed_s=fixed * 1e-3,
            prefill_s_per_context_pair=per_pair * scale * 1e-3,
            prefill_s_per_causal_pair=per_pair * scale * 1e-3,
            prefill_s_per_token=per_token * scale * 1e-3,
            mixed_decode_s_per_context_token=(FA2_QUERY_TILE_ROWS * per_pair * scale * 1e-3
                                              if unpacked_decodes else 0.0),
            source=(f"{self.system} vLLM {self.version} flash attention tables, {self.kv_dtype} KV "
                    f"cache; prefill: measured heads q/kv/d {prefill.heads} scaled to this GPU's, "
                    f"fit error {error:.0f} %"
                    + ("; decodes beside prompt tokens: FlashAttention 2's 64-row query tile per "
                       "query head over each context, at the prefill rate" if unpacked_decodes
                       else "")))
