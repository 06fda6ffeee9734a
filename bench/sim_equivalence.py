"""Whether a change to the simulator left its results alone: many small runs (every scheduler, paged
and contiguous KV, recompute and swap, light to overloaded rates, sampling, prefix caching,
priorities and tenants, replicas, two pools, the code trace, the speed benchmark's workloads),
each with repeated steps run as one event and step by step (`backend.repeated_steps=false`),
reduced to a digest of everything a run reports: the summary (less wall time), every step row,
the ITL histogram in its order and every request's times.

    python bench/sim_equivalence.py --out new.json                   # this checkout
    PYTHONPATH=/path/to/main python bench/sim_equivalence.py --out ref.json   # a reference
    python bench/sim_equivalence.py --compare ref.json --out new.json

The configs and the digests come from the `sim` package imported (the one PYTHONPATH finds), so
the same script measures a checkout of main for the reference. `--compare` exits non-zero if any
digest differs from the reference, or if a run's two ways differ from each other.
"""
from __future__ import annotations

import argparse
import atexit
import functools
import hashlib
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

import sim
from sim.core.experiment import run_experiment

CONF_DIR = Path(sim.__file__).resolve().parents[1] / "conf"
SCHEDULERS = ("continuous", "chunked_prefill", "static", "priority", "mlfq", "sjf", "edf", "vtc")
CONVERSATION_LIKE = ["++workload.prompt_len={dist: lognormal, mean: 1500, sigma: 0.8, min: 16, "
                     "max: 3500}",
                     "++workload.output_len={dist: lognormal, mean: 300, sigma: 0.6, min: 8, "
                     "max: 500}"]


def scheduler_overrides(scheduler: str, rng: random.Random) -> list[str]:
    """What a scheduler needs to be exercised: a small chunk budget, a predictor, classes."""
    overrides = [f"scheduler={scheduler}"]
    if scheduler == "chunked_prefill":
        overrides.append(f"scheduler.max_num_batched_tokens={rng.choice([256, 512, 2048])}")
    if scheduler == "sjf":
        overrides.append(f"predictor={rng.choice(['noisy', 'oracle', 'bucket'])}")
    if scheduler in ("priority", "mlfq", "edf"):
        overrides.append("++workload.classes=[{share: 0.3, priority: 0, slo_ttft_ms: 400}, "
                         "{share: 0.7, priority: 1, slo_ttft_ms: 3000}]")
    if scheduler == "edf" and rng.random() < 0.5:
        overrides.append("scheduler.reject_hopeless=true")
    if scheduler == "vtc":
        overrides += ["++workload.classes=[{share: 0.8, tenant: heavy}, "
                      "{share: 0.2, tenant: light}]",
                      "++scheduler.tenant_weights={heavy: 1, light: 3}"]
    return overrides


def random_config(seed: int) -> list[str]:
    """A random small experiment: scheduler, load, lengths, block size, pool, KV manager,
    preemption, sampling, prefix caching and replicas all drawn."""
    rng = random.Random(seed)
    scheduler = SCHEDULERS[seed % len(SCHEDULERS)]
    block_size = rng.choice([1, 8, 16, 32])
    overrides = [
        f"seed={seed}", f"workload.num_requests={rng.randint(40, 240)}",
        f"workload.rate={rng.choice([0.5, 2, 4, 8, 30, 'inf'])}",
        f"++workload.prompt_len={{dist: uniform, low: 8, high: {rng.choice([64, 600, 1500])}}}",
        f"++workload.output_len={{dist: lognormal, mean: {rng.choice([10, 40, 150, 300])}, "
        f"sigma: {rng.choice([0.3, 1.0])}, max: 1024}}",
        f"kv_cache.block_size={block_size}",
        f"preemption={rng.choice(['recompute', 'swap'])}",
        *scheduler_overrides(scheduler, rng),
    ]
    contiguous = rng.random() < 0.25
    if contiguous:
        overrides.append("kv_cache=contiguous")
        overrides.append(f"kv_cache.reserve={rng.choice(['max', 'oracle'])}")
    if rng.random() < 0.5:
        overrides.append(f"kv_cache.num_blocks={rng.choice([300, 1200, 5000]) // block_size * 16}")
    if rng.random() < 0.25:
        overrides.append(f"++workload.n={rng.choice([2, 3])}")
    if rng.random() < 0.25:
        overrides += [f"cluster.num_replicas={rng.choice([2, 3])}",
                      f"cluster.router={rng.choice(['round_robin', 'least_outstanding'])}"]
    if rng.random() < 0.2 and block_size > 1 and not contiguous:
        overrides += ["kv_cache.enable_prefix_caching=true", "workload.with_token_ids=true",
                      "workload.shared_prefix_len=32"]
    if rng.random() < 0.15:
        overrides.append(f"scheduler.max_num_seqs={rng.choice([4, 16, 64])}")
    return overrides


