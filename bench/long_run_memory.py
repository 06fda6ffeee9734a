"""Peak memory and speed of one long synthetic run (issue 41: long traces in bounded memory).

Llama-2-7B on A100-80GB (the GPU cost model), four replicas round-robin, 64-token prompts and
16-token outputs at 400 req/s: a short-request flood, so that requests (not steps) dominate.
Runs of more than metrics.max_kept_requests (100,000 by default) are streamed; `--keep` keeps
every request as before (the exact path). Prints requests per wall-second and the process's peak
RSS (resource.getrusage), one line; run each size in its own process.

    python bench/long_run_memory.py 5000000 [--keep] [--out DIR]
"""
from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

from sim.core.experiment import run_experiment

REPO = Path(__file__).resolve().parents[1]
WORKLOAD = ["workload=synthetic", "workload.rate=400", "cluster.num_replicas=4",
            "cluster.router=round_robin", "++workload.prompt_len={dist: fixed, value: 64}",
            "++workload.output_len={dist: fixed, value: 16}", "progress=false"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("requests", type=int)
    parser.add_argument("--keep", action="store_true", help="keep every request (exact path)")
    parser.add_argument("--out", type=Path, default=None, help="write the run's files here")
    args = parser.parse_args()
    overrides = [*WORKLOAD, f"workload.num_requests={args.requests}"]
    if args.keep:
        overrides.append(f"++metrics.max_kept_requests={args.requests}")
    with initialize_config_dir(str(REPO / "conf"), version_base=None):
        cfg = compose("config", overrides=overrides)
    start = time.perf_counter()
    summary = run_experiment(cfg, out_dir=args.out, plots=False).summary
    wall_s = time.perf_counter() - start
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    how = "streamed" if summary.get("streamed_requests") else "kept"
    print(f"{args.requests:,} requests ({how}): "
          f"{summary['num_steps']:,} steps, {wall_s:.1f} wall-s, "
          f"{args.requests / wall_s:,.0f} req/wall-s, peak RSS {peak_mb:,.0f} MB, "
          f"p99 TTFT {summary['p99_ttft_ms']:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
