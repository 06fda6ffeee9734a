"""Step: speculative decoding on the device: the trained tiny pair's target with each drafter
(a draft model, n-gram prompt lookup, trained Medusa heads, lookahead), greedy, against the
target alone in the same dtype: token-identical up to near ties (ties.py) in bf16, the device's
dtype for the pair, and in fp32; each must accept drafts. The swap case with k = 5 and the draft
model is tests/test_speculative_engine.py's that parted at a near tie on the first GPU."""
from __future__ import annotations

from gpu_check_steps.common import REPO, StepReport
from gpu_check_steps.engine import GreedyReference, TINY_PAIR_TARGET, compare_greedy, \
    text_prompts

PAIR = REPO / "models" / "tiny-pair"
MAX_TOKENS = 40   # tests/test_speculative_engine.py's
# (label, LLM keyword arguments): each drafter at the tests' k.
DRAFTERS = [
    ("draft model, k=5", dict(speculative_model=str(PAIR / "draft"), num_speculative_tokens=5)),
    ("n-gram, k=3", dict(speculative_model="ngram", num_speculative_tokens=3)),
    ("Medusa (trained heads), k=3", dict(speculative_model="medusa", num_speculative_tokens=3,
                                         medusa_heads=str(PAIR / "medusa"))),
    ("lookahead, k=4", dict(speculative_model="lookahead", num_speculative_tokens=4)),
]
# 80 blocks of 4 slots: the longest request alone needs 68 (+ drafts), all together 192
# (--smoke: 16 blocks, of the 28 its three requests need).
SWAP = dict(block_size=4, preemption="swap", swap_space_gb=0.01)
SMOKE_PROMPT_LENS, SMOKE_MAX_TOKENS = [1, 40, 17], 16   # lookahead accepts from ~12 tokens


def step_speculative(report: StepReport, smoke: bool) -> None:
    import torch

    from engine import LLM
    device = torch.device("cpu" if smoke else "cuda")
    prompts = text_prompts(SMOKE_PROMPT_LENS) if smoke else text_prompts()
    max_tokens = SMOKE_MAX_TOKENS if smoke else MAX_TOKENS
    # --smoke: the torch kernels (the interpreter would take minutes; the engine and kernels
    # steps run it).
    kernels = "torch" if smoke else "triton"
    common = dict(device=str(device), kernel_backend=kernels)
    for dtype in ("bfloat16", "float32"):
        target = LLM(TINY_PAIR_TARGET, dtype=dtype, num_gpu_blocks=256, **common)
        outputs = [list(out.outputs[0].token_ids) for out in target.generate(
            prompts, _greedy(max_tokens), use_tqdm=False)]
        reference = GreedyReference(outputs, target.model, prompts, dtype)
        del target
        short = {"bfloat16": "bf16", "float32": "fp32"}[dtype]
        cases = [(label, dict(kwargs, num_gpu_blocks=256)) for label, kwargs in DRAFTERS]
        cases.append(("draft model, k=5, swap preemption",
                      dict(DRAFTERS[0][1], num_gpu_blocks=16 if smoke else 80, **SWAP)))
        for label, kwargs in cases:
            llm = LLM(TINY_PAIR_TARGET, dtype=dtype, **common, **kwargs)
            checks = {"num_accepted_tokens": "> 0"}
            if "swap" in label:
                checks["num_swapped_out_blocks"] = "> 0"
            compare_greedy(report, f"tiny pair {short}: {label}", llm, prompts, reference,
                           device, max_tokens, kernels, require_graphs=False, **checks)
            # Each sequence's step yields one token and its accepted drafts.
            stats = llm.last_stats
            per_step = stats.num_output_tokens / max(
                stats.num_output_tokens - stats.num_accepted_tokens, 1)
            report.measure(f"  tokens per sequence step ({label})",
                           f"{per_step:.2f}, {stats.num_accepted_tokens} drafts accepted of "
                           f"{stats.num_output_tokens} output tokens",
                           tokens_per_step=per_step, accepted=stats.num_accepted_tokens)
            del llm


def _greedy(max_tokens: int):
    from engine import SamplingParams
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