def fixed_configs() -> dict[str, list[str]]:
    """The speed benchmark's workloads, shortened, and a few shapes the random ones rarely draw."""
    configs = {
        "conversation 3/s": ["workload.num_requests=2500", "workload.rate=3",
                             *CONVERSATION_LIKE],
        "conversation 4/s": ["workload.num_requests=2500", "workload.rate=4",
                             *CONVERSATION_LIKE],
        "conversation 3/s contiguous": ["workload.num_requests=800", "workload.rate=3",
                                        "kv_cache=contiguous", *CONVERSATION_LIKE],
        "70B TP2 512/128 2/s": ["model=llama-2-70b", "cluster.tensor_parallel_size=2",
                                "workload.num_requests=1500", "workload.rate=2",
                                "++workload.prompt_len={dist: fixed, value: 512}",
                                "++workload.output_len={dist: fixed, value: 128}"],
        "code trace": ["workload=trace", "workload.max_requests=2000"],
        "code trace chunked swap": ["workload=trace", "workload.max_requests=1500",
                                    "scheduler=chunked_prefill", "preemption=swap",
                                    "kv_cache.num_blocks=2000"],
        "overloaded small pool swap": ["workload.num_requests=400", "workload.rate=40",
                                       "kv_cache.num_blocks=400", "preemption=swap"],
        "overloaded small pool recompute": ["workload.num_requests=400", "workload.rate=40",
                                            "kv_cache.num_blocks=400"],
        "two pools": ["workload.num_requests=400", "workload.rate=8", "cluster=disaggregated"],
        "static batching": ["scheduler=static", "workload.num_requests=300", "workload.rate=6"],
        "parallel sampling": ["workload.num_requests=200", "workload.rate=3", "++workload.n=4"],
        "roofline cpu model": ["model=tiny-llama", "hardware=cpu", "workload.num_requests=150",
                               "workload.rate=3",
                               "++workload.prompt_len={dist: uniform, low: 8, high: 300}"],
    }
    for rate in (1, 3, 12):   # step noise on: the residual draws must line up too
        configs[f"profiled cpu model with noise {rate}/s"] = [
            "model=tiny-llama", "hardware=cpu", "cost_model=profiled",
            f"cost_model.profile={profile_without_tile_features()}",
            "workload.num_requests=150", f"workload.rate={rate}",
            "++workload.prompt_len={dist: uniform, low: 8, high: 300}"]
    for scheduler in SCHEDULERS:
        configs[f"{scheduler} conversation 3/s"] = [
            "workload.num_requests=600", "workload.rate=3", *CONVERSATION_LIKE,
            *scheduler_overrides(scheduler, random.Random(scheduler))]
    return configs


@functools.cache
def profile_without_tile_features() -> Path:
    """The tiny-llama CPU profile without its attention-tile features (which read each
    sequence's length, so its steps never repeat), written to a temp file of this run's own
    (two runs at once, or from checkouts with other profiles, must not share one)."""
    from sim.cost.profiled.tile_features import TILE_FEATURES

    profile = json.loads((CONF_DIR.parent / "profiles/cpu/tiny-llama.json").read_text())
    profile["features"] = [name for name in profile["features"] if name not in TILE_FEATURES]
    for name in TILE_FEATURES:
        profile["model"]["coefficients_s"].pop(name, None)
        profile.get("feature_ranges", {}).pop(name, None)
    profile["correction"] = None   # fitted over the tile features too
    file = tempfile.NamedTemporaryFile("w", prefix="sim_equivalence_tiny_llama_no_tiles_",
                                       suffix=".json", delete=False)
    with file:
        json.dump(profile, file)
    atexit.register(Path(file.name).unlink, missing_ok=True)
    return Path(file.name)


def all_configs(num_random: int) -> dict[str, list[str]]:
    configs = fixed_configs()
    for seed in range(num_random):
        configs[f"random {seed}"] = random_config(seed)
    return configs


def digest(result) -> dict:
    """sha256 of each part of what a run reports (floats by repr, so bit for bit)."""
    summary = {key: value for key, value in result.summary.items()
               if key not in ("wall_time_s", "sim_speedup")}
    requests = [(request.request_id, request.replica_id, request.first_scheduled_time,
                 request.first_token_time, request.finish_time, request.num_preemptions,
                 request.num_output_tokens, request.rejected_reason)
                for request in result.requests]
    parts = {"summary": json.dumps(summary, sort_keys=True),
             "steps": repr(result.metrics.step_rows),
             "itls": repr(list(result.metrics.itl_counts.items())),
             "requests": repr(requests)}
    return {name: hashlib.sha256(text.encode()).hexdigest()[:16] for name, text in parts.items()}


def run(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=["progress=false", *overrides])
    return run_experiment(cfg, plots=False)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="write the digests here (JSON)")
    parser.add_argument("--compare", type=Path, help="a reference's digests to compare with")
    parser.add_argument("--random", type=int, default=240, help="random configs to add")
    args = parser.parse_args()
    configs = all_configs(args.random)
    digests = {}
    failures = []
    start = time.perf_counter()
    for name, overrides in configs.items():
        both = {"repeated_steps": digest(run(overrides)),
                "step_by_step": digest(run([*overrides, "backend.repeated_steps=false"]))}
        # (the temp file's name differs from run to run; the reference records what it holds)
        recorded = [override.replace(str(profile_without_tile_features()),
                                     "<tiny-llama profile without tile features>")
                    for override in overrides]
        digests[name] = {"overrides": recorded, **both}
        if both["repeated_steps"] != both["step_by_step"]:
            failures.append(f"{name}: repeated steps and step by step differ {overrides}")
    args.out.write_text(json.dumps(digests, indent=1) + "\n")
    print(f"{len(configs)} configs, each both ways, in {time.perf_counter() - start:.0f} s "
          f"(sim from {Path(sim.__file__).parent})")
    if args.compare:
        reference = json.loads(args.compare.read_text())
        for name, entry in digests.items():
            if name not in reference or reference[name]["overrides"] != entry["overrides"]:
                failures.append(f"{name}: not in the reference (or with other overrides)")
                continue
            for way in ("repeated_steps", "step_by_step"):
                # (references written before issue 42 name repeated steps "coalesced")
                referenced = reference[name].get(way) or reference[name]["coalesced"]
                for part, value in entry[way].items():
                    if referenced[part] != value:
                        failures.append(f"{name} ({way}): {part} differs from the reference")
    for failure in failures:
        print("DIFFERS:", failure)
    if not failures:
        print("all identical" + (" to the reference" if args.compare else ""))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
