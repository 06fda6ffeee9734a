"""Verification of draft tokens against the target model: greedy argmax matching, and modified
rejection sampling (Leviathan et al. 2023; Chen et al. 2023), under which every emitted token is
distributed exactly as the target alone would sample it. A deterministic proposal (n-gram lookup)
is the case of a one-hot q. Rows are padded to the longest proposal; the randomness comes in as
arguments so that each row draws from its own generator.
"""
from __future__ import annotations

import torch


def accepted_prefix_lengths(accepted: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """[rows, K] per-draft accept decisions -> [rows] how many leading drafts pass, counting
    only each row's first num_drafts[b]."""
    positions = torch.arange(accepted.shape[1], device=accepted.device)
    accepted = accepted & (positions[None, :] < num_drafts[:, None])
    return accepted.long().cumprod(dim=1).sum(dim=1)


def verify_greedy(target_argmax: torch.Tensor, draft_tokens: torch.Tensor,
                  num_drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Argmax matching: target_argmax [rows, K + 1], draft_tokens [rows, K] -> (num_accepted
    [rows], next_token [rows]), the next token being the target's argmax after the accepted ones."""
    num_accepted = accepted_prefix_lengths(draft_tokens == target_argmax[:, :-1], num_drafts)
    next_token = target_argmax.gather(1, num_accepted[:, None])[:, 0]
    return num_accepted, next_token


def rejection_sample(target_probs: torch.Tensor, draft_tokens: torch.Tensor,
                     draft_probs: torch.Tensor | None, num_drafts: torch.Tensor,
                     uniforms: torch.Tensor, noise: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Modified rejection sampling: draft i is accepted with probability min(1, p(x_i) / q(x_i))
    until the first rejection, whose token is drawn from norm(max(0, p - q)); a bonus token from
    p_{k+1} when all pass. draft_probs None: q one-hot at the draft. Returns (num_accepted [rows],
    next_token [rows])."""
    rows = torch.arange(target_probs.shape[0], device=target_probs.device)
    num_positions = draft_tokens.shape[1]
    target_at_draft = target_probs[:, :num_positions].gather(2, draft_tokens[..., None])[..., 0]
    if draft_probs is None:
        draft_at_draft = torch.ones_like(target_at_draft)
    else:
        draft_at_draft = draft_probs.gather(2, draft_tokens[..., None])[..., 0]
    # u < min(1, p / q)  <=>  u * q < p, with q(x) > 0 for a drawn x; p(x) = 0 never passes.
    num_accepted = accepted_prefix_lengths(uniforms * draft_at_draft < target_at_draft,
                                           num_drafts)

    # The distribution of the next token: max(0, p - q) at a rejection, p after all k passed.
    target_next = target_probs[rows, num_accepted]
    rejected = num_accepted < num_drafts
    draft_index = num_accepted.clamp(max=max(num_positions - 1, 0))
    if num_positions == 0:
        draft_next = torch.zeros_like(target_next)
    elif draft_probs is None:
        draft_next = torch.zeros_like(target_next)
        draft_next[rows, draft_tokens[rows, draft_index]] = 1.0
    else:
        draft_next = draft_probs[rows, draft_index]
    residual = (target_next - draft_next * rejected[:, None]).clamp(min=0)
    # p == q up to rounding leaves no residual mass; such a rejection is (almost) impossible,
    # and p is then the right distribution anyway.
    empty = residual.sum(dim=1) <= 0
    residual = torch.where(empty[:, None], target_next, residual)
    # Exponential race: argmax(w / Exp(1)) draws from w / sum(w), no normalisation needed.
    next_token = (residual / noise).argmax(dim=1)
    return num_accepted, next_token
