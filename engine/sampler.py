"""Turns logits into token ids: greedy, temperature, top-k, top-p, with a per-row generator.

One row per sample to draw. Every row is handled by the same vectorized operations and depends
only on its own logits and generator, so a sample's tokens do not depend on what else is in the
batch: sample j of a request seeded s draws from a generator seeded s + j, exactly as a lone
request seeded s + j would.
"""
from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams


class Sampler:
    def __init__(self, device: torch.device, seed: int):
        # Rows without a seed of their own share this one: reproducible run to run, though
        # their draws depend on the batch they land in.
        self.default_generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> list[int]:
        """logits [rows, vocab] fp32 -> one token id per row."""
        greedy = [p.temperature == 0 for p in params]
        tokens = logits.argmax(dim=-1)
        if all(greedy):
            return tokens.tolist()
        device = logits.device
        rows = torch.tensor([i for i, g in enumerate(greedy) if not g], device=device)
        sampled_params = [params[i] for i in rows.tolist()]
        row_generators = [generators[i] for i in rows.tolist()]
        scaled = logits[rows] / torch.tensor([p.temperature for p in sampled_params],
                                             device=device, dtype=logits.dtype)[:, None]
        scaled = _apply_top_k_top_p(scaled, [p.top_k for p in sampled_params],
                                    [p.top_p for p in sampled_params])
        probs = torch.softmax(scaled, dim=-1)
        # Gumbel-style race: argmax(p / Exp(1)) is a draw from p, one noise vector per row.
        noise = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(row_generators) if g is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1],
                                          device=device).exponential_(
                                              generator=self.default_generator)
        for i, generator in enumerate(row_generators):
            if generator is not None:
                noise[i].exponential_(generator=generator)
        tokens[rows] = (probs / noise).argmax(dim=-1)
        return tokens.tolist()


def _apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Set what falls outside each row's top-k and top-p nucleus to -inf (at least one token
    is always kept)."""
    vocab = logits.shape[1]
    use_top_k = any(0 < k < vocab for k in top_k)
    use_top_p = any(p < 1 for p in top_p)
    if not (use_top_k or use_top_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    ranks = torch.arange(vocab, device=logits.device)
    if use_top_k:
        k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=logits.device)
        remove |= ranks[None, :] >= k[:, None]
    if use_top_p:
        p = torch.tensor(top_p, device=logits.device, dtype=logits.dtype)
        probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        remove |= mass_before >= p[:, None]
    remove[:, 0] = False
    return logits.scatter(1, order, sorted_logits.masked_fill(remove, float("-inf")))
