"""A validation grid: every job of a sweep (sweep.py) validated in <out>/<job>/, then one table
for the grid (grid.csv, grid.md, grid.json: each job's swept values, errors and speedup, then each
metric's mean and largest error); `tabulate` makes that table of validations already run."""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
from rich.console import Console

from calibration.validate.compare import GATED_BY, METRICS, OUTSIDE_BOTH, WITHIN_GATE, \
    WITHIN_NOISE, spread_pct, speedup, verdict
from calibration.validate.report import format_error, format_spread, format_value
from calibration.validate.run import DEFAULT_ENGINE_REPEATS, DEFAULT_SIM_RUNS, validate
from calibration.validate.sweep import expand_sweep, swept_values

# The columns of the grid table: the errors people compare simulators by.
GRID_METRICS: tuple[str, ...] = (
    "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
    "p99_tpot_ms", "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms", "request_throughput",
    "num_preemptions",
)
# The verdicts in grid.md's cells.
SHORT_VERDICTS = {WITHIN_GATE: "gate", WITHIN_NOISE: "noise", OUTSIDE_BOTH: "out"}


def grid_rows(results: list[dict], swept: list[dict[str, str]]) -> list[dict]:
    """One row per job: its swept values, its errors on GRID_METRICS (with the engine's spread
    and the verdict where the engine ran several repeats), preemptions, speedup."""
    noise = any("engine_spread_pct" in result["metrics"][name] for result in results
                for name in GRID_METRICS)
    rows = []
    for index, (result, values) in enumerate(zip(results, swept)):
        row = {"job": index, **values}
        for name in GRID_METRICS:
            row[f"{name}_error_pct"] = result["metrics"][name]["error_pct"]
            if noise:
                row[f"{name}_engine_spread_pct"] = result["metrics"][name].get(
                    "engine_spread_pct")
                row[f"{name}_verdict"] = result["metrics"][name].get("verdict")
        row["engine_preemptions"] = result["metrics"]["num_preemptions"]["engine"]
        row["sim_preemptions"] = result["metrics"]["num_preemptions"]["sim"]
        row["speedup"] = result["speedup"]
        # How much slower than at profiling the machine ran (1 when timed by the wall clock).
        row["speed_factor"] = (result.get("engine_conditions") or {}).get("speed_factor_median",
                                                                          1.0)
        row["passed"] = result["passed"]
        rows.append(row)
    return rows


def grid_summary(results: list[dict]) -> dict:
    """The largest and mean |error| of every metric over the grid, the mean signed error (a
    bias; None where an error was undefined) and the overall speedup."""
    worst, mean, mean_signed = {}, {}, {}
    for name in METRICS:
        errors = [r["metrics"][name]["error_pct"] for r in results]
        magnitudes = [math.inf if e is None else abs(e) for e in errors]
        worst[name] = max(magnitudes)
        mean[name] = float(np.mean(magnitudes))
        mean_signed[name] = None if None in errors else float(np.mean(errors))
    engine_s = sum(r["engine_wall_time_s"] for r in results)
    sim_s = sum(r["sim_wall_time_s"] for r in results)
    return {"num_jobs": len(results), "num_passed": sum(r["passed"] for r in results),
            "max_abs_error_pct": worst, "mean_abs_error_pct": mean,
            "mean_error_pct": mean_signed,
            "speedup": speedup(engine_s, sim_s), "engine_wall_time_s": engine_s,
            "sim_wall_time_s": sim_s}


# The metrics of the repeats table: what a bias shows in.
REPEAT_METRICS: tuple[str, ...] = ("mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms",
                                   "median_tpot_ms", "mean_e2el_ms", "median_e2el_ms")


def repeat_groups(results: list[dict]) -> list[dict]:
    """The jobs that validated one workload more than once, at different times: per group and
    metric each round's error, their mean, and the engine's spread over every round (its noise
    from round to round, which one round's repeats understate) with each round's verdict."""
    groups: dict[tuple, list[int]] = {}
    for index, result in enumerate(results):
        key = (tuple(result.get("overrides") or ()), result.get("profile"))
        groups.setdefault(key, []).append(index)
    summaries = []
    for (overrides, _), jobs in groups.items():
        if len(jobs) < 2:
            continue
        metrics = {}
        for name in REPEAT_METRICS:
            values = [results[job]["metrics"][name] for job in jobs]
            errors = [value["error_pct"] for value in values]
            runs = [run for value in values for run in value.get("engine_runs", [value["engine"]])]
            spread = spread_pct(runs)
            gate = (results[jobs[0]].get("gates") or {}).get(GATED_BY.get(name))
            metrics[name] = {
                "errors_pct": errors,
                "mean_error_pct": None if None in errors else float(np.mean(errors)),
                "engine_spread_pct": spread, "num_engine_runs": len(runs),
                "verdicts": [verdict(error, gate, spread) for error in errors]}
        summaries.append({"jobs": jobs, "overrides": list(overrides), "metrics": metrics})
    return summaries


