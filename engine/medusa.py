"""Medusa (Cai et al. 2024): K small heads on the target's last hidden state propose a token tree.

Head k reads the hidden state of the position that produced a sequence's last token and predicts
k tokens further: a residual block (h + SiLU(W h + b)) and a projection to the vocabulary. The
tree shape is a list of paths of candidate ranks ((0,), (0, 0), (1,), ...); a step verifies the
first as many paths as the speculation policy sizes it. The executor hands the heads each
sequence's hidden state after every step (observe_hidden).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.drafters import DrafterDefaults, DraftProposal, SpeculatingSeq
from engine.token_tree import DEFAULT_TYPICAL_DELTA, DEFAULT_TYPICAL_EPSILON, TokenTree
from policies.speculation import drafters
from policies.speculation.drafters import MEDUSA_HEADS_CONFIG as HEADS_CONFIG
from policies.speculation.trees import path_parents
from policies.types import Request, Sequence, StepPlan

HEADS_WEIGHTS = "medusa_heads.safetensors"


class MedusaHeads(torch.nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int):
        super().__init__()
        self.hidden_size, self.vocab_size, self.num_heads = hidden_size, vocab_size, num_heads
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(hidden_size, hidden_size)
                                          for _ in range(num_heads))
        self.projections = torch.nn.ModuleList(torch.nn.Linear(hidden_size, vocab_size,
                                                               bias=False)
                                               for _ in range(num_heads))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [rows, hidden_size] -> logits [num_heads, rows, vocab]."""
        return torch.stack([projection(hidden + torch.nn.functional.silu(block(hidden)))
                            for block, projection in zip(self.blocks, self.projections)])

    @classmethod
    def seeded(cls, lm_head: torch.nn.Linear, num_heads: int, seed: int) -> "MedusaHeads":
        """Untrained heads for tests: small seeded residual blocks, projections copied from the
        target's LM head (Medusa's initialisation)."""
        hidden_size = lm_head.weight.shape[1]
        heads = cls(hidden_size, lm_head.weight.shape[0], num_heads)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for block, projection in zip(heads.blocks, heads.projections):
                block.weight.copy_(torch.randn(block.weight.shape, generator=generator) * 0.02)
                block.bias.zero_()
                projection.weight.copy_(lm_head.weight.detach().float().cpu())
        return heads.to(lm_head.weight.device, lm_head.weight.dtype)

    def save(self, folder: str | Path, target: str = "") -> None:
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({name: tensor.contiguous() for name, tensor in self.state_dict().items()},
                  folder / HEADS_WEIGHTS)
        (folder / HEADS_CONFIG).write_text(json.dumps(
            {"num_heads": self.num_heads, "hidden_size": self.hidden_size,
             "vocab_size": self.vocab_size, "target": target}, indent=2) + "\n")

    @classmethod
    def load(cls, folder: str | Path, device: torch.device, dtype: torch.dtype) -> "MedusaHeads":
        from safetensors.torch import load_file

        folder = Path(folder)
        if not (folder / HEADS_CONFIG).is_file() or not (folder / HEADS_WEIGHTS).is_file():
            raise ValueError(f"medusa_heads={str(folder)!r} is not a Medusa heads folder (it "
                             f"needs {HEADS_CONFIG} and {HEADS_WEIGHTS}; "
                             f"scripts/train_medusa.py writes them)")
        config = json.loads((folder / HEADS_CONFIG).read_text())
        heads = cls(config["hidden_size"], config["vocab_size"], config["num_heads"])
        heads.load_state_dict(load_file(folder / HEADS_WEIGHTS))
        return heads.to(device, dtype)


class MedusaDrafter(DrafterDefaults):
    """Proposes each speculating sequence's tree from its heads' top candidates."""

    kind = drafters.MEDUSA

    def __init__(self, heads: MedusaHeads, paths: list[tuple[int, ...]],
                 typical_epsilon: float = DEFAULT_TYPICAL_EPSILON,
                 typical_delta: float = DEFAULT_TYPICAL_DELTA):
        self.heads = heads
        self.paths = paths
        self.parents = path_parents(paths)
        self.typical_epsilon, self.typical_delta = typical_epsilon, typical_delta
        # (request id, sample index) -> (request, hidden state of its last token's row)
        self._hidden: dict[tuple[int, int], tuple[Request, torch.Tensor]] = {}

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    @torch.inference_mode()
    def step(self, plan: StepPlan, speculating: list[SpeculatingSeq]) -> DraftProposal:
        trees = [TokenTree.from_parents([], []) for _ in speculating]
        keys = [_sample_key(spec.seq) for spec in speculating]
        rows = [row for row, key in enumerate(keys) if key in self._hidden]
        if rows:
            hidden = torch.stack([self._hidden[keys[row]][1] for row in rows])
            max_rank = max(path[-1] for path in self.paths) + 1
            # [heads, rows, max_rank] candidates, best first.
            candidates = self.heads(hidden).topk(max_rank, dim=-1).indices.tolist()
            for index, row in enumerate(rows):
                num_nodes = min(speculating[row].num_drafts, len(self.paths))
                tokens = [candidates[len(path) - 1][index][path[-1]]
                          for path in self.paths[:num_nodes]]
                trees[row] = TokenTree.from_parents(tokens, self.parents[:num_nodes])
        return DraftProposal([tree.tokens for tree in trees], trees=trees)

    def observe_hidden(self, seqs: list[Sequence], hidden: torch.Tensor,
                       rows: dict[int, int]) -> None:
        """Keep the hidden state of the row that gave each sequence its last token (for a
        request about to fork its samples, theirs too); forget finished requests."""
        for key in [key for key, (request, _) in self._hidden.items() if request.is_finished]:
            del self._hidden[key]
        for seq in seqs:
            request, state = seq.request, hidden[rows[seq.seq_id]].clone()
            if not seq.output_token_ids and request.n > len(request.sequences):
                for sample in range(request.n):   # the forks are drawn from this row too
                    self._hidden[request.request_id, sample] = (request, state)
            else:
                self._hidden[_sample_key(seq)] = (request, state)


def _sample_key(seq: Sequence) -> tuple[int, int]:
    """(request id, which of its samples seq is)."""
    sequences = seq.request.sequences
    return seq.request.request_id, 0 if len(sequences) == 1 else sequences.index(seq)
