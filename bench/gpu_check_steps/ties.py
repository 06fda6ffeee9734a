"""Greedy equality the way the engine can promise it. Two implementations of the same model in
the same dtype (a verification pass and one-token decodes, the engine and HF) round differently,
so where the reference's two best logits lie within that rounding the next greedy token may go
either way, and everything after it with it. The comparison walks both outputs token by token:
equal tokens are compared and pass; the first differing position passes only at a near tie (the
reference's top-2 logit gap below the dtype's resolution at the logit's magnitude) and ends the
comparison there; a difference anywhere else fails. A run passes when, over all its prompts, at
least MIN_COMPARED_SHARE of the tokens were compared, so a run that parts early everywhere
cannot pass on ties alone."""
from __future__ import annotations

import math
from dataclasses import dataclass

# Two roundings of the top logit (one on each side) can swap tokens whose gap is within 2 units
# in the last place: at |logit| ~ 10 that is 0.125 in bf16 and 2e-6 in fp32.
NEAR_TIE_ULPS = 2
# "Most tokens": a run must compare at least this share of its tokens before any near tie ends
# a prompt's comparison.
MIN_COMPARED_SHARE = 0.75
EPSILON = {"bfloat16": 2.0 ** -7, "float16": 2.0 ** -10, "float32": 2.0 ** -23}


def tie_resolution(dtype: str, magnitude: float) -> float:
    """The logit gap below which `dtype`'s rounding may swap two tokens, at |logit| magnitude."""
    if dtype not in EPSILON:
        raise ValueError(f"dtype must be one of {sorted(EPSILON)}, got {dtype!r}")
    exponent = math.floor(math.log2(max(abs(magnitude), 1.0)))
    return NEAR_TIE_ULPS * EPSILON[dtype] * 2.0 ** exponent


@dataclass(frozen=True)
class PromptComparison:
    compared: int                 # positions whose tokens were compared (and equal)
    total: int                    # the reference's output length
    parted_at: int | None         # the first differing position, if any
    near_tie: bool                # whether that position was a near tie
    gap: float | None             # the reference's top-2 logit gap there

    @property
    def ok(self) -> bool:
        return self.parted_at is None or self.near_tie


def compare_prompt(actual: list[int], expected: list[int], gaps: list[float],
                   top_logits: list[float], dtype: str) -> PromptComparison:
    """`actual` against `expected`, where gaps[i] and top_logits[i] are the reference's top-2
    gap and top logit at output position i."""
    if len(gaps) < len(expected) or len(top_logits) < len(expected):
        raise ValueError(f"need a gap and a top logit per expected token ({len(expected)}), got "
                         f"{len(gaps)} and {len(top_logits)}")
    for position, (a, b) in enumerate(zip(actual, expected)):
        if a != b:
            gap = float(gaps[position])
            near = gap < tie_resolution(dtype, top_logits[position])
            return PromptComparison(position, len(expected), position, near, gap)
    if len(actual) != len(expected):   # one stopped early: a difference that is no tie
        shorter = min(len(actual), len(expected))
        return PromptComparison(shorter, len(expected), shorter, False, None)
    return PromptComparison(len(expected), len(expected), None, False, None)


@dataclass(frozen=True)
class RunComparison:
    prompts: list[PromptComparison]
    min_share: float = MIN_COMPARED_SHARE

    @property
    def compared(self) -> int:
        return sum(p.compared for p in self.prompts)

    @property
    def total(self) -> int:
        return sum(p.total for p in self.prompts)

    @property
    def share(self) -> float:
        return self.compared / self.total if self.total else 1.0

    @property
    def ok(self) -> bool:
        return all(p.ok for p in self.prompts) and self.share >= self.min_share

    def summary(self) -> str:
        parted = [(i, p) for i, p in enumerate(self.prompts) if p.parted_at is not None]
        text = f"{self.compared}/{self.total} tokens compared ({self.share:.0%})"
        if not parted:
            return f"identical, {text}"
        where = ", ".join(f"prompt {i} at {p.parted_at} "
                          f"({'near tie' if p.near_tie else 'NOT a tie'}, gap "
                          f"{'-' if p.gap is None else f'{p.gap:.3g}'})" for i, p in parted)
        short = "" if self.share >= self.min_share else \
            f"; under the {self.min_share:.0%} that must be compared"
        return f"{text}; parted: {where}{short}"


def compare_run(actual: list[list[int]], expected: list[list[int]], gaps: list[list[float]],
                top_logits: list[list[float]], dtype: str,
                min_share: float = MIN_COMPARED_SHARE) -> RunComparison:
    return RunComparison([compare_prompt(a, e, g, t, dtype) for a, e, g, t in
                          zip(actual, expected, gaps, top_logits, strict=True)], min_share)


def gaps_and_tops(logits) -> tuple[list[float], list[float]]:
    """Per row of logits [positions, vocab]: the top-2 gap and the top logit."""
    top2 = logits.float().topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).tolist(), top2[:, 0].tolist()


def reference_gaps(model, prompts: list[list[int]], outputs: list[list[int]]
                   ) -> tuple[list[list[float]], list[list[float]]]:
    """The reference's top-2 logit gap and top logit at each output position: one
    teacher-forced forward of prompt + output through the model's own (sdpa) attention."""
    import torch

    device = next(model.parameters()).device
    gaps, tops = [], []
    previous = getattr(model.config, "_attn_implementation", None)
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            for prompt, output in zip(prompts, outputs):
                tokens = torch.tensor([prompt + output[:-1]], device=device)
                gap, top = gaps_and_tops(model(tokens).logits[0, len(prompt) - 1:])
                gaps.append(gap)
                tops.append(top)
    finally:
        if previous is not None:   # the engine's paged attention, on an engine's model
            model.set_attn_implementation(previous)
    return gaps, tops
