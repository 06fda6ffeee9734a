"""Drafters as both backends and the profiler know them: the table of drafter kinds, the
`Drafter` protocol the engine's drafters satisfy, and `TreeSpec`, a token-tree method's shape."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

from policies.speculation.trees import (MAX_TREE_TOKENS, lookahead_depth_per_size,
                                        lookahead_tokens, medusa_depth_per_size, tree_paths)
from policies.types import StepPlan

MEDUSA_HEADS_CONFIG = "medusa_config.json"   # written by scripts/train_medusa.py
DEFAULT_LOOKAHEAD_WINDOW = 4
DEFAULT_LOOKAHEAD_GUESSES = 4


@dataclass(frozen=True)
class DrafterKind:
    """What a drafter is, for everything that is not the drafter itself."""

    name: str
    tree: bool   # a token tree: the policy's k is the tokens a step verifies
    # "tree_depth": a tree that changes every step; "tree_node": a fixed tree.
    acceptance: Literal["chain", "tree_depth", "tree_node"]
    draft_cost: Literal["lookup", "heads", "model"]
    reads_hidden_states: bool = False


NGRAM = DrafterKind("ngram", tree=False, acceptance="chain", draft_cost="lookup")
MEDUSA = DrafterKind("medusa", tree=True, acceptance="tree_node", draft_cost="heads",
                     reads_hidden_states=True)
LOOKAHEAD = DrafterKind("lookahead", tree=True, acceptance="tree_depth", draft_cost="lookup")
DRAFT_MODEL = DrafterKind("draft_model", tree=False, acceptance="chain", draft_cost="model")
# Every name not here is a draft model (a conf/model name or a folder).
DRAFTER_KINDS = {kind.name: kind for kind in (NGRAM, MEDUSA, LOOKAHEAD)}
TREE_DRAFTERS = tuple(name for name, kind in DRAFTER_KINDS.items() if kind.tree)


def drafter_kind(draft_model: str) -> DrafterKind:
    """The kind of the drafter a run names (`speculative_model`, `speculation.draft_model`)."""
    return DRAFTER_KINDS.get(draft_model, DRAFT_MODEL)


@runtime_checkable
class Drafter(Protocol):
    """Proposes the drafts the target verifies: the engine calls `step` before the target's
    forward, then `observe_hidden` (when `kind.reads_hidden_states`) and `observe_verification`."""

    kind: DrafterKind

    def step(self, plan: StepPlan, speculating: list) -> object:
        """The drafts of the plan's speculating decodes (a DraftProposal)."""
    def observe_hidden(self, seqs: list, hidden: object, rows: dict[int, int]) -> None:
        """The target's hidden states of the step's sampled rows (seq_id -> row)."""
    def observe_verification(self, speculating: list, trees: list, argmax_rows: list) -> None:
        """What the target verified of each speculating sequence's tree."""


@dataclass
class TreeSpec:
    """A token-tree method's shape: Medusa's heads and tree, or lookahead's window, n-gram and
    guesses; max_depth is the most tokens a step accepts beyond its own."""

    method: str                     # MEDUSA.name or LOOKAHEAD.name
    max_depth: int
    medusa_heads: str | None = None
    tree: list | None = None        # Medusa's (policies.speculation.trees.tree_paths)
    lookahead_window: int = DEFAULT_LOOKAHEAD_WINDOW
    lookahead_ngram: int | None = None
    lookahead_guesses: int = DEFAULT_LOOKAHEAD_GUESSES

    def num_medusa_heads(self) -> int:
        if self.medusa_heads is None:
            return self.max_depth   # seeded random heads, one per depth
        config = Path(self.medusa_heads) / MEDUSA_HEADS_CONFIG
        if not config.is_file():
            raise ValueError(f"medusa_heads={self.medusa_heads!r} has no {MEDUSA_HEADS_CONFIG} "
                             f"(scripts/train_medusa.py writes Medusa heads folders)")
        return json.loads(config.read_text())["num_heads"]

    def medusa_paths(self) -> list[tuple[int, ...]]:
        return tree_paths(self.tree, self.num_medusa_heads(), self.max_depth)

    def ngram(self) -> int:
        return self.lookahead_ngram if self.lookahead_ngram is not None else self.max_depth + 1

    def depth_per_size(self) -> list[int]:
        """For each size 0..num_tokens() a step may verify, the most tokens it can accept."""
        if self.method == MEDUSA.name:
            return medusa_depth_per_size(self.medusa_paths())
        window, ngram, guesses = self.lookahead_window, self.ngram(), self.lookahead_guesses
        if lookahead_tokens(window, ngram, guesses) > MAX_TREE_TOKENS:
            raise ValueError(f"lookahead runs (lookahead_window + lookahead_guesses) x "
                             f"(lookahead_ngram - 1) = ({window} + {guesses}) x {ngram - 1} "
                             f"tokens per sequence; at most {MAX_TREE_TOKENS} fit a tree mask")
        return lookahead_depth_per_size(window, ngram, guesses)

    def num_tokens(self) -> int:
        """The most tokens a step verifies per sequence: the policy's largest size."""
        return len(self.depth_per_size()) - 1
