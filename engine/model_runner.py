"""Turns a StepPlan into tensors and runs the model once over every scheduled token: one
unpadded flattened batch with explicit positions, logits only at the rows that sample."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.cuda_graphs import DecodeBatch, DecodeGraphs
from engine.lora import ServedAdapters
from engine.token_tree import TokenTree
from kernels import KernelOps
from kernels.lora_batch import NO_ADAPTER, LoRABatch
from policies.types import Sequence, StepPlan


@dataclass
class StepInputs:
    # Eager steps: the flattened batch on the device. None for a step that replays a decode
    # graph, whose inputs are `decode_batch` on the host.
    input_ids: torch.Tensor | None      # [num_tokens]
    positions: torch.Tensor | None      # [num_tokens]
    metadata: AttentionMetadata | None
    # Rows whose logits are kept: each sampling sequence's last token (and its drafts').
    logits_indices: torch.Tensor | None
    sampling_seqs: list[Sequence]   # sequences that reach their last token and sample
    decode_batch: DecodeBatch | None = None
    # Which adapter slot each token uses (engine/lora.py); None: the base model alone.
    lora_batch: LoRABatch | None = None


def new_token_ids(seq: Sequence, start: int, num_new: int) -> list[int]:
    """seq.token_ids()[start:start + num_new] without building the whole list (decode steps
    need only the last output token)."""
    prompt = seq.request.prompt_token_ids
    if prompt is None:
        raise ValueError(f"request {seq.request.request_id} has no prompt_token_ids: the engine "
                         f"runs real tokens (a simulator workload needs with_token_ids: true)")
    prompt_len = len(prompt)
    end = start + num_new
    if start >= prompt_len:
        return seq.output_token_ids[start - prompt_len:end - prompt_len]
    if end <= prompt_len:
        return prompt[start:end]
    return list(prompt[start:]) + seq.output_token_ids[:end - prompt_len]


class ModelRunner:
    """Runs one model (the target or a draft model) over paged KV layers `kv_caches`; a pure
    decode step that fits a captured bucket replays its CUDA graph unless it runs an adapter."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int,
                 ops: KernelOps, device: torch.device,
                 decode_graphs: DecodeGraphs | None = None, lora: ServedAdapters | None = None):
        self.model = model
        self.kv_caches = kv_caches
        self.ops = ops
        self.device = device
        self.block_size = block_size
        self.decode_graphs = decode_graphs
        self.lora = lora

    def prepare(self, plan: StepPlan,
                drafts: dict[int, list[int] | TokenTree] | None = None) -> StepInputs:
        """The plan's tokens; a sequence with `drafts[seq_id]` also runs its drafts after its
        last token and keeps logits for all of them (1 + len(drafts) rows)."""
        num_seqs = len(plan.seqs)
        token_ids: list[int] = []
        starts = np.empty(num_seqs, dtype=np.int64)
        query_lens = np.asarray(plan.num_new_tokens, dtype=np.int64)
        tables = plan.block_tables
        seq_tables = []
        sampling_seqs = []
        logits_rows: list[int] = []
        trees: list[tuple[int, TokenTree]] = []   # (flattened row of the root, tree)
        lora_ids = np.full(num_seqs, NO_ADAPTER, dtype=np.int64)
        num_tokens = 0
        for index, (seq, num_new) in enumerate(zip(plan.seqs, plan.num_new_tokens)):
            start = seq.num_computed_tokens
            starts[index] = start
            token_ids += new_token_ids(seq, start, num_new)
            seq_tables.append(tables[seq.seq_id])
            if seq.request.lora_id is not None:
                lora_ids[index] = seq.request.lora_id
            num_tokens += num_new
            if start + num_new == seq.num_tokens:
                sampling_seqs.append(seq)
                seq_drafts = drafts.get(seq.seq_id) if drafts else None
                if isinstance(seq_drafts, TokenTree):
                    trees.append((num_tokens - 1, seq_drafts))
                    seq_drafts = seq_drafts.tokens
                if seq_drafts:
                    token_ids += seq_drafts
                    query_lens[index] += len(seq_drafts)
                    logits_rows += range(num_tokens - 1, num_tokens + len(seq_drafts))
                    num_tokens += len(seq_drafts)
                else:
                    logits_rows.append(num_tokens - 1)
        tree_mask = position_shift = None
        if trees:
            # A node runs in the slot after the one before it, at its own depth's position.
            tree_mask = np.full(num_tokens, -1, dtype=np.int64)
            position_shift = np.zeros(num_tokens, dtype=np.int64)
            for root_row, tree in trees:
                rows = slice(root_row, root_row + 1 + len(tree))
                tree_mask[rows] = tree.mask_entries()
                position_shift[rows] = np.arange(1 + len(tree)) - np.asarray([0] + tree.depths)
        lora_batch = None
        if self.lora is not None:
            # Every step: the plan's LoRA manager may load an adapter no token uses yet.
            step = plan.lora   # (None: a scheduler without a LoRA manager; the runner places them)
            lora_batch = self.lora.batch_for(np.repeat(lora_ids, query_lens),
                                             *(() if step is None else (step.slots, step.to_load)))
        elif (lora_ids != NO_ADAPTER).any():
            raise ValueError("a request has a lora_id but this engine serves no adapters "
                             "(give it lora=...)")
        return self.build(token_ids, starts, query_lens, seq_tables, logits_rows, sampling_seqs,
                          tree_mask, position_shift, lora_batch)

    def build(self, token_ids: list[int], starts: np.ndarray, query_lens: np.ndarray,
              seq_tables: list[list[int]], logits_rows: list[int],
              sampling_seqs: list[Sequence], tree_mask: np.ndarray | None = None,
              position_shift: np.ndarray | None = None,
              lora_batch: LoRABatch | None = None) -> StepInputs:
        """Attention metadata and inputs for sequences b running query_lens[b] tokens from
        position starts[b] into the slots of seq_tables[b], keeping the logits of `logits_rows`
        (with token trees, each token's mask and position shift; with adapters, the LoRABatch)."""
        block_size = self.block_size
        num_seqs = len(seq_tables)
        num_tokens = len(token_ids)
        seq_lens = starts + query_lens
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])

        # Block tables cut to the blocks this step reads, padded with block 0.
        max_blocks = int(-(-seq_lens.max() // block_size))
        block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
        for row, table in zip(block_tables, seq_tables):
            num_blocks = min(len(table), max_blocks)
            row[:num_blocks] = table[:num_blocks]

        # Position and slot of every new token.
        token_seq = np.repeat(np.arange(num_seqs), query_lens)
        positions = np.arange(num_tokens) - np.repeat(query_start_loc[:-1] - starts, query_lens)
        slots = (block_tables[token_seq, positions // block_size].astype(np.int64) * block_size
                 + positions % block_size)

        graphs = self.decode_graphs
        if (graphs is not None and lora_batch is None and num_tokens == num_seqs
                and graphs.fits(num_seqs, max_blocks)
                and logits_rows == list(range(num_seqs))):
            decode_batch = DecodeBatch(np.asarray(token_ids, dtype=np.int64), positions, slots,
                                       block_tables, seq_lens.astype(np.int32))
            return StepInputs(None, None, None, None, sampling_seqs, decode_batch)

        device = self.device

        def to(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(array).to(device=device, dtype=dtype, non_blocking=True)

        metadata = AttentionMetadata(
            slot_mapping=to(slots, torch.int64),
            block_tables=to(block_tables, torch.int32),
            seq_lens=to(seq_lens, torch.int32),
            query_start_loc=to(query_start_loc, torch.int32),
            kv_caches=self.kv_caches,
            ops=self.ops,
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            tree_mask=None if tree_mask is None else to(tree_mask, torch.int64))
        if position_shift is not None:
            positions = positions - position_shift
        if self.ops.plan_attention is not None:
            tree_args = {} if tree_mask is None else {"tree_mask": metadata.tree_mask}
            metadata.attention_plan = self.ops.plan_attention(
                metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
                self.kv_caches[0], **tree_args)
        return StepInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.int64).to(device, non_blocking=True),
            positions=to(positions, torch.int64),
            metadata=metadata,
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64).to(device),
            sampling_seqs=sampling_seqs, lora_batch=lora_batch)

    def _adapters(self, inputs: StepInputs):
        """The block in which the model applies the step's adapters (if any)."""
        if self.lora is None:
            return contextlib.nullcontext()
        return self.lora.applying(inputs.lora_batch)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Logits [len(logits_indices), vocab] (fp32): the sampling sequences' last tokens (and
        their drafts')."""
        if inputs.decode_batch is not None:
            return self.decode_graphs.run(inputs.decode_batch)
        # Chunks that sample nothing still fill the cache: they keep no logits.
        with self._adapters(inputs):
            output = self.model(input_ids=inputs.input_ids[None],
                                position_ids=inputs.positions[None],
                                attn_metadata=inputs.metadata, use_cache=False,
                                logits_to_keep=inputs.logits_indices)
        return output.logits[0].float()

    @torch.inference_mode()
    def forward_with_hidden(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """forward's logits and the final (normed) hidden states of the same rows, which
        Medusa's heads read."""
        with self._adapters(inputs):
            hidden = self.model.model(input_ids=inputs.input_ids[None],
                                      position_ids=inputs.positions[None],
                                      attn_metadata=inputs.metadata,
                                      use_cache=False).last_hidden_state[0, inputs.logits_indices]
        return self.model.lm_head(hidden).float(), hidden
