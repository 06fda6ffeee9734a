"""How fast the simulator runs multi-LoRA workloads beside the same workload without adapters
(issue 33: within 2x). Llama-2-7B on an A100-80GB, GPU cost model, synthetic requests of the
default lengths at a busy rate, each run four ways: no adapters; 8 adapters in 8 slots (the
max_loras limit never binds: the LoRA bookkeeping alone); 32 adapters in 4 slots under FCFS and
under adapter affinity (thrashing: smaller batches, more steps). Prints wall time, simulated
requests per wall-second, steps, microseconds per step and the ratio of each run's requests per
wall-second to the run without adapters.

    python bench/sim_lora_speed.py [--requests 20000] [--rate 8]
"""
from __future__ import annotations

import argparse

from sim_speed import measure

RUNS = {
    "no adapters": [],
    "8 adapters, 8 slots": ["lora=multi", "lora.num_adapters=8", "lora.max_loras=8"],
    "32 adapters, 4 slots, FCFS": ["lora=multi", "lora.num_adapters=32", "lora.max_loras=4"],
    "32 adapters, 4 slots, affinity": ["lora=multi", "lora.num_adapters=32", "lora.max_loras=4",
                                       "scheduler=lora_affinity"],
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--rate", type=float, default=8.0)
    args = parser.parse_args()
    workload = [f"workload.num_requests={args.requests}", f"workload.rate={args.rate}"]
    baseline = None
    print(f"{'run':34} {'wall s':>8} {'req/wall-s':>11} {'steps':>9} {'us/step':>8} "
          f"{'vs none':>8}")
    for name, overrides in RUNS.items():
        result = measure([*workload, *overrides])
        baseline = baseline or result["req_per_wall_s"]
        print(f"{name:34} {result['wall_s']:8.2f} {result['req_per_wall_s']:11,.0f} "
              f"{result['steps']:9,} {1e6 * result['wall_s'] / result['steps']:8.1f} "
              f"{result['req_per_wall_s'] / baseline:8.2f}", flush=True)


if __name__ == "__main__":
    main()
