"""The serving loop without a GPU, in one command: twinserve-serve on this CPU, two loads benched
with twinserve-bench, terms fitted with twinserve-calibrate on one load, the other predicted.

The replay runs on the engine's shipped profile (cost_model=profiled), and the fit adds what
serving costs beyond those steps: `step_time_scale` (the machine's speed while serving; TPOT) and
`cluster.frontend_latency_s` (HTTP and the hand-over to the engine thread; TTFT); docs/serving.md
says why not a per-sequence overhead too. Writes the run files, the server's log, the fits and
the table (loop.md, loop.json) under --out.

    python bench/cpu_serving_loop.py [--out DIR] [--repeats 4] [--light-rate 2] [--heavy-rate 6]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

from serving_loop import (Load, ServerProcess, bench_loads, check_loop_arguments,  # noqa: E402
                          drift_line, free_port, loop_arguments, markdown_table, predict)

from calibration.realrun.calibrate import PROFILED_METRICS, PROFILED_TERMS  # noqa: E402

MODEL = "tiny-llama"


def serve_command(args: argparse.Namespace, port: int) -> list[str]:
    return [sys.executable, "-m", "engine.server", "--model", MODEL, "--host", "127.0.0.1",
            "--port", str(port), "--num-gpu-blocks", str(args.num_gpu_blocks),
            "--log-level", "warning"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = loop_arguments(__doc__.splitlines()[0], REPO / "outputs" / "cpu-serving-loop", 40,
                            60, "req/s; on 2 shared cores the server falls behind from ~12")
    parser.add_argument("--num-gpu-blocks", type=int, default=512)
    parser.add_argument("--startup-timeout", type=float, default=120.0,
                        help="seconds the server may take to answer /health")
    return check_loop_arguments(parser, parser.parse_args(argv), ("num_gpu_blocks",))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = args.out.resolve()
    (out / "runs").mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    loads = [Load("light", args.light_rate, args.light_requests, seed=0),
             Load("heavy", args.heavy_rate, args.heavy_requests, seed=1)]
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with ServerProcess(serve_command(args, port), env, port, out / "serve.log",
                       args.startup_timeout, "twinserve-serve") as server:
        runs = bench_loads(server.url, loads, args.repeats, args.warmup, out / "runs")
    # No cost model given: the run files say engine twinserve on cpu, which picks the profile.
    results, failures = [], []
    for fit_on, check_on in (("heavy", "light"), ("light", "heavy")):
        try:
            results.append(predict(fit_on, check_on, runs, [], PROFILED_TERMS, PROFILED_METRICS,
                                   out))
        except RuntimeError as error:   # (a fit that moves nothing: calibrate said why above)
            failures.append(f"Fitted on the {fit_on} load: {error}.")
    lines = [f"# twinserve-serve on this CPU serving {MODEL}: calibrated on one load, predicting "
             f"the other", "",
             f"`python bench/cpu_serving_loop.py {' '.join(argv or sys.argv[1:])}` "
             f"({datetime.now():%Y-%m-%d %H:%M}, {time.monotonic() - start:.0f} s). Loads: "
             + "; ".join(f"{load.name}: {' '.join(load.overrides()[:3])}" for load in loads)
             + f", {args.repeats} runs each. Spread: half the range of the repeats over their "
               "mean.", ""]
    for result in results:
        lines += markdown_table(result, "twinserve-serve") + [""]
    lines += [*failures, drift_line(runs, args.repeats), ""]
    text = "\n".join(lines)
    (out / "loop.md").write_text(text)
    (out / "loop.json").write_text(json.dumps({"results": results}, indent=2) + "\n")
    print("\n" + text)
    print(f"written under {out}")


if __name__ == "__main__":
    main()
