"""How fast the simulator runs: Llama-2-7B on an A100-80GB, continuous batching, paged KV.

Two workloads: the Azure code trace (8,819 requests, replayed as recorded) and a synthetic
100,000-request Poisson workload with Vidur's benchmark shape (512-token prompts, 128-token
outputs), at a busy and at an overloaded rate. Prints wall time, simulated requests per
wall-second and simulated seconds per wall-second, and the ratio against Vidur's figure on this
kind of machine (600-1,200 requests per wall-second, Llama-2-70B TP2 on A100, 512/128), the
target being >= 5,000 requests/wall-s.

    python bench/sim_speed.py [--requests 100000] [--rates 10 20] [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

from sim.core.experiment import run_experiment

REPO = Path(__file__).resolve().parents[1]
TARGET_REQUESTS_PER_WALL_S = 5_000
VIDUR_REQUESTS_PER_WALL_S = (600, 1_200)


def compose_cfg(overrides):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return compose("config", overrides=["progress=false", "model=llama-2-7b",
                                            "hardware=a100-80gb", "scheduler=continuous",
                                            "kv_cache=paged", *overrides])


def measure(name, overrides, profile=False):
    cfg = compose_cfg(overrides)
    profiler = cProfile.Profile() if profile else None
    start = time.perf_counter()
    if profiler:
        profiler.enable()
    result = run_experiment(cfg)
    if profiler:
        profiler.disable()
    wall_s = time.perf_counter() - start
    summary = result.summary
    num_requests = summary["completed"] + summary["rejected"]
    row = {
        "workload": name,
        "requests": num_requests,
        "steps": summary["num_steps"],
        "wall_s": wall_s,
        "req_per_wall_s": num_requests / wall_s,
        "sim_s_per_wall_s": summary["duration_s"] / wall_s,
        "p99_ttft_ms": summary["p99_ttft_ms"],
    }
    if profiler:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--rates", type=float, nargs="+", default=[10.0, 20.0],
                        help="synthetic arrival rates, requests/s (this setup's capacity is "
                             "about 12: 10 is a busy server, 20 an overloaded one)")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()

    rows = [measure("azure code trace", ["workload=trace"], args.profile)]
    for rate in args.rates:
        rows.append(measure(f"synthetic {args.requests // 1000}k 512/128 @{rate:g}/s", [
            "workload=synthetic", f"workload.num_requests={args.requests}",
            f"workload.rate={rate}",
            "++workload.prompt_len={dist: fixed, value: 512}",
            "++workload.output_len={dist: fixed, value: 128}"], args.profile))
    header = (f"{'workload':<28} {'requests':>9} {'steps':>8} {'wall s':>7} {'req/wall-s':>11} "
              f"{'sim-s/wall-s':>13} {'vs Vidur':>11} {'vs target':>9}")
    print(header)
    print("-" * len(header))
    for row in rows:
        vidur_low, vidur_high = VIDUR_REQUESTS_PER_WALL_S
        vs_vidur = f"{row['req_per_wall_s'] / vidur_high:.1f}-{row['req_per_wall_s'] / vidur_low:.1f}x"
        vs_target = f"{row['req_per_wall_s'] / TARGET_REQUESTS_PER_WALL_S:.2f}x"
        print(f"{row['workload']:<28} {row['requests']:>9,} {row['steps']:>8,} "
              f"{row['wall_s']:>7.2f} {row['req_per_wall_s']:>11,.0f} "
              f"{row['sim_s_per_wall_s']:>13,.1f} {vs_vidur:>11} {vs_target:>9}")
    print(f"\ntarget: >= {TARGET_REQUESTS_PER_WALL_S:,} simulated requests per wall-second; "
          f"Vidur: {VIDUR_REQUESTS_PER_WALL_S[0]:,}-{VIDUR_REQUESTS_PER_WALL_S[1]:,} "
          f"(quoted for this kind of machine, not measured in this run)")


if __name__ == "__main__":
    main()
