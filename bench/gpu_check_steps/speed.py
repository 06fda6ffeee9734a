"""Steps: decode attention's bandwidth against the device's copy bandwidth (the long-context
cases gate on goals.LONG_CONTEXT_CASES), and the engine's output tok/s against HF generate's on
the same requests (gated on goals.Goals.engine_vs_hf)."""
from __future__ import annotations

import gc
import sys

from gpu_check_steps.common import REPO, StepReport, make_batch, median_seconds
from gpu_check_steps.goals import LONG_CONTEXT_CASES, bandwidth_verdict, goals_for, \
    throughput_verdict


def step_bandwidth(report: StepReport, smoke: bool) -> None:
    """Decode attention's bytes of K/V read per second against one large device copy's bytes
    read and written per second, at Llama-2-7B (32/32 heads) and 70B-style (64/8) shapes."""
    import torch

    from kernels import triton_ops
    goal = goals_for(smoke).decode_bandwidth_share
    device = torch.device("cpu" if smoke else "cuda")
    copy_bytes = (1 << 20) if smoke else (2 << 30)
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    copy_rate = 2 * copy_bytes / median_seconds(lambda: dst.copy_(src), device)
    del src, dst
    report.measure("device copy bandwidth (read + write)", f"{copy_rate / 1e9:.0f} GB/s",
                   gb_per_s=copy_rate / 1e9)
    dtype = torch.bfloat16
    cases = [  # (label, num_kv_heads, heads_per_kv_head, num_seqs, context)
        ("7B", 32, 1, 64, 2048), ("7B", 32, 1, 16, 4096), ("7B", 32, 1, 256, 512),
        ("7B", 32, 1, 2, 4096), ("70B-style GQA 8", 8, 8, 64, 4096),
        ("70B-style GQA 8", 8, 8, 4, 8192)]
    gated = {("7B", seqs, context) for seqs, context in LONG_CONTEXT_CASES}
    if smoke:   # the gated path at toy sizes
        cases = [("7B", 2, 1, 64, 32), ("GQA 8", 2, 8, 2, 64)]
        gated = {("7B", 64, 32)}
    for label, num_kv_heads, group, num_seqs, context in cases:
        batch = make_batch([1] * num_seqs, [context - 1] * num_seqs, num_kv_heads=num_kv_heads,
                           heads_per_kv_head=group, head_dim=128 if not smoke else 32,
                           block_size=16 if not smoke else 4, dtype=dtype, device=device)
        kv_bytes = 2 * num_seqs * context * num_kv_heads * batch[1].shape[4] * 2
        splits = triton_ops.choose_num_splits(num_seqs, num_kv_heads, context, device)
        seconds = median_seconds(lambda: triton_ops.paged_attention(
            *batch, max_query_len=1, max_seq_len=context), device)
        rate = kv_bytes / seconds
        share = rate / copy_rate
        case = f"decode {label}, {num_seqs} seqs x {context}, {splits} split(s)"
        data = dict(ms=seconds * 1e3, gb_per_s=rate / 1e9, share_of_copy=share,
                    num_splits=splits)
        if (label, num_seqs, context) in gated:
            met, verdict = bandwidth_verdict(share, goal)
            report.check(case, f"{seconds * 1e3:.3f} ms, {rate / 1e9:.0f} GB/s, {verdict}", met,
                         goal=goal, **data)
        else:
            report.measure(case, f"{seconds * 1e3:.3f} ms, {rate / 1e9:.0f} GB/s, {share:.0%} "
                           f"of copy", **data)
        if splits == 1 and num_seqs == 64 and not smoke:
            # Other context tiles than decode_config's, for the next round of tuning.
            config = triton_ops.decode_config(group, batch[0].shape[2], dtype)
            for tile in sorted({16, 32, 64, 128} - {config.tile}):
                seconds = median_seconds(lambda: triton_ops.paged_decode_attention(
                    *batch, tile=tile), device)
                report.measure(f"  same, tile {tile} (default {config.tile})",
                               f"{kv_bytes / seconds / copy_rate:.0%} of copy",
                               tile=tile, share_of_copy=kv_bytes / seconds / copy_rate)
        del batch


def step_throughput(report: StepReport, smoke: bool) -> None:
    """bench/engine_throughput.py's eval-style workload (tiny-llama, ragged prompts and
    outputs, greedy): the engine's output tok/s against HF generate's static batches of 16 on
    the same requests."""
    import torch
    sys.path.insert(0, str(REPO / "bench"))
    from engine_throughput import make_workload, run_engine, run_hf_generate

    from engine.model_loader import load_model
    goal = goals_for(smoke).engine_vs_hf
    device = "cpu" if smoke else "cuda"
    num_requests = 4 if smoke else 64
    hf_model = load_model("tiny-llama", torch.device(device)).model
    prompts, output_lens = make_workload(num_requests, hf_model.config.vocab_size, seed=0)
    if smoke:
        prompts, output_lens = [p[:16] for p in prompts], [min(n, 4) for n in output_lens]
    engine_s, engine_tokens = run_engine(prompts, output_lens, device, 16)
    gc.collect()
    hf_s, hf_tokens = run_hf_generate(hf_model, prompts, output_lens, 16, device)
    engine_rate, hf_rate = engine_tokens / engine_s, hf_tokens / hf_s
    report.measure(f"engine, {num_requests} requests", f"{engine_rate:,.0f} output tok/s",
                   tok_per_s=engine_rate)
    report.measure("HF generate (static batches of 16)", f"{hf_rate:,.0f} output tok/s",
                   tok_per_s=hf_rate)
    met, verdict = throughput_verdict(engine_rate / hf_rate, goal)
    report.check("engine / HF generate", verdict, met, ratio=engine_rate / hf_rate, goal=goal)
