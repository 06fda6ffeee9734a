"""One validation: the workload run on the engine (`engine_repeats` times) and in the profiled
simulator (`sim_runs` times), compared metric by metric. The simulator runs first, so that a bad
profile is found before minutes of engine steps."""
from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from calibration.validate.compare import (ValidationInputError, add_engine_noise,
                                              check_gates, compare_summaries, mean_summary,
                                              resolve_gates, speedup)
from calibration.validate.configs import compose_configs, pin_kv_pool
from calibration.validate.profile_conditions import match_profile_conditions
from calibration.validate.report import markdown_report, plot_cdfs, rich_table

# The simulator predicts a run's expected metrics: the mean over this many runs of its random
# draws (a p99 of one run moves by several % between draws; the engine's run is one draw).
DEFAULT_SIM_RUNS = 5
# The engine runs once by default; more repeats (same config and seed) measure its own noise.
DEFAULT_ENGINE_REPEATS = 1


def sim_run_dirs(out_dir: Path, sim_runs: int) -> list[Path]:
    """Where each simulator run writes: <out>/sim, then <out>/sim-run1, sim-run2, ..."""
    return [out_dir / ("sim" if run == 0 else f"sim-run{run}") for run in range(sim_runs)]


def engine_run_dirs(out_dir: Path, engine_repeats: int) -> list[Path]:
    """Where each engine repeat writes: <out>/engine, then <out>/engine-run1, engine-run2, ..."""
    return [out_dir / ("engine" if run == 0 else f"engine-run{run}")
            for run in range(engine_repeats)]


def check_engine_repeats(engine_repeats) -> int:
    """engine_repeats as an int >= 1, else a ValidationInputError naming --engine-repeats."""
    if isinstance(engine_repeats, str):
        try:
            engine_repeats = int(engine_repeats.strip())
        except ValueError:
            pass
    if isinstance(engine_repeats, bool) or not isinstance(engine_repeats, int) or \
            engine_repeats < 1:
        raise ValidationInputError(f"--engine-repeats must be an integer >= 1, got "
                                   f"{engine_repeats!r}")
    return engine_repeats


def validate(overrides: list[str], out_dir: Path, gates: dict[str, float | None],
             console: Console | None = None, normalize_speed: bool = True,
             sim_runs: int = DEFAULT_SIM_RUNS,
             engine_repeats: int = DEFAULT_ENGINE_REPEATS) -> dict:
    """Run both backends, write the report into out_dir, and return validation.json's dict; each
    metric is the mean over the simulator's runs (other noise and acceptance draws) against the
    mean over the engine's repeats."""
    from omegaconf.errors import OmegaConfBaseException

    from sim.core.experiment import run_experiment

    if isinstance(sim_runs, bool) or not isinstance(sim_runs, int) or sim_runs < 1:
        raise ValidationInputError(f"sim_runs must be an integer >= 1, got {sim_runs!r}")
    engine_repeats = check_engine_repeats(engine_repeats)
    console = console or Console()
    out_dir = Path(out_dir)
    engine_cfg, sim_cfg = compose_configs(overrides)
    gates = resolve_gates(gates, sim_cfg.get("validate"))
    try:
        num_blocks = pin_kv_pool(engine_cfg, sim_cfg)
        sim_seeds, run_dirs, sims = _run_simulator(sim_cfg, out_dir, sim_runs)
        conditions = match_profile_conditions(sim_cfg.cost_model.profile, engine_cfg,
                                              normalize_speed, console)
        engine_dirs = engine_run_dirs(out_dir, engine_repeats)
        engines = [run_experiment(engine_cfg, run_dir) for run_dir in engine_dirs]
    except OmegaConfBaseException as error:
        raise ValidationInputError(str(error)) from None
    engine = engines[0]
    sim_summary = mean_summary([sim.summary for sim in sims])
    engine_summaries = [run.summary for run in engines]
    if engine_repeats == 1:
        metrics = compare_summaries(engine.summary, sim_summary)
    else:
        metrics = compare_summaries(mean_summary(engine_summaries), sim_summary)
        add_engine_noise(metrics, engine_summaries, gates)
    failures = check_gates(metrics, gates)
    engine_wall_s = _engine_wall_time_s(engine_summaries)
    # The first repeat's machine speed.
    speed = {key: value for key, value in engine.summary.items()
             if key.startswith(("speed_", "prefill_speed_"))}
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
    if engine_repeats > 1:
        result["engine_repeats"] = engine_repeats
    _write_report(result, out_dir, engine_dirs, run_dirs)
    console.print(rich_table(result))
    return result


def _run_simulator(sim_cfg, out_dir: Path, sim_runs: int) -> tuple[list[int], list[Path], list]:
    """The simulator's runs, seeds sim_seed, sim_seed + 1, ...: (seeds, run folders, results)."""
    from omegaconf import open_dict

    from sim.core.experiment import run_experiment

    sim_seeds = [int(sim_cfg.sim_seed) + run for run in range(sim_runs)]
    run_dirs = sim_run_dirs(out_dir, sim_runs)
    sims = []
    for sim_seed, run_dir in zip(sim_seeds, run_dirs):
        with open_dict(sim_cfg):
            sim_cfg.sim_seed = sim_seed
        # The first run's plots; the others' numbers (validation_cdf.png pools them all).
        sims.append(run_experiment(sim_cfg, run_dir, plots=not sims))
    return sim_seeds, run_dirs, sims


def _engine_wall_time_s(engine_summaries: list[dict]) -> float:
    """The mean over the repeats, less the speed probes' time (a measuring cost, not the
    engine's)."""
    return sum(summary["wall_time_s"] - summary.get("speed_probe_s", 0.0)
               for summary in engine_summaries) / len(engine_summaries)


def _write_report(result: dict, out_dir: Path, engine_dirs: list[Path],
                  run_dirs: list[Path]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "validation.json").write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / "validation.md").write_text(markdown_report(result))
    plot_cdfs([run_dir / "requests.csv" for run_dir in engine_dirs],
              [run_dir / "requests.csv" for run_dir in run_dirs],
              out_dir / "validation_cdf.png")
