"""Turns logits into token ids: greedy, temperature, top-k, top-p, one row per sample with its
own generator, so that a sample's tokens do not depend on what else is in the batch."""
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
        rows = [i for i, g in enumerate(greedy) if not g]
        probs = probabilities(logits[torch.tensor(rows, device=logits.device)],
                              [params[i] for i in rows])
        tokens[rows] = self.draw(probs, [generators[i] for i in rows])
        return tokens.tolist()

    def draw(self, weights: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """One token per row of `weights` [rows, vocab] (non-negative, not necessarily
        normalised), drawn with probability proportional to its weight, row i with generators[i]."""
        # Exponential race: argmax(w / Exp(1)) is a draw from w / sum(w).
        return (weights / self.exponential(weights.shape[0], weights.shape[1], weights.device,
                                           generators)).argmax(dim=-1)

    def exponential(self, rows: int, size: int, device: torch.device,
                    generators: list[torch.Generator | None]) -> torch.Tensor:
        """[rows, size] Exp(1) noise, row i from generators[i] (the default one where None)."""
        noise = torch.empty(rows, size, device=device)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), size, device=device).exponential_(
                generator=self.default_generator)
        for i, generator in enumerate(generators):
            if generator is not None:
                noise[i].exponential_(generator=generator)
        return noise

    def uniform(self, counts: list[int], size: int, device: torch.device,
                generators: list[torch.Generator | None]) -> torch.Tensor:
        """[rows, size] U[0, 1) draws: row i's first counts[i] from generators[i], the rest 0, so
        that a row's draws do not depend on the batch's widest row."""
        draws = torch.zeros(len(counts), size, device=device)
        for i, (count, generator) in enumerate(zip(counts, generators)):
            draws[i, :count].uniform_(generator=generator or self.default_generator)
        return draws


def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from: logits [rows, vocab] over the row's temperature
    (> 0), restricted to its top-k and top-p nucleus, softmaxed."""
    temperatures = torch.tensor([p.temperature for p in params], device=logits.device,
                                dtype=logits.dtype)
    scaled = _apply_top_k_top_p(logits / temperatures[:, None], [p.top_k for p in params],
                                [p.top_p for p in params])
    return torch.softmax(scaled, dim=-1)


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
