"""The GPU check's multi-LoRA checks (issue 33): the Triton grouped LoRA kernel against the
per-token loop oracle (kernels/naive.py add_lora) at Llama-2-7B's target module shapes, in bf16
and fp16, for several adapter mixes (the kernels step runs it); the engine's greedy outputs with
mixed adapters in one batch against HF + PEFT holding each request's adapter alone (the engine
step runs it)."""
from __future__ import annotations

from gpu_check_steps.common import REL_TOLERANCE, SHORT_DTYPE, StepReport, dtype_of, \
    relative_error

# Llama-2-7B's target module shapes (in, out): q/k/v/o, gate/up, down (compile.py compiles
# them); --smoke: shapes off the interpreter's tiles of 256 and of 16.
LORA_SHAPES = [(4096, 4096), (4096, 11008), (11008, 4096)]
SMOKE_LORA_SHAPES = [(48, 80), (80, 40)]
# Adapters of these ranks in slots of the widest (rows and columns past a rank zero), which the
# kernel pads to RANK_PAD 64 (kernels/triton_lora.py rank_pad).
LORA_KERNEL_RANKS = (8, 16, 64)
LORA_ALPHA = 16
LORA_DTYPES = ("bfloat16", "float16")
# Adapter mixes: (tokens, slot) runs in the step's order; slot -1 runs the base model alone.
# At GPU sizes (the first of each pair) and --smoke sizes.
LORA_MIXES = {
    "decode, 3 adapters and the base model":
        ([(1, slot) for slot in (0, 1, 2, -1) * 12], [(1, slot) for slot in (0, 1, 2, -1) * 2]),
    "prefill chunks and decodes, 3 adapters, a quarter of tokens on none":
        ([(200, 0), (77, -1), (130, 2), (1, 1), (1, -1), (33, 1), (1, 2), (60, -1)],
         [(9, 0), (5, -1), (20, 2), (1, 1), (7, 1)]),
    "one adapter (rank 8) on every token":
        ([(256, 0)], [(40, 0)]),
}


def lora_kernel_inputs(in_features: int, out_features: int, runs, dtype, device, seed: int):
    """(out, x, lora_a, lora_b, scalings, batch) of one target module: the adapters of
    LORA_KERNEL_RANKS drawn as the engine draws them (engine/lora.py adapter_weights), in slots
    of the widest rank; fresh random x, and out (the base projection's output) on the scale of
    the adapters' deltas, so a wrong delta shows in the relative error."""
    import numpy as np
    import torch

    from engine.lora import LoRAAdapters, adapter_weights
    from kernels.lora_batch import LoRABatch
    adapters = LoRAAdapters.from_config(dict(
        num_adapters=len(LORA_KERNEL_RANKS), ranks=list(LORA_KERNEL_RANKS), alpha=LORA_ALPHA,
        target_modules=["q_proj"], max_loras=len(LORA_KERNEL_RANKS)), seed=seed)
    num_slots, max_rank = len(LORA_KERNEL_RANKS), max(LORA_KERNEL_RANKS)
    lora_a = torch.zeros(num_slots, max_rank, in_features)
    lora_b = torch.zeros(num_slots, out_features, max_rank)
    for slot, rank in enumerate(LORA_KERNEL_RANKS):
        ((a, b),) = adapter_weights(adapters, slot, {"q_proj": (in_features, out_features)}
                                    ).values()
        lora_a[slot, :rank], lora_b[slot, :, :rank] = a, b
    scalings = torch.tensor([adapters.scaling(slot) for slot in range(num_slots)])
    token_slots = np.concatenate([[slot] * tokens for tokens, slot in runs])
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(len(token_slots), in_features, generator=gen)
    out = torch.randn(len(token_slots), out_features, generator=gen) * 0.3
    return (out.to(device, dtype), x.to(device, dtype), lora_a.to(device, dtype),
            lora_b.to(device, dtype), scalings.to(device), LoRABatch.build(token_slots, device))