def repeats_markdown(groups: list[dict], rows: list[dict], swept_keys: list[str]) -> list[str]:
    """The repeats table's lines (none without repeated workloads)."""
    if not groups:
        return []
    names = [name.removesuffix("_ms") for name in REPEAT_METRICS]
    lines = ["", "Workloads validated more than once: each metric's mean signed error over the "
             "rounds, the engine's spread over every engine run of every round (±relative "
             "half-range, %), and how many rounds were within the gate or that spread.", "",
             "| jobs | first job | rounds | " + " | ".join(f"{n} %" for n in names) + " |",
             "|" + "---|" * (3 + len(names))]
    for group in groups:
        first = rows[group["jobs"][0]]
        cells = [", ".join(map(str, group["jobs"])),
                 " ".join(str(first[key]) for key in swept_keys), str(len(group["jobs"]))]
        for name in REPEAT_METRICS:
            metric = group["metrics"][name]
            within = sum(v != OUTSIDE_BOTH for v in metric["verdicts"])
            cells.append(f"{format_error(metric['mean_error_pct'])} "
                         f"({format_spread(metric['engine_spread_pct'])}, "
                         f"{within}/{len(metric['verdicts'])})")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def grid_markdown(rows: list[dict], summary: dict, swept_keys: list[str], command: str,
                  repeats: list[dict] = ()) -> str:
    short = {"request_throughput": "req/s", "num_preemptions": "preempt"}
    names = [short.get(n, n.removesuffix("_ms")) for n in GRID_METRICS]
    header = ["job", *swept_keys, *(f"{n} %" for n in names), "preemptions e/s", "speedup",
              "machine speed"]
    lines = [f"Validation grid: signed error of the profiled simulator against the engine, %. "
             f"{summary['num_passed']}/{summary['num_jobs']} jobs within every gate.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    noise = any(f"{n}_verdict" in row for row in rows for n in GRID_METRICS)
    if noise:
        lines[0] += (" Each error with the engine's spread over its repeats (±relative "
                     "half-range, %) and the verdict: gate (within the gate), noise (within the "
                     "engine's spread only), out (outside both), ungated.")

    def error_cell(row: dict, name: str) -> str:
        text = format_error(row[f"{name}_error_pct"])
        if noise:
            verdict = row.get(f"{name}_verdict")
            text += (f" ({format_spread(row.get(f'{name}_engine_spread_pct'))}, "
                     f"{SHORT_VERDICTS.get(verdict, verdict)})")
        return text

    for row in rows:
        cells = [str(row["job"]), *(row[k] for k in swept_keys),
                 *(error_cell(row, n) for n in GRID_METRICS),
                 f"{format_value(row['engine_preemptions'])}/"
                 f"{format_value(row['sim_preemptions'])}",
                 f"{format_value(row['speedup'])}×", f"{row['speed_factor']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    mean_signed = summary["mean_error_pct"]
    cells = ["mean", *("" for _ in swept_keys),
             *(format_error(mean_signed[n]) for n in GRID_METRICS), "", "", ""]
    lines.append("| " + " | ".join(cells) + " |")
    worst = summary["max_abs_error_pct"]
    cells = ["max abs", *("" for _ in swept_keys),
             *(("inf" if math.isinf(worst[n]) else f"{worst[n]:.2f}") for n in GRID_METRICS),
             "", f"{format_value(summary['speedup'])}×", ""]
    lines.append("| " + " | ".join(cells) + " |")
    lines += repeats_markdown(list(repeats), rows, swept_keys)
    lines += ["", f"command: `{command}`", ""]
    return "\n".join(lines)


def validate_grid(overrides: list[str], out_dir: Path, gates: dict[str, float | None],
                  console: Console | None = None, command: str = "twinserve-validate",
                  normalize_speed: bool = True, sim_runs: int = DEFAULT_SIM_RUNS,
                  engine_repeats: int = DEFAULT_ENGINE_REPEATS) -> dict:
    """Validate every combination of a sweep; write grid.csv, grid.md and grid.json."""
    from tqdm import tqdm

    console = console or Console()
    out_dir = Path(out_dir)
    jobs = expand_sweep(overrides)
    swept = swept_values(jobs)
    results = []
    for index, job in enumerate(tqdm(jobs, desc="validation grid", unit="job")):
        values = " ".join(f"{key}={value}" for key, value in swept[index].items())
        console.print(f"[bold]job {index}[/bold]: {values}")
        results.append(validate(job, out_dir / str(index), gates, console, normalize_speed,
                                sim_runs, engine_repeats))
    return write_grid(results, swept, out_dir, command, console)


def write_grid(results: list[dict], swept: list[dict[str, str]], out_dir: Path, command: str,
               console: Console | None = None) -> dict:
    """Write grid.csv, grid.md and grid.json of these validations' results to `out_dir`; returns
    the grid."""
    console = console or Console()
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = grid_rows(results, swept)
    summary = grid_summary(results)
    repeats = repeat_groups(results)
    swept_keys = list(swept[0])
    with open(out_dir / "grid.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (out_dir / "grid.md").write_text(grid_markdown(rows, summary, swept_keys, command, repeats))
    grid = {"summary": summary, "jobs": rows, "repeats": repeats,
            "failures": {row["job"]: results[row["job"]]["failures"] for row in rows
                         if not row["passed"]}}
    (out_dir / "grid.json").write_text(json.dumps(grid, indent=2) + "\n")
    console.print((out_dir / "grid.md").read_text(), soft_wrap=True, markup=False)
    return grid


def tabulate(validation_dirs: list[Path], out_dir: Path, command: str,
             console: Console | None = None) -> dict:
    """One grid table (write_grid) of validations already run, one job per directory holding a
    validation.json (twinserve-validate's --out), in the order given."""
    if not validation_dirs:
        raise ValueError("--tabulate needs the directories of validations run before "
                         "(twinserve-validate --out DIR)")
    results = []
    for directory in validation_dirs:
        path = Path(directory) / "validation.json"
        try:
            results.append(json.loads(path.read_text()))
        except (OSError, ValueError) as error:
            raise ValueError(f"--tabulate: cannot read {path}: {error}") from None
        if not isinstance(results[-1], dict) or "metrics" not in results[-1]:
            raise ValueError(f"--tabulate: {path} is not a twinserve-validate result")
    swept = [{"validation": str(directory)} for directory in validation_dirs]
    return write_grid(results, swept, Path(out_dir), command, console)
