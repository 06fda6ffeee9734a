"""Step: the engine on the Triton kernels against HF generate on the same model object: fp32
tiny-llama token-identical under continuous batching (CUDA graphs and eager), chunked prefill,
recompute and swap preemption, prefix caching; the trained tiny pair's target in bf16 compared
tie-aware (ties.py); adapters of 3 ranks and the base model in one batch against HF + PEFT
(lora.py); the tiny mixture of experts (tiny-moe). Also the greedy comparison the speculative
step shares."""
from __future__ import annotations

from pathlib import Path

from gpu_check_steps.common import REPO, StepReport
from gpu_check_steps.lora import check_lora_engine
from gpu_check_steps.ties import compare_run, reference_gaps

ENGINE_PROMPT_LENS = [1, 7, 16, 17, 33, 64, 100]  # tests/test_engine.py's
ENGINE_MAX_TOKENS = 16
TINY_PAIR_TARGET = str(REPO / "models" / "tiny-pair" / "target")
TEXT_PROMPT_LENS = [1, 17, 40, 90, 150, 230]   # tests/test_speculative_engine.py's


def text_prompts(lengths=TEXT_PROMPT_LENS) -> list[list[int]]:
    """Byte prompts cut from a Python source (what the tiny pair was trained on), ragged
    lengths: tests/test_speculative_engine.py's."""
    import textwrap
    source = Path(textwrap.__file__).read_bytes()
    return [list(source[start:start + length])
            for start, length in zip(range(0, 3000 * len(lengths), 3000), lengths)]