def check_lora_kernel(report: StepReport, smoke: bool, device) -> None:
    """Per dtype and mix, one row: the worst relative error over the target module shapes of
    the Triton kernel's out against the loop oracle's, and the base-model rows untouched."""
    import torch

    from kernels import naive, triton_ops
    from kernels.lora_batch import NO_ADAPTER
    shapes = SMOKE_LORA_SHAPES if smoke else LORA_SHAPES
    for dtype_name in LORA_DTYPES:
        dtype, tolerance = dtype_of(dtype_name), REL_TOLERANCE[dtype_name]
        for seed, (mix, sizes) in enumerate(LORA_MIXES.items()):
            runs = sizes[1 if smoke else 0]
            errors, untouched_exact = [], True
            for in_features, out_features in shapes:
                out, x, lora_a, lora_b, scalings, batch = lora_kernel_inputs(
                    in_features, out_features, runs, dtype, device, seed)
                expected, before = out.clone(), out.clone()
                naive.add_lora(expected, x, lora_a, lora_b, scalings, batch)
                triton_ops.add_lora(out, x, lora_a, lora_b, scalings, batch)
                errors.append(relative_error(out, expected))
                base_rows = batch.token_slots == NO_ADAPTER
                untouched_exact &= bool(torch.equal(out[base_rows], before[base_rows]))
            worst = max(errors)
            ok = worst <= tolerance and untouched_exact
            num_tokens = sum(tokens for tokens, _ in runs)
            value = (f"{worst:.1e} (worst of {len(shapes)} module shapes), base-model rows "
                     f"{'untouched' if untouched_exact else 'CHANGED'}")
            ranks = "/".join(map(str, LORA_KERNEL_RANKS))
            report.check(f"{SHORT_DTYPE[dtype_name]}, multi-LoRA kernel: {mix} ({num_tokens} "
                         f"tokens, ranks {ranks})", value, ok,
                         rel_error=worst, tolerance=tolerance, shapes=shapes)


# The engine's adapters: ranks padded to 64 in the slots, every Llama projection a target.
ENGINE_LORA_RANKS = [8, 16, 64]
# Prompt i runs adapter ENGINE_LORA_IDS[i] (None: the base model), all in one batch.
ENGINE_LORA_IDS = [0, None, 1, 2, 1, None, 2]


def check_lora_engine(report: StepReport, smoke: bool, device, prompts, max_tokens) -> None:
    """tiny-llama fp32 on the Triton kernels, prompts of different adapters and of the base
    model in one batch, against HF generate on a PeftModel holding each prompt's adapter alone
    (engine/peft_reference.py; the base model for None). First row: each adapter changes its
    prompt's reference output (else an engine ignoring its adapters would pass)."""
    import torch

    from engine import LLM
    from engine.model_loader import load_model
    from engine.peft_reference import peft_model
    from gpu_check_steps.engine import GreedyReference, compare_greedy, hf_greedy
    from policies.lora.spec import TARGET_MODULES
    lora_ids = ENGINE_LORA_IDS[:len(prompts)]
    lora = dict(num_adapters=len(ENGINE_LORA_RANKS), ranks=ENGINE_LORA_RANKS, alpha=LORA_ALPHA,
                target_modules=list(TARGET_MODULES), max_loras=len(ENGINE_LORA_RANKS))
    llm = LLM("tiny-llama", dtype="float32", num_gpu_blocks=256, device=str(device),
              kernel_backend="triton", lora=lora)
    base = load_model("tiny-llama", device, dtype=torch.float32, seed=0).model
    adapters = llm.executor.runner.lora.adapters
    models = {None: base, **{index: peft_model(base, adapters, index)
                             for index in set(lora_ids) - {None}}}
    expected = [hf_greedy(models[lora_id], [prompt], max_tokens, device)[0]
                for prompt, lora_id in zip(prompts, lora_ids)]
    by_base = hf_greedy(base, prompts, max_tokens, device)
    unchanged = [i for i, lora_id in enumerate(lora_ids)
                 if lora_id is not None and expected[i] == by_base[i]]
    tag = f"tiny-llama fp32, multi-LoRA (ranks {'/'.join(map(str, ENGINE_LORA_RANKS))})"
    report.check(f"{tag}: each adapter changes its prompt's HF + PEFT output",
                 "yes" if not unchanged else f"prompts {unchanged} equal the base model's",
                 not unchanged)
    # Steps with an adapter run eagerly (graphs are captured without adapters).
    compare_greedy(report, f"{tag}: adapters and the base model in one batch vs HF + PEFT "
                           f"(each adapter alone)", llm, prompts, GreedyReference(expected),
                   device, max_tokens, require_graphs=False, lora_id=lora_ids)
