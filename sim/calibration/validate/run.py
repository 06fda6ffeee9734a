"""One validation: the workload run on the engine once and in the profiled simulator several
times, compared metric by metric; writes validation.json, validation.md and validation_cdf.png.

The simulator runs first (a bad profile is bad input, found before minutes of engine steps) and
never sees the engine run's measurements: it predicts each step from the profile alone."""
from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from sim.calibration.validate.compare import (ValidationInputError, check_gates,
                                              compare_summaries, mean_summary, resolve_gates,
                                              speedup)
from sim.calibration.validate.configs import compose_configs, pin_kv_pool
from sim.calibration.validate.profile_conditions import match_profile_conditions
from sim.calibration.validate.report import markdown_report, plot_cdfs, rich_table

# The simulator predicts a run's expected metrics: the mean over this many runs of its random
# draws (a p99 of one run moves by several % between draws; the engine's run is one draw).
DEFAULT_SIM_RUNS = 5


def sim_run_dirs(out_dir: Path, sim_runs: int) -> list[Path]:
    """Where each simulator run writes: <out>/sim, then <out>/sim-run1, sim-run2, ..."""
    return [out_dir / ("sim" if run == 0 else f"sim-run{run}") for run in range(sim_runs)]


def validate(overrides: list[str], out_dir: Path, gates: dict[str, float | None],
             console: Console | None = None, normalize_speed: bool = True,
             sim_runs: int = DEFAULT_SIM_RUNS) -> dict:
    """Run both backends, write the report into out_dir, and return validation.json's dict.
    With normalize_speed the engine's step durations are normalised to the profile's machine
    speed (profile_conditions.py), when the profile has a speed reference. The simulator runs
    `sim_runs` times (sim_seed, sim_seed + 1, ...: the same workload, other residual and
    acceptance draws) and predicts each metric's mean over them."""
    from omegaconf import open_dict
    from omegaconf.errors import OmegaConfBaseException

    from sim.core.experiment import run_experiment

    if isinstance(sim_runs, bool) or not isinstance(sim_runs, int) or sim_runs < 1:
        raise ValidationInputError(f"sim_runs must be an integer >= 1, got {sim_runs!r}")
    console = console or Console()
    out_dir = Path(out_dir)
    engine_cfg, sim_cfg = compose_configs(overrides)
    gates = resolve_gates(gates, sim_cfg.get("validate"))
    try:
        num_blocks = pin_kv_pool(engine_cfg, sim_cfg)
        sim_seeds = [int(sim_cfg.sim_seed) + run for run in range(sim_runs)]
        run_dirs = sim_run_dirs(out_dir, sim_runs)
        sims = []
        for sim_seed, run_dir in zip(sim_seeds, run_dirs):
            with open_dict(sim_cfg):
                sim_cfg.sim_seed = sim_seed
            # The first run's plots; the others' numbers (validation_cdf.png pools them all).
            sims.append(run_experiment(sim_cfg, run_dir, plots=not sims))
        conditions = match_profile_conditions(sim_cfg.cost_model.profile, engine_cfg,
                                              normalize_speed, console)
        engine = run_experiment(engine_cfg, out_dir / "engine")
    except OmegaConfBaseException as error:
        raise ValidationInputError(str(error)) from None
    sim_summary = mean_summary([sim.summary for sim in sims])
    metrics = compare_summaries(engine.summary, sim_summary)
    failures = check_gates(metrics, gates)
    # The engine's own wall time: without the speed probes' (a measuring cost, not the engine's).
    engine_wall_s = engine.summary["wall_time_s"] - engine.summary.get("speed_probe_s", 0.0)
    speed = {key: value for key, value in engine.summary.items() if key.startswith("speed_")}
    result = {
        "metrics": metrics,
        "speedup": speedup(engine_wall_s, sim_summary["wall_time_s"]),
        "engine_wall_time_s": engine_wall_s,
        "sim_wall_time_s": sim_summary["wall_time_s"],   # one run's (the mean over the runs)
        "sim_runs": sim_runs,
        "gates": dict(gates),
        "failures": failures,
        "passed": not failures,
        "profile": str(sim_cfg.cost_model.profile),
        "num_kv_blocks": num_blocks,
        "engine_conditions": {**conditions, **speed},
        "completed": {"engine": engine.summary["completed"], "sim": sim_summary["completed"]},
        "seed": int(sim_cfg.seed),
        "sim_seeds": sim_seeds,
        "overrides": list(overrides),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "validation.json").write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / "validation.md").write_text(markdown_report(result))
    plot_cdfs(out_dir / "engine" / "requests.csv",
              [run_dir / "requests.csv" for run_dir in run_dirs],
              out_dir / "validation_cdf.png")
    console.print(rich_table(result))
    return result