def hf_greedy(model, prompts, max_tokens, device):
    """HF generate, one unpadded prompt at a time, with the model's own sdpa attention."""
    import torch

    from engine.attention import PAGED_ATTENTION
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            return [model.generate(torch.tensor([p], device=device), max_new_tokens=max_tokens,
                                   min_new_tokens=max_tokens, do_sample=False,
                                   pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    finally:
        model.set_attn_implementation(PAGED_ATTENTION)


class GreedyReference:
    """The reference's greedy outputs, with (tie_dtype set) its top-2 logit gaps for the
    tie-aware comparison; tie_dtype None: token-identical is required."""

    def __init__(self, outputs, model=None, prompts=None, tie_dtype: str | None = None):
        self.outputs, self.tie_dtype = outputs, tie_dtype
        self.gaps = self.tops = None
        if tie_dtype is not None:
            self.gaps, self.tops = reference_gaps(model, prompts, outputs)


def compare_greedy(report: StepReport, label: str, llm, prompts, reference: GreedyReference,
                   device, max_tokens: int = ENGINE_MAX_TOKENS, kernels: str = "triton",
                   require_graphs: bool = True, lora_id=None, **stats_checks) -> None:
    """The engine's greedy outputs against the reference's: token-identical, or tie-aware when
    the reference has a tie dtype. The engine must have run the `kernels` backend and, with
    require_graphs (a speculating engine's steps verify drafts, which no graph captures), on
    CUDA replayed CUDA graphs for its decode steps unless it was built enforce_eager; every
    stats_checks name must be > 0 after. lora_id: generate's (each prompt's adapter)."""
    from engine import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    graphs = getattr(llm.executor.runner, "decode_graphs", None)
    replays_before = graphs.num_replays if graphs is not None else 0
    outputs = [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params,
                                                                      use_tqdm=False,
                                                                      lora_id=lora_id)]
    backend = llm.executor.runner.ops.name
    replays = (graphs.num_replays if graphs is not None else 0) - replays_before
    steps = f"{replays} of {llm.last_stats.num_steps} steps as CUDA graphs"
    if reference.tie_dtype is None:
        differing = [i for i, (a, b) in enumerate(zip(outputs, reference.outputs)) if a != b]
        ok = not differing
        value = (f"identical ({len(prompts)} prompts)" if ok else f"prompts {differing} differ")
        data = {}
    else:
        comparison = compare_run(outputs, reference.outputs, reference.gaps, reference.tops,
                                 reference.tie_dtype)
        ok, value = comparison.ok, f"{reference.tie_dtype}: {comparison.summary()}"
        data = {"tokens_compared": comparison.compared, "tokens": comparison.total,
                "parted": [{"prompt": i, "position": p.parted_at, "near_tie": p.near_tie,
                            "gap": p.gap} for i, p in enumerate(comparison.prompts)
                           if p.parted_at is not None]}
    value = f"{value}, kernels: {backend}, {steps}"
    if require_graphs and device.type == "cuda" and not llm.config.enforce_eager and \
            replays == 0:
        ok, value = False, f"{value}; but no decode step replayed a CUDA graph"
    if backend != kernels:
        ok, value = False, f"ran the {backend} kernels, not {kernels}"
    stats = llm.last_stats
    for name, wanted in stats_checks.items():
        if not getattr(stats, name) > 0:
            ok, value = False, f"{value}; but {name} = 0 (wanted {wanted})"
    report.check(label, value, ok, backend=backend, graph_replays=replays,
                 accepted_tokens=getattr(stats, "num_accepted_tokens", None),
                 steps=stats.num_steps, **data)


def step_engine(report: StepReport, smoke: bool) -> None:
    import torch

    from engine import LLM
    device = torch.device("cpu" if smoke else "cuda")
    gen = torch.Generator().manual_seed(1)
    all_prompts = [torch.randint(3, 512, (n,), generator=gen).tolist()
                   for n in ENGINE_PROMPT_LENS]
    prompts = all_prompts[:3] if smoke else all_prompts
    max_tokens = 6 if smoke else ENGINE_MAX_TOKENS
    common = dict(device=str(device), kernel_backend="triton")
    tag = "tiny-llama fp32"
    reference_llm = LLM("tiny-llama", num_gpu_blocks=256, dtype="float32", **common)
    reference = GreedyReference(hf_greedy(reference_llm.model, prompts, max_tokens, device))
    compare_greedy(report, f"{tag}, continuous", reference_llm, prompts, reference, device,
                   max_tokens)
    del reference_llm
    small_pool = dict(block_size=4, num_gpu_blocks=36 if not smoke else 8)
    cases = [  # pools of 36 blocks of 4 slots: the longest request alone needs 29, all 90
        ("continuous, enforce_eager", dict(enforce_eager=True, num_gpu_blocks=256), {}),
        ("chunked prefill", dict(scheduler="chunked_prefill", max_num_batched_tokens=24,
                                 num_gpu_blocks=256), {}),
        ("recompute preemption", dict(preemption="recompute", **small_pool),
         {"num_preemptions": "> 0"}),
        ("swap preemption", dict(preemption="swap", swap_space_gb=0.01, **small_pool),
         {"num_swapped_out_blocks": "> 0"}),
        ("prefix caching (second run)", dict(enable_prefix_caching=True, num_gpu_blocks=256),
         {"num_cached_tokens": "> 0"}),
    ]
    if smoke:   # the script's paths, once each: eager and preemption
        cases = [cases[0], cases[3]]
    for name, kwargs, stats_checks in cases:
        llm = LLM("tiny-llama", dtype="float32", **common, **kwargs)
        if name.startswith("prefix caching"):
            llm.generate(prompts, use_tqdm=False)  # fills the prefix cache
        compare_greedy(report, f"{tag}, {name}", llm, prompts, reference, device, max_tokens,
                       **stats_checks)
        del llm
    # bf16: the trained pair's target (confident logits: a random model's near-flat ones
    # part at ties within a few tokens), tie-aware against HF generate.
    pair_prompts = text_prompts([1, 17] if smoke else TEXT_PROMPT_LENS)
    llm = LLM(TINY_PAIR_TARGET, dtype="bfloat16", num_gpu_blocks=256, **common)
    outputs = hf_greedy(llm.model, pair_prompts, max_tokens, device)
    reference = GreedyReference(outputs, llm.model, pair_prompts, "bfloat16")
    compare_greedy(report, "tiny-pair target bf16, continuous (vs HF generate bf16)", llm,
                   pair_prompts, reference, device, max_tokens)
    del llm
    # Issue 33's engine paths: adapters of 3 ranks and the base model in one batch (the
    # smoke run: one prompt each), then the mixture of experts.
    check_lora_engine(report, smoke, device, all_prompts[:4] if smoke else all_prompts,
                      max_tokens)
    moe = LLM("tiny-moe", num_gpu_blocks=256, dtype="float32", **common)
    compare_greedy(report, "tiny-moe fp32 (8 experts, 2 per token), continuous", moe, prompts,
                   GreedyReference(hf_greedy(moe.model, prompts, max_tokens, device)), device,
                   max_tokens)
