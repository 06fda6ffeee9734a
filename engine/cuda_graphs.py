"""CUDA graphs for decode steps, as vLLM captures them: one graph of the forward per batch-size
bucket (1, 2, 4, then multiples of 8) over static buffers; a decode step is padded to the
smallest bucket that holds it and replays that graph, launching every layer's kernels at once.

Padding rows attend to nothing and write nothing (slot -1, context length 0), and their logits
are cut off. Block tables are as wide as the longest context so that nothing recompiles; steps
that are not pure decodes, or larger than the largest bucket, run eagerly.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import AttentionMetadata
from kernels import KernelOps

# The largest bucket by default (vLLM captures up to 512; max_num_seqs defaults to 256).
DEFAULT_MAX_CAPTURE_SIZE = 256


def capture_sizes(max_batch: int) -> list[int]:
    """The buckets for decode batches of up to max_batch sequences: those of 1, 2, 4, 8, 16,
    24, ... below max_batch and the first that holds it."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch must be a positive integer, got {max_batch!r}")
    top = -(-max_batch // 8) * 8
    sizes = [1, 2, 4] + list(range(8, top + 1, 8))
    return sizes[:bisect.bisect_left(sizes, max_batch) + 1]


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest bucket that holds num_seqs sequences; None when none does."""
    index = bisect.bisect_left(sizes, num_seqs)
    return sizes[index] if index < len(sizes) else None


@dataclass
class DecodeBatch:
    """One decode step's inputs on the host: one token per sequence."""

    token_ids: np.ndarray       # [B] int64
    positions: np.ndarray       # [B] int64
    slots: np.ndarray           # [B] int64
    block_tables: np.ndarray    # [B, blocks] int32
    seq_lens: np.ndarray        # [B] int32

    @property
    def num_seqs(self) -> int:
        return len(self.token_ids)


def pad_decode_batch(batch: DecodeBatch, size: int, width: int) -> DecodeBatch:
    """`batch` padded to `size` rows (rows that attend to nothing and write nothing, see the
    module docstring) with block tables widened to `width` blocks."""
    num_seqs, blocks = batch.block_tables.shape
    if num_seqs > size or blocks > width:
        raise ValueError(f"a decode batch of {num_seqs} sequences and {blocks} blocks does not "
                         f"fit a bucket of {size} sequences and {width} blocks")
    tables = np.zeros((size, width), dtype=np.int32)
    tables[:num_seqs, :blocks] = batch.block_tables

    def padded(array: np.ndarray, fill: int) -> np.ndarray:
        out = np.full(size, fill, dtype=array.dtype)
        out[:num_seqs] = array
        return out

    return DecodeBatch(padded(batch.token_ids, 0), padded(batch.positions, 0),
                       padded(batch.slots, -1), tables, padded(batch.seq_lens, 0))


class DecodeGraphs:
    """Static buffers of the largest bucket and one captured forward per bucket; `capture=False`
    runs the same forwards without graphs (how the padding is tested on a CPU)."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], ops: KernelOps,
                 device: torch.device, sizes: list[int], max_seq_len: int, block_size: int,
                 capture: bool = True):
        if not ops.takes_host_lengths:
            raise ValueError(f"decode graphs need kernels that take the step's lengths from "
                             f"the host (the Triton kernels), not {ops.name!r}")
        self.model = model
        self.kv_caches = kv_caches
        self.ops = ops
        self.sizes = sorted(sizes)
        self.max_seq_len = max_seq_len
        self.width = -(-max_seq_len // block_size)
        self.capture = capture
        largest = self.sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slots = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(largest, self.width, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(largest, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(largest, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.num_replays = 0

    def fits(self, num_seqs: int, blocks: int) -> bool:
        return bucket_for(num_seqs, self.sizes) is not None and blocks <= self.width

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool (as vLLM does)."""
        if not self.capture:
            return
        pool = None
        for size in reversed(self.sizes):
            self._forward(size)  # once eagerly: lazy initialisation happens outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def run(self, batch: DecodeBatch) -> torch.Tensor:
        """Logits [B, vocab] (fp32) of the batch's tokens; valid until the next run."""
        size = bucket_for(batch.num_seqs, self.sizes)
        padded = pad_decode_batch(batch, size, self.width)
        for buffer, array in ((self.input_ids, padded.token_ids),
                              (self.positions, padded.positions), (self.slots, padded.slots),
                              (self.block_tables, padded.block_tables),
                              (self.seq_lens, padded.seq_lens)):
            buffer[:size].copy_(torch.from_numpy(array))
        self.num_replays += 1
        if self.capture:
            self.graphs[size].replay()
            logits = self.logits[size]
        else:
            with torch.inference_mode():
                logits = self._forward(size)
        return logits[:batch.num_seqs]

    def _forward(self, size: int) -> torch.Tensor:
        metadata = AttentionMetadata(
            slot_mapping=self.slots[:size], block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size], query_start_loc=self.query_start_loc[:size + 1],
            kv_caches=self.kv_caches, ops=self.ops, max_query_len=1,
            max_seq_len=self.max_seq_len)
        output = self.model(input_ids=self.input_ids[:size][None],
                            position_ids=self.positions[:size][None], attn_metadata=metadata,
                            use_cache=False, logits_to_keep=self.logits_indices[:size])
        return output.logits[0].float()
