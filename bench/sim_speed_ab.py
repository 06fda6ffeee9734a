"""Whether a change made the simulator slower: one workload of bench/sim_speed.py run in two
checkouts, BEFORE and AFTER, one process per run and the checkouts alternating, so that the
machine's drift falls on both alike. Prints each side's median CPU seconds per run and
simulated requests per CPU-second, and their ratio.

    python bench/sim_speed_ab.py BEFORE_DIR AFTER_DIR [--workload vidur|conversation-like]
                                 [--rounds 6] [--runs 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

WORKLOADS = ("vidur", "conversation-like")


def timed_runs(workload: str, runs: int) -> dict:
    """In this process (the checkout on sys.path): a short warm-up, then `runs` timed runs."""
    import torch
    torch.set_num_threads(1)
    import sim_speed
    from sim.core.experiment import run_experiment
    overrides = (sim_speed.VIDUR_WORKLOAD if workload == "vidur"
                 else [*sim_speed.CONVERSATION_LIKE, "workload.rate=3"])
    run_experiment(sim_speed.compose_cfg([*overrides, "workload.num_requests=300"]))
    cfg = sim_speed.compose_cfg(overrides)
    cpu_s = []
    for _ in range(runs):
        start = time.process_time()
        result = run_experiment(cfg)
        cpu_s.append(time.process_time() - start)
    return {"requests": result.summary["completed"] + result.summary["rejected"], "cpu_s": cpu_s}


def run_in(checkout: Path, workload: str, runs: int) -> dict:
    """`timed_runs` in a fresh process that imports the checkout's code."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    out = subprocess.run([sys.executable, __file__, "--child", str(checkout), workload, str(runs)],
                         cwd=checkout, env=env, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"{checkout}: {out.stderr.strip().splitlines()[-1]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        checkout = sys.argv[2]
        sys.path[:0] = [checkout, os.path.join(checkout, "bench")]
        print(json.dumps(timed_runs(sys.argv[3], int(sys.argv[4]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--workload", choices=WORKLOADS, default="vidur")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--runs", type=int, default=2, help="timed runs per process")
    args = parser.parse_args()
    for checkout in (args.before, args.after):
        if not (checkout / "bench" / "sim_speed.py").is_file():
            sys.exit(f"{checkout}: not a twinserve checkout (no bench/sim_speed.py)")
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
