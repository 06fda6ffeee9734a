"""Whether a change made the simulator slower: one workload of bench/sim_speed.py run in two
checkouts, BEFORE and AFTER, one process per run and the checkouts alternating, so that the
machine's drift falls on both alike. Prints each side's median CPU seconds per run and
simulated requests per CPU-second, and their ratio. With `--instructions`, each side's
instructions per run instead, counted by valgrind (exact to about 0.01 % where timing here moves
by 2 %): a process that runs one workload of `--requests` minus one that stops before it.

    python bench/sim_speed_ab.py BEFORE_DIR AFTER_DIR [--workload vidur|conversation-like]
                                 [--rounds 6] [--runs 2] [--instructions [--requests 4000]]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

WORKLOADS = ("vidur", "conversation-like")


def timed_runs(workload: str, runs: int, num_requests: int | None = None) -> dict:
    """In this process (the checkout on sys.path): a short warm-up, then `runs` timed runs (of
    `num_requests`, where given)."""
    import torch
    torch.set_num_threads(1)
    import sim_speed
    from sim.core.experiment import run_experiment
    overrides = (sim_speed.VIDUR_WORKLOAD if workload == "vidur"
                 else [*sim_speed.CONVERSATION_LIKE, "workload.rate=3"])
    run_experiment(sim_speed.compose_cfg([*overrides, "workload.num_requests=300"]))
    if num_requests is not None:
        overrides = [*overrides, f"workload.num_requests={num_requests}"]
    cfg = sim_speed.compose_cfg(overrides)
    result = None
    cpu_s = []
    for _ in range(runs):
        start = time.process_time()
        result = run_experiment(cfg)
        cpu_s.append(time.process_time() - start)
    requests = result.summary["completed"] + result.summary["rejected"] if result else 0
    return {"requests": requests, "cpu_s": cpu_s}


def run_in(checkout: Path, workload: str, runs: int) -> dict:
    """`timed_runs` in a fresh process that imports the checkout's code."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    out = subprocess.run([sys.executable, __file__, "--child", str(checkout), workload, str(runs)],
                         cwd=checkout, env=env, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"{checkout}: {out.stderr.strip().splitlines()[-1]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def instructions_in(checkout: Path, workload: str, runs: int, num_requests: int) -> int:
    """Instructions valgrind counts in a process that warms up and makes `runs` runs; one thread
    (OpenMP's idle threads spin, which valgrind would count)."""
    env = {**os.environ, "PYTHONPATH": str(checkout), "PYTHONHASHSEED": "0",
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    out = subprocess.run(["valgrind", "--tool=cachegrind", "--cache-sim=no",
                          "--cachegrind-out-file=/dev/null", sys.executable, __file__, "--child",
                          str(checkout), workload, str(runs), str(num_requests)],
                         cwd=checkout, env=env, capture_output=True, text=True)
    counted = re.search(r"I\s+refs:\s+([\d,]+)", out.stderr)
    if out.returncode or counted is None:
        sys.exit(f"{checkout}: valgrind: {(out.stderr.strip().splitlines() or ['no output'])[-1]}")
    return int(counted.group(1).replace(",", ""))


def compare_instructions(before: Path, after: Path, workload: str, num_requests: int) -> None:
    if shutil.which("valgrind") is None:
        sys.exit("--instructions needs valgrind on PATH")
    per_run = {}
    for side, checkout in (("before", before), ("after", after)):
        counts = [instructions_in(checkout.resolve(), workload, runs, num_requests)
                  for runs in (0, 1)]
        per_run[side] = counts[1] - counts[0]
        print(f"{workload} {side}: {per_run[side]:,} instructions per run of {num_requests:,} "
              f"requests", flush=True)
    print(f"after / before: {per_run['after'] / per_run['before']:.4f}x instructions")


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        checkout = sys.argv[2]
        sys.path[:0] = [checkout, os.path.join(checkout, "bench")]
        num_requests = int(sys.argv[5]) if len(sys.argv) > 5 else None
        print(json.dumps(timed_runs(sys.argv[3], int(sys.argv[4]), num_requests)))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--workload", choices=WORKLOADS, default="vidur")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--runs", type=int, default=2, help="timed runs per process")
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions under valgrind instead of timing")
    parser.add_argument("--requests", type=int, default=4000,
                        help="requests of the counted run (--instructions)")
    args = parser.parse_args()
    for checkout in (args.before, args.after):
        if not (checkout / "bench" / "sim_speed.py").is_file():
            sys.exit(f"{checkout}: not a twinserve checkout (no bench/sim_speed.py)")
    if args.instructions:
        compare_instructions(args.before, args.after, args.workload, args.requests)
        return
    cpu_s = {"before": [], "after": []}
    requests = 0
    for round_index in range(args.rounds):
        for side, checkout in (("before", args.before), ("after", args.after)):
            measured = run_in(checkout.resolve(), args.workload, args.runs)
            cpu_s[side] += measured["cpu_s"]
            requests = measured["requests"]
        print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr)
    medians = {side: statistics.median(values) for side, values in cpu_s.items()}
    for side, values in cpu_s.items():
        print(f"{args.workload} {side}: median {medians[side]:.3f} CPU-s over {len(values)} runs "
              f"-> {requests / medians[side]:,.0f} req/CPU-s "
              f"(runs {min(values):.3f}-{max(values):.3f} s)")
    print(f"after / before: {medians['before'] / medians['after']:.3f}x req/CPU-s")


if __name__ == "__main__":
    main()
