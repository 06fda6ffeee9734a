"""Runs a workload on vLLM's CPU build and prints its timing as one JSON line.

Started by `bench/engine_throughput.py --vs-vllm` with the Python of a venv that has vLLM's CPU
build (it cannot share the project's venv: vLLM pins its own torch and transformers). Reads a JSON
file with the model folder, the prompts (token ids) and each request's output length; runs them
greedy with ignore_eos, a warm-up first, then `--repeats` timed runs; prints
{"elapsed": [seconds per run], "cpu_seconds": [process CPU time per run], "tokens": n,
"outputs": [token ids per request]} as its last line (vLLM logs to stdout too).
"""
from __future__ import annotations

import argparse
import json
import os
import time

# One process (no engine core subprocess) on one thread, as the project's engine runs.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload",
                        help="JSON: model, prompts, output_lens, max_num_seqs, max_model_len")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    with open(args.workload) as f:
        workload = json.load(f)

    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    torch.set_num_threads(1)
    llm = LLM(model=workload["model"], skip_tokenizer_init=True, dtype="float32",
              max_num_seqs=workload["max_num_seqs"],
              max_model_len=workload["max_model_len"], seed=0,
              # Off as in the project's engine: repeats would otherwise skip cached prefills.
              enable_prefix_caching=False)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in workload["prompts"]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
              for n in workload["output_lens"]]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    elapsed, cpu_seconds = [], []
    for _ in range(args.repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed.append(time.perf_counter() - start)
        cpu_seconds.append(time.process_time() - cpu_start)
    token_ids = [list(output.outputs[0].token_ids) for output in outputs]
    print(json.dumps({"elapsed": elapsed, "cpu_seconds": cpu_seconds,
                      "tokens": sum(map(len, token_ids)), "outputs": token_ids}))


if __name__ == "__main__":
    main()
