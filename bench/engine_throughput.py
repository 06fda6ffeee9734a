"""Offline throughput of the engine against HF transformers on the same model and workload.

One process, one thread, the tiny Llama (conf/model/tiny-llama.yaml, seeded random weights, fp32):
64 requests with prompts of 32-256 random tokens and outputs of 32-128 tokens, ignore_eos,
greedy. Prints useful output tokens/s of

- this engine (continuous batching, paged KV, the torch kernels on CPU / Triton on CUDA),
- HF `generate` with static padded batches (each batch runs to its longest output; only each
  request's own output length counts as useful),
- HF `generate_batch`'s continuous batching manager (per-request max_new_tokens),

and the ratios. Target: at least 2x HF generate; vLLM's CPU build does about 2.5x on this kind of
machine.

    python bench/engine_throughput.py [--device cuda] [--requests 64] [--hf-batch-size 16]
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

try:
    import engine  # noqa: F401
except ImportError:  # until pyproject.toml packages engine/ and kernels/ (editable install)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import LLM, SamplingParams
from engine.model_loader import load_model


def make_workload(num_requests: int, vocab_size: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(32, 257, (num_requests,), generator=generator).tolist()
    output_lens = torch.randint(32, 129, (num_requests,), generator=generator).tolist()
    # Ids from 3 up: clear of pad (0), bos (1) and eos (2).
    prompts = [torch.randint(3, vocab_size, (n,), generator=generator).tolist()
               for n in prompt_lens]
    return prompts, output_lens


def run_engine(prompts, output_lens, device: str, block_size: int) -> tuple[float, int]:
    llm = LLM("tiny-llama", device=device, block_size=block_size, max_num_seqs=256)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert num_tokens == sum(output_lens), "the engine produced the wrong number of tokens"
    return elapsed, num_tokens


def run_hf_generate(model, prompts, output_lens, batch_size: int, device) -> tuple[float, int]:
    """Static padded batches in arrival order, left-padded, greedy; each batch decodes until its
    longest request is done."""
    def generate(batch_prompts, batch_outputs):
        max_len = max(map(len, batch_prompts))
        input_ids = torch.zeros(len(batch_prompts), max_len, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, prompt in enumerate(batch_prompts):
            input_ids[row, max_len - len(prompt):] = torch.tensor(prompt)
            attention_mask[row, max_len - len(prompt):] = 1
        new_tokens = max(batch_outputs)
        with torch.inference_mode():
            model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                           max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           pad_token_id=0)

    generate(prompts[:2], [4, 4])  # warm-up
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        generate(prompts[first:first + batch_size], output_lens[first:first + batch_size])
    _synchronize(device)
    return time.perf_counter() - start, sum(output_lens)


def run_hf_generate_batch(model, prompts, output_lens) -> tuple[float, int]:
    """transformers' continuous batching manager, each request with its own max_new_tokens."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0,
                              max_new_tokens=max(output_lens))
    with model.continuous_batching_context_manager(generation_config=config, block=True,
                                                   timeout=60) as manager:
        start = time.perf_counter()
        request_ids = [manager.add_request(prompt, max_new_tokens=n, eos_token_id=-1)
                       for prompt, n in zip(prompts, output_lens)]
        results = {}
        while len(results) < len(request_ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("the continuous batching thread stopped")
        elapsed = time.perf_counter() - start
    num_tokens = sum(len(r.generated_tokens) for r in results.values())
    return elapsed, num_tokens


def _synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-hf", action="store_true", help="only the engine")
    args = parser.parse_args()
    torch.set_num_threads(1)

    hf_model = load_model("tiny-llama", torch.device(args.device)).model  # default sdpa attention
    prompts, output_lens = make_workload(args.requests, hf_model.config.vocab_size, args.seed)
    print(f"tiny-llama on {args.device}, {args.requests} requests, prompts "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens "
          f"({sum(map(len, prompts))} in all), outputs {min(output_lens)}-{max(output_lens)} "
          f"({sum(output_lens)} in all), greedy, ignore_eos, 1 thread")

    rows = []
    elapsed, tokens = run_engine(prompts, output_lens, args.device, args.block_size)
    rows.append(("twinserve engine", elapsed, tokens, None))
    gc.collect()
    if torch.device(args.device).type == "cuda":
        torch.cuda.empty_cache()  # the engine's KV pool, so HF's batching manager can size its own
    if not args.skip_hf:
        elapsed, tokens = run_hf_generate(hf_model, prompts, output_lens, args.hf_batch_size,
                                          args.device)
        rows.append((f"HF generate (static, batch {args.hf_batch_size})", elapsed, tokens, None))
        try:
            elapsed, tokens = run_hf_generate_batch(hf_model, prompts, output_lens)
            rows.append(("HF generate_batch (continuous)", elapsed, tokens, None))
        except Exception as error:  # noqa: BLE001 - report why, keep the other rows
            rows.append(("HF generate_batch (continuous)", None, None,
                         f"{type(error).__name__}: {error}"))

    engine_rate = rows[0][2] / rows[0][1]
    print(f"\n{'system':<34} {'time s':>8} {'out tokens':>11} {'tok/s':>9} {'engine / it':>12}")
    for name, elapsed, tokens, error in rows:
        if error is not None:
            print(f"{name:<34} {'failed: ' + error[:200]}")
            continue
        rate = tokens / elapsed
        ratio = "" if name == rows[0][0] else f"{engine_rate / rate:.2f}x"
        print(f"{name:<34} {elapsed:>8.2f} {tokens:>11,} {rate:>9,.0f} {ratio:>12}")
    print("target: engine >= 2x HF generate; vLLM CPU is about 2.5x HF generate here")


if __name__ == "__main__":
    main()
