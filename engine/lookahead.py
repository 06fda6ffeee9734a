"""Lookahead decoding (Fu et al. 2024): Jacobi iterations over a window of future positions
make n-grams, and the n-grams that start with a sequence's last token are verified, all in one
forward. Greedy only.

Per sequence the drafter keeps a window of N - 1 rows of W guessed tokens and a pool of n-grams.
One step runs, after the sequence's last token, one TokenTree (engine/token_tree.py) of two
branches: the window, whose column j yields an n-gram for the pool and a new last row (the
Jacobi update), and up to G pool n-grams as chains, the longest one matching the target's argmax
accepted. The policy's size (tokens verified) is split in units of N - 1 tokens: guesses first,
keeping one unit for the window so that the pool keeps filling.
"""
from __future__ import annotations

import random

from engine.drafters import DrafterDefaults, DraftProposal, SpeculatingSeq
from engine.token_tree import TokenTree
from kernels import TREE_WINDOW
from policies.speculation import drafters
from policies.speculation.trees import lookahead_tokens
from policies.types import Sequence, SequenceStatus, StepPlan
from policies.validators import positive_int

GREEDY_ONLY = ("lookahead decoding is greedy only (its Jacobi guesses are verified by argmax "
               "matching): use temperature=0, or another speculative_model for sampling")
MAX_POOL_PER_KEY = 16   # n-grams kept per first token, the latest first


class LookaheadState:
    """One sequence's window (N - 1 rows of W tokens) and n-gram pool (first token -> the
    (N - 1)-token continuations seen, latest last)."""

    def __init__(self, window: list[list[int]]):
        self.window = window
        self.pool: dict[int, list[tuple[int, ...]]] = {}

    def add_ngram(self, ngram: tuple[int, ...]) -> None:
        continuations = self.pool.setdefault(ngram[0], [])
        if ngram[1:] in continuations:
            continuations.remove(ngram[1:])
        continuations.append(ngram[1:])
        del continuations[:-MAX_POOL_PER_KEY]


class LookaheadDrafter(DrafterDefaults):
    kind = drafters.LOOKAHEAD

    def __init__(self, window: int, ngram: int, guesses: int, seed: int = 0):
        positive_int("lookahead_window", window)
        positive_int("lookahead_guesses", guesses)
        if isinstance(ngram, bool) or not isinstance(ngram, int) or ngram < 2:
            raise ValueError(f"lookahead_ngram must be an integer >= 2, got {ngram!r}")
        if lookahead_tokens(window, ngram, guesses) >= TREE_WINDOW:
            raise ValueError(f"lookahead runs (window + guesses) x (ngram - 1) = "
                             f"({window} + {guesses}) x {ngram - 1} tokens per sequence; at most "
                             f"{TREE_WINDOW - 1} fit a tree mask")
        self.window, self.ngram, self.guesses, self.seed = window, ngram, guesses, seed
        self._states: dict[int, tuple[Sequence, LookaheadState]] = {}
        self._columns: dict[int, int] = {}   # seq_id -> window columns run in the last step

    @property
    def num_tokens(self) -> int:
        """The most tokens one step verifies for a sequence."""
        return lookahead_tokens(self.window, self.ngram, self.guesses)

    def step(self, plan: StepPlan, speculating: list[SpeculatingSeq]) -> DraftProposal:
        for seq_id in [seq_id for seq_id, (seq, _) in self._states.items()
                       if seq.status is SequenceStatus.FINISHED]:
            del self._states[seq_id]
        trees = []
        for spec in speculating:
            if not spec.params.greedy:
                raise ValueError(GREEDY_ONLY)
            trees.append(self._tree(spec.seq, spec.num_drafts))
        return DraftProposal([tree.tokens for tree in trees], trees=trees)

    def _state(self, seq: Sequence) -> LookaheadState:
        entry = self._states.get(seq.seq_id)
        if entry is None:
            prompt = seq.request.prompt_token_ids
            rng = random.Random(self.seed * 1_000_003 + seq.seq_id)
            window = [[rng.choice(prompt) for _ in range(self.window)]
                      for _ in range(self.ngram - 1)]
            entry = self._states[seq.seq_id] = (seq, LookaheadState(window))
        return entry[1]

    def _tree(self, seq: Sequence, size: int) -> TokenTree:
        """The window's first W' columns and up to G' pool guesses for the last token."""
        state = self._state(seq)
        rows = self.ngram - 1
        continuations = state.pool.get(seq.token_ids()[-1], [])[::-1]
        units = size // rows
        num_guesses = min(self.guesses, len(continuations), units - 1 if units > 1 else units)
        columns = min(self.window, units - num_guesses)
        self._columns[seq.seq_id] = columns
        tokens, parents, depths, sees = [], [], [], []
        for i in range(rows):
            for j in range(columns):
                tokens.append(state.window[i][j])
                parents.append(None)
                depths.append(1 + i + j)
                seen = sum(1 << column for column in range(j + 1))          # row 0, 0..j
                seen |= sum(1 << (row * columns + j) for row in range(1, i + 1))   # column j
                sees.append(seen)
        for continuation in continuations[:num_guesses]:
            first = len(tokens)
            for depth, token in enumerate(continuation, start=1):
                node = len(tokens)
                tokens.append(token)
                parents.append(-1 if depth == 1 else node - 1)
                depths.append(depth)
                sees.append(sum(1 << chain_node for chain_node in range(first, node + 1)))
        return TokenTree(tokens, parents, depths, sees)

    def observe_verification(self, speculating: list[SpeculatingSeq], trees: list[TokenTree],
                             argmax_rows: list[list[int]]) -> None:
        """The Jacobi update from each tree's target argmax (root row first): the last row's
        guesses close one n-gram per column for the pool and become the window's last row."""
        rows = self.ngram - 1
        for spec, argmax in zip(speculating, argmax_rows):
            columns = self._columns.pop(spec.seq.seq_id, 0)
            if not columns:
                continue
            state = self._state(spec.seq)
            window = state.window
            last_row = (rows - 1) * columns
            guesses = [argmax[1 + last_row + j] for j in range(columns)]
            for j, guess in enumerate(guesses):
                state.add_ngram(tuple(window[i][j] for i in range(rows)) + (guess,))
            for i in range(rows - 1):
                window[i][:columns] = window[i + 1][:columns]
            window[rows - 1][:columns] = guesses
