"""Token trees: speculative tokens verified after a sequence's last token in one forward pass,
and how a verified tree is accepted.

Node i takes the cache slot r + 1 + i after the root, as a chain of drafts would, so that the
scheduler reserves and trims slots as it does for k drafts; the model sees it at position
r + depths[i], attending to the nodes in its `sees` bitmask. After verification the accepted
path's K/V moves to the slots right after the root (compaction_moves), so that the cache is again
the sequence's tokens in order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels import TREE_WINDOW, tree_mask_entry

# Medusa's typical acceptance: its posterior_threshold (epsilon) and alpha (delta = sqrt(epsilon)).
DEFAULT_TYPICAL_EPSILON = 0.09
DEFAULT_TYPICAL_DELTA = math.sqrt(DEFAULT_TYPICAL_EPSILON)


@dataclass
class TokenTree:
    tokens: list[int]
    parents: list[int | None]   # per node: its parent (-1: the root), None: never accepted
    depths: list[int]           # per node: positions after the root (1 for the root's children)
    sees: list[int]             # per node: bit j set if it sees node j (j < i)

    def __post_init__(self):
        num_nodes = len(self.tokens)
        if not len(self.parents) == len(self.depths) == len(self.sees) == num_nodes:
            raise ValueError("a token tree needs a parent, a depth and a mask for every token")
        if num_nodes >= TREE_WINDOW:
            raise ValueError(f"a token tree holds at most {TREE_WINDOW - 1} tokens, got "
                             f"{num_nodes}")
        for node, parent in enumerate(self.parents):
            if parent is not None and not -1 <= parent < node:
                raise ValueError(f"node {node}'s parent {parent} must be -1 (the root) or an "
                                 f"earlier node")

    @classmethod
    def from_parents(cls, tokens: list[int], parents: list[int]) -> "TokenTree":
        """A tree of candidates: each node sees its ancestors."""
        depths: list[int] = []
        sees: list[int] = []
        for node, parent in enumerate(parents):
            if not -1 <= parent < node:
                raise ValueError(f"node {node}'s parent {parent} must be -1 (the root) or an "
                                 f"earlier node")
            depths.append(1 if parent < 0 else depths[parent] + 1)
            sees.append((1 << node) | (sees[parent] if parent >= 0 else 0))
        return cls(list(tokens), list(parents), depths, sees)

    @classmethod
    def chain(cls, tokens: list[int]) -> "TokenTree":
        """k drafts in a row: plain speculative decoding as a tree."""
        return cls.from_parents(tokens, list(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depth(self) -> int:
        """The most tokens a step can accept from it."""
        return max((d for d, p in zip(self.depths, self.parents) if p is not None), default=0)

    def mask_entries(self) -> list[int]:
        """tree_mask entries of the root and every node (node i sits i + 1 positions after the
        root: node j is i - j positions before it)."""
        entries = [-1]
        for node, sees in enumerate(self.sees):
            entries.append(tree_mask_entry([node - other for other in range(node)
                                            if not (sees >> other) & 1]))
        return entries

    def accepted_path(self, accepted: list[bool]) -> list[int]:
        """The longest path from the root whose candidates are all accepted (`accepted[i]`:
        node i passed its parent's test), as node indices; the first such path on ties."""
        reach = [0] * len(self.tokens)   # path length to node i, 0 where it is not reached
        best = -1
        for node, parent in enumerate(self.parents):
            if parent is None or not accepted[node]:
                continue
            if parent < 0:
                reach[node] = 1
            elif reach[parent]:
                reach[node] = reach[parent] + 1
            if reach[node] and (best < 0 or reach[node] > reach[best]):
                best = node
        path = []
        while best >= 0:
            path.append(best)
            best = self.parents[best]
        return path[::-1]

    def parent_rows(self) -> list[int]:
        """Per node, the logits row (0: the root, 1 + j: node j) of the token it follows."""
        return [0 if parent is None or parent < 0 else parent + 1 for parent in self.parents]


def greedy_accepts(tree: TokenTree, argmax: list[int]) -> list[bool]:
    """Node i passes if its token is the target's argmax after its parent (argmax per row:
    the root's, then each node's)."""
    return [argmax[row] == token for row, token in zip(tree.parent_rows(), tree.tokens)]


def typical_accepts(tree: TokenTree, probs: torch.Tensor, epsilon: float,
                    delta: float) -> list[bool]:
    """Medusa's typical acceptance: node i passes if the target gives its token a probability
    above min(epsilon, delta * exp(-entropy)); not distribution-exact."""
    rows = torch.tensor(tree.parent_rows(), dtype=torch.long, device=probs.device)
    parent_probs = probs[rows]
    entropy = -(parent_probs * torch.log(parent_probs.clamp(min=1e-20))).sum(dim=-1)
    threshold = torch.clamp(delta * torch.exp(-entropy), max=epsilon)
    tokens = torch.tensor(tree.tokens, dtype=torch.long, device=probs.device)
    token_probs = parent_probs.gather(1, tokens[:, None])[:, 0]
    return (token_probs > threshold).tolist()


def compaction_moves(block_table: list[int], block_size: int, root_position: int,
                     path: list[int]) -> list[tuple[int, int]]:
    """(source slot, destination slot) for the accepted path's K/V (node path[j] goes to
    root + 1 + j); no source lies before its destination, so all can move at once."""
    def slot(position: int) -> int:
        return block_table[position // block_size] * block_size + position % block_size

    return [(slot(root_position + 1 + node), slot(root_position + 1 + j))
            for j, node in enumerate(path) if node != j]
