"""Runs workloads on vLLM's CPU build, with its own scheduler or with the adapter, in one engine,
and prints what each run did as one JSON line (vLLM logs to stdout too). Started by
tests/test_vllm_adapter.py with the Python of a vLLM venv:

    python tests/vllm_adapter_runs.py SPEC.json

SPEC: {"model": checkpoint folder, "adapter": whether to host plug-ins, "runs": [{"name",
"workload": "order" | "preempt" | "refusal", "plugin": plugin_config(...) or null}]}. Each run's
result: the indices of its requests in the order they were admitted and preempted, the most
requests running at once, each request's output token ids and finish reason.
"""
from __future__ import annotations

import json
import os
import sys

# One process (the engine core in it, so the test reaches its scheduler), one thread.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")   # (GiB; the blocks are overridden anyway)

BLOCK_SIZE = 32          # the CPU attention backend's block sizes are multiples of 32
NUM_BLOCKS = 6           # one is vLLM's null block: 160 tokens, so three requests must take turns
MAX_MODEL_LEN = 160
# Six requests arriving together; each order the checks expect differs from the others.
ORDER_PROMPT_LENS = [60, 10, 40, 20, 50, 30]
ORDER_MAX_TOKENS = [4, 12, 8, 2, 10, 6]
ORDER_PRIORITIES = [1, 1, 0, 1, 0, 1]
ORDER_TENANTS = ["a", "a", "a", "b", "b", "b"]
# Three requests whose growth overflows the cache: the second and third need a second block in
# the same step, when the first (scheduled before them) has taken the last; of those two, the
# second has the more tokens still to generate, the third arrived last.
PREEMPT_PROMPT_LENS = [60, 20, 20]
PREEMPT_MAX_TOKENS = [20, 100, 40]


def prompt(index: int, length: int) -> list[int]:
    """Distinct token ids from 3 up (clear of tiny-llama's pad, bos and eos)."""
    return [3 + (index * 37 + position * 11) % 500 for position in range(length)]


def workload(name: str):
    """(prompts, SamplingParams list, priorities) of a workload."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    def params(max_tokens, extra=None):
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                              detokenize=False, extra_args=extra)

    if name == "order":
        return ([TokensPrompt(prompt_token_ids=prompt(i, n))
                 for i, n in enumerate(ORDER_PROMPT_LENS)],
                [params(m, {"tenant": t}) for m, t in zip(ORDER_MAX_TOKENS, ORDER_TENANTS)],
                ORDER_PRIORITIES)
    if name == "preempt":
        return ([TokensPrompt(prompt_token_ids=prompt(i, n))
                 for i, n in enumerate(PREEMPT_PROMPT_LENS)],
                [params(m) for m in PREEMPT_MAX_TOKENS], [0] * len(PREEMPT_MAX_TOKENS))
    if name == "refusal":   # shortest job first, one request with a predicted length, one without
        return ([TokensPrompt(prompt_token_ids=prompt(i, 10)) for i in range(2)],
                [params(4, {"predicted_output_len": 4}), params(4)], [0, 0])
    raise ValueError(f"unknown workload {name!r}")


def run(llm, scheduler, spec: dict) -> dict:
    """One workload on the engine; what its scheduler did."""
    admitted, preempted, most_running = [], [], [0]
    if spec["plugin"] is not None:
        scheduler.use_plugin(spec["plugin"])
    waiting_pop = scheduler.waiting.pop_request
    preempt = scheduler._preempt_request
    schedule = scheduler.schedule

    def recording_pop():
        request = waiting_pop()
        admitted.append(request.request_id)
        return request

    def recording_preempt(request, *args, **kwargs):
        preempted.append(request.request_id)
        return preempt(request, *args, **kwargs)

    def recording_schedule(*args, **kwargs):
        output = schedule(*args, **kwargs)
        most_running[0] = max(most_running[0], len(scheduler.running))
        return output

    scheduler.waiting.pop_request = recording_pop
    scheduler._preempt_request = recording_preempt
    scheduler.schedule = recording_schedule
    try:
        prompts, params, priorities = workload(spec["workload"])
        outputs = llm.generate(prompts, params, priority=priorities, use_tqdm=False)
    finally:
        del scheduler.waiting.pop_request, scheduler._preempt_request, scheduler.schedule
    # The engine's ids are the outputs' with a suffix of its own ("0" -> "0-1a2b3c4d").
    index = {output.request_id: i for i, output in enumerate(outputs)}
    return {"admitted": [index[r.rsplit("-", 1)[0]] for r in admitted],
            "preempted": [index[r.rsplit("-", 1)[0]] for r in preempted],
            "most_running": most_running[0],
            "token_ids": [list(output.outputs[0].token_ids) for output in outputs],
            "finish_reasons": [output.outputs[0].finish_reason for output in outputs]}


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    import torch
    from vllm import LLM

    torch.set_num_threads(1)
    if spec["adapter"]:
        # The engine starts with the first run's plug-in; each run then names its own.
        os.environ["TWINSERVE_VLLM_PLUGIN"] = json.dumps(spec["runs"][0]["plugin"])
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype="float32", seed=0,
              max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
              num_gpu_blocks_override=NUM_BLOCKS, max_num_seqs=8,
              enable_prefix_caching=False, async_scheduling=False,
              scheduler_cls=("vllm_adapter.scheduler.TwinserveScheduler" if spec["adapter"]
                             else None))
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    results = {run_spec["name"]: run(llm, scheduler, run_spec) for run_spec in spec["runs"]}
    print(json.dumps({"scheduler": type(scheduler).__name__, "runs": results}))


if __name__ == "__main__":
    main()
