"""Drafters for speculative decoding: who proposes the k tokens the target model verifies.

- `NgramDrafter` (prompt lookup): the tokens that followed the latest earlier occurrence of the
  sequence's last n tokens; no model, q one-hot.
- `DraftModelDrafter`: a smaller model with the target's vocabulary, whose K/V shares the
  target's pool and block tables; it runs every step's scheduled tokens to keep pace with the
  target, then k - 1 single-token steps for the speculating sequences.

Where the draft model lags the target (after a step that accepted all its drafts), the sequence
records it (`Sequence.draft_lag`) so that the simulator's cost model sees the same extra tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from engine.model_runner import ModelRunner, new_token_ids
from engine.sampler import Sampler, probabilities
from engine.sampling_params import SamplingParams
from engine.token_tree import TokenTree
from policies.speculation import drafters
from policies.speculation.drafters import DrafterKind
from policies.types import Sequence, StepPlan


@dataclass
class SpeculatingSeq:
    """A decode that speculates this step, and how it samples."""

    seq: Sequence
    num_drafts: int                     # k from the plan: at most this many drafts
    params: SamplingParams
    generator: torch.Generator | None   # the request's sample generator (None: the default)


@dataclass
class DraftProposal:
    tokens: list[list[int]]             # per speculating sequence (in order), 0..k drafts
    # The q each sampled row's drafts were drawn from [seqs, max k, vocab]; None when one-hot.
    probs: torch.Tensor | None = None
    # Tree drafters (Medusa, lookahead): a TokenTree per speculating sequence instead of `tokens`.
    trees: list[TokenTree] | None = None


class DrafterDefaults:
    """The optional hooks of policies.speculation.drafters.Drafter, doing nothing: a drafter
    that reads no hidden states and keeps no state across verifications inherits them."""

    kind: DrafterKind

    def observe_hidden(self, seqs: list[Sequence], hidden: torch.Tensor,
                       rows: dict[int, int]) -> None:
        pass

    def observe_verification(self, speculating: list[SpeculatingSeq], trees: list[TokenTree],
                             argmax_rows: list) -> None:
        pass


class NgramDrafter(DrafterDefaults):
    """Prompt lookup: propose the (up to k) tokens that followed the latest earlier occurrence of
    the longest suffix n-gram; no match, no drafts."""

    kind = drafters.NGRAM

    def __init__(self, min_n: int = 1, max_n: int = 3):
        if not (isinstance(min_n, int) and isinstance(max_n, int) and 1 <= min_n <= max_n):
            raise ValueError(f"n-gram sizes must be integers with 1 <= min_n <= max_n, got "
                             f"min_n={min_n!r}, max_n={max_n!r}")
        self.min_n = min_n
        self.max_n = max_n

    def step(self, plan: StepPlan, speculating: list[SpeculatingSeq]) -> DraftProposal:
        return DraftProposal([ngram_lookup(np.asarray(s.seq.token_ids()), s.num_drafts,
                                           self.min_n, self.max_n) for s in speculating])


def ngram_lookup(token_ids: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix n-gram
    of `token_ids`; [] when none recurs. (The latest, not the first with k tokens after it: that
    proposed more but worse drafts on Python source.)"""
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows starting at 0 .. length - n - 1: each is followed by at least one token.
        windows = sliding_window_view(token_ids[:-1], n)
        matches = np.flatnonzero((windows == token_ids[-n:]).all(axis=1))
        if len(matches):
            follow = matches[-1] + n
            return token_ids[follow:follow + k].tolist()
    return []


class DraftModelDrafter(DrafterDefaults):
    """A small model proposes k tokens by k sequential batched steps."""

    kind = drafters.DRAFT_MODEL

    def __init__(self, runner: ModelRunner, sampler: Sampler):
        self.runner = runner
        self.sampler = sampler

    def step(self, plan: StepPlan, speculating: list[SpeculatingSeq]) -> DraftProposal:
        proposal = DraftProposal([[] for _ in speculating])
        logits = self._keep_pace(plan, speculating)
        if not speculating:
            return proposal
        max_drafts = max(s.num_drafts for s in speculating)
        if any(not s.params.greedy for s in speculating):
            proposal.probs = torch.zeros(len(speculating), max_drafts, logits.shape[1],
                                         device=logits.device)
        active = list(range(len(speculating)))   # rows still drafting
        for position in range(max_drafts):
            if position:
                active = [row for row in active if speculating[row].num_drafts > position]
                logits = self._decode(plan, speculating, active, proposal.tokens, position)
            tokens = self._draw(logits, [speculating[row] for row in active], proposal.probs,
                                active, position)
            for row, token in zip(active, tokens):
                proposal.tokens[row].append(token)
        return proposal

    def _keep_pace(self, plan: StepPlan, speculating: list[SpeculatingSeq]) -> torch.Tensor:
        """Run the draft over the step's scheduled tokens (from earlier where it lags); logits
        [len(speculating), vocab] at the speculating sequences' last tokens."""
        speculating_ids = {s.seq.seq_id for s in speculating}
        token_ids: list[int] = []
        starts = np.empty(len(plan.seqs), dtype=np.int64)
        query_lens = np.empty(len(plan.seqs), dtype=np.int64)
        tables = []
        logits_rows = []
        for index, (seq, num_new) in enumerate(zip(plan.seqs, plan.num_new_tokens)):
            lag = min(seq.draft_lag, seq.num_computed_tokens)
            start = seq.num_computed_tokens - lag
            num_new += lag
            starts[index], query_lens[index] = start, num_new
            token_ids += new_token_ids(seq, start, num_new)
            tables.append(plan.block_tables[seq.seq_id])
            if seq.seq_id in speculating_ids:
                logits_rows.append(len(token_ids) - 1)
        inputs = self.runner.build(token_ids, starts, query_lens, tables, logits_rows, [])
        return self.runner.forward(inputs)

    def _decode(self, plan: StepPlan, speculating: list[SpeculatingSeq], rows: list[int],
                drafts: list[list[int]], position: int) -> torch.Tensor:
        """One token for each of `rows`: its draft `position - 1`, at sequence position
        num_tokens + position - 1. Logits [len(rows), vocab]."""
        seqs = [speculating[row].seq for row in rows]
        starts = np.array([seq.num_tokens + position - 1 for seq in seqs], dtype=np.int64)
        inputs = self.runner.build(
            [drafts[row][-1] for row in rows], starts, np.ones(len(rows), dtype=np.int64),
            [plan.block_tables[seq.seq_id] for seq in seqs], list(range(len(rows))), [])
        return self.runner.forward(inputs)

    def _draw(self, logits: torch.Tensor, specs: list[SpeculatingSeq],
              probs: torch.Tensor | None, rows: list[int], position: int) -> list[int]:
        """Each row's draft: argmax when greedy, else a draw from its q (kept in probs)."""
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, spec in enumerate(specs) if not spec.params.greedy]
        if sampled:
            q = probabilities(logits[sampled], [specs[i].params for i in sampled])
            probs[[rows[i] for i in sampled], position] = q
            tokens[sampled] = self.sampler.draw(q, [specs[i].generator for i in sampled])
        return tokens.tolist()
