"""Re-predict finished validations with another profile: the simulator side of each job run
again (same overrides, same seeds) with `--profile`, compared against the engine runs the job
already measured. What a change of the profiled cost model does to the errors on the same
engine measurements (tiny-moe's profile with and without its expert feature, docs/calibration.md).

    python bench/repredict_validation.py --profile OTHER.json --out DIR validation/tiny-moe/*/
    twinserve-validate --tabulate --out DIR DIR/*      # the grid's table with OTHER

Prints, per job and on average, the mean |error| % over the gated means and medians (TTFT, TPOT,
e2e latency, throughputs) for the job's own profile and for OTHER; with --out, writes each job's
validation.json as OTHER predicts it (every metric, the engine's spread and the verdicts, gates
and the rest as the job had them) into DIR/<job>/.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from calibration.validate.compare import (GATED_BY, add_engine_noise,  # noqa: E402
                                          check_gates, compare_summaries, mean_summary,
                                          speedup)
from calibration.validate.configs import compose_configs, pin_kv_pool  # noqa: E402
from calibration.validate.run import engine_run_dirs  # noqa: E402

MEAN_METRICS = tuple(name for name, gate in GATED_BY.items() if gate == "mean_pct")


def mean_abs_error(metrics: dict) -> float:
    return float(np.mean([abs(metrics[name]["error_pct"]) for name in MEAN_METRICS]))


def repredict(job_dir: Path, profile: str, out_dir: Path | None) -> tuple[float, float]:
    """(the job's mean |error| %, that with `profile`) over MEAN_METRICS; with `out_dir`, the
    job's validation.json with `profile` written there."""
    from omegaconf import open_dict

    from sim.core.experiment import run_experiment

    result = json.loads((job_dir / "validation.json").read_text())
    overrides = [o for o in result["overrides"] if not o.startswith("cost_model.profile=")]
    engine_cfg, sim_cfg = compose_configs([*overrides, f"cost_model.profile={profile}"])
    pin_kv_pool(engine_cfg, sim_cfg)
    sims = []
    for seed in result["sim_seeds"]:
        with open_dict(sim_cfg):
            sim_cfg.sim_seed = seed
        sims.append(run_experiment(sim_cfg, None, plots=False).summary)
    engines = [json.loads((run_dir / "summary.json").read_text())
               for run_dir in engine_run_dirs(job_dir, result.get("engine_repeats", 1))]
    sim_summary = mean_summary(sims)
    other = compare_summaries(mean_summary(engines), sim_summary)
    if len(engines) > 1:
        add_engine_noise(other, engines, result["gates"])
    if out_dir is not None:
        failures = check_gates(other, result["gates"])
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "validation.json").write_text(json.dumps(
            {**result, "metrics": other, "failures": failures, "passed": not failures,
             "profile": profile, "sim_wall_time_s": sim_summary["wall_time_s"],
             "speedup": speedup(result["engine_wall_time_s"], sim_summary["wall_time_s"])},
            indent=2) + "\n")
    return mean_abs_error(result["metrics"]), mean_abs_error(other)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", required=True, help="the other profile JSON")
    parser.add_argument("--out", type=Path, help="write the re-predicted validation.json files "
                                                 "into OUT/<job folder name>/")
    parser.add_argument("job_dirs", nargs="+", type=Path,
                        help="validation job folders (each with validation.json)")
    args = parser.parse_args(argv)
    rows = []
    for job_dir in args.job_dirs:
        if not (job_dir / "validation.json").is_file():
            parser.error(f"{job_dir}: no validation.json (not a finished validation job)")
        out_dir = None if args.out is None else args.out / job_dir.resolve().name
        own, other = repredict(job_dir, args.profile, out_dir)
        rows.append((own, other))
        print(f"{job_dir}: mean |error| {own:.2f} % with its profile, {other:.2f} % with "
              f"{args.profile}")
    own, other = np.mean(rows, axis=0)
    print(f"mean over {len(rows)} jobs: {own:.2f} % with their profile, {other:.2f} % with "
          f"{args.profile}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
