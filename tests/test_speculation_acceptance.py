"""How much the token-tree drafters accept on the trained tiny target (models/tiny-pair), bounded
below: the other tree tests hold the output to the target's and acceptance only to 0 < accepts <
trials, which a drafter proposing mostly wrong tokens also passes.

Both runs are deterministic (greedy, fp32 on one thread, the drafters seeded), so each bound is
the measured count less a margin for another machine's rounding; the comment beside each says
what it was and what the breakage it guards gave.
"""
from __future__ import annotations

import sys
from pathlib import Path

from engine import LLM, SamplingParams

from factories import token_ids

REPO = Path(__file__).resolve().parents[1]
TARGET = str(REPO / "models" / "tiny-pair" / "target")
MEDUSA_HEADS = str(REPO / "models" / "tiny-pair" / "medusa")
sys.path.insert(0, str(REPO / "scripts"))

from train_tiny_pair import held_out_prompts  # noqa: E402


def accepted(llm, prompts, max_tokens):
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                   ignore_eos=True), use_tqdm=False)
    assert llm.last_stats.num_accepted_tokens == sum(llm.executor.acceptance_stats
                                                     .position_accepts)
    return llm.last_stats.num_accepted_tokens, token_ids(outputs)


def test_trained_medusa_heads_accept_far_more_than_seeded_ones():
    """4 held-out prompts (files scripts/train_tiny_pair.py never trained on) x 60 tokens, a tree
    3 deep. Measured: trained heads 141 of 240 tokens accepted, seeded (untrained) heads 56;
    the trained heads not loaded (engine/medusa.py without load_state_dict): 0."""
    prompts = held_out_prompts(4, 64)
    runs = {heads: accepted(LLM(TARGET, speculative_model="medusa", num_speculative_tokens=3,
                                medusa_heads=heads, num_gpu_blocks=256), prompts, 60)
            for heads in (MEDUSA_HEADS, None)}
    (trained, trained_outputs), (seeded, seeded_outputs) = runs[MEDUSA_HEADS], runs[None]
    assert trained_outputs == seeded_outputs     # both are the target's greedy tokens
    assert trained >= 110, (trained, seeded)     # 141 measured
    assert trained >= 2 * seeded, (trained, seeded)   # 2.5x measured


# Source lines repeated: the target's greedy continuation repeats too ("the compiler in the
# compiler in the ..."), so the Jacobi window's n-grams come true.
REPETITIVE = [b"        self.assertEqual(a, b)\n" * 6, b"import os\nimport sys\n" * 6]


def test_lookahead_accepts_on_repetitive_prompts():
    """Two repetitive prompts x 100 tokens in one batch, lookahead 4 tokens deep (the default
    window, n-gram and guesses). Measured: 92 of 200 accepted; with the Jacobi update off by
    one position (engine/lookahead.py taking argmax[last_row + j] for argmax[1 + last_row + j]):
    28. The bound leaves 24 % below the measured count and is 2.5x the broken one."""
    count, _ = accepted(LLM(TARGET, speculative_model="lookahead", num_speculative_tokens=4,
                            num_gpu_blocks=256), [list(prompt) for prompt in REPETITIVE], 100)
    assert count >= 70, count
