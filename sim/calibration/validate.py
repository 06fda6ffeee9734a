"""`twinserve-validate`: run one workload on the engine and on the profiled simulator, and compare.

    python -m sim.calibration.validate --out validation/ cost_model.profile=profiles/cpu/tiny-llama.json \\
        model=tiny-llama hardware=cpu workload.with_token_ids=true workload.num_requests=50

Both runs use the same config (policies, workload, seed, KV pool size) composed from the repo's
conf/ plus the given overrides; only the backend differs: `backend=engine` runs every step for real,
`backend=sim cost_model=profiled` predicts each step from the profile alone (it never sees the
engine run's measurements). When the profile carries a speed reference (twinserve-profile's speed
probe), the engine's step durations are normalised to the machine speed the profile was taken at
(engine/speed.py: on a shared machine the speed drifts by tens of % over minutes, which no cost
model can predict); `--wall-clock` times them as measured. The simulator runs the workload
`--sim-runs` times (sim_seed, sim_seed + 1, ...: other draws of step-time noise and acceptances)
and its value of a metric is the mean over them. Writes <out>/engine/, <out>/sim/ and
<out>/sim-run1/... (each run's usual files; plots for the first simulator run only) and

- `validation.json`: {"metrics": {name: {"engine", "sim", "error_pct"}}, "speedup": engine wall
  time / simulator wall time, "gates": {...}, "failures": [...], ...}; error_pct is the signed
  (sim - engine) / engine × 100, null where the engine value is 0 and the simulator's is not;
- `validation.md` (the same table) and `validation_cdf.png` (TTFT, TPOT and E2E CDFs of both
  backends, the simulator's runs pooled).

A validation grid is a Hydra sweep: give any override several values (`scheduler=continuous,
chunked_prefill kv_cache.block_size=16,32 workload.rate=2,inf`) and every combination is validated
in <out>/<job>/, with one table for the grid, `grid.csv` and `grid.md` (each job's swept values,
signed errors and speedup; then the largest |error| of each metric over the grid).

Exit status: 0 when every gated error is within its gate, 1 when any passes it (listed on stderr),
2 on bad input (a bad override, a missing or mismatched profile, a bad config value).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import shlex
import sys
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"

LATENCIES: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")
STATS: tuple[str, ...] = ("mean", "median", "p90", "p99")
METRICS: tuple[str, ...] = (
    *(f"{stat}_{name}_ms" for name in LATENCIES for stat in STATS),
    "request_throughput", "output_throughput",
    "num_preemptions", "peak_kv_blocks", "swap_bytes",
    "spec_acceptance_rate", "mean_tokens_per_decode_step",   # 0 and 1 (or 0) without drafts
)

# The targets: means and medians of TTFT, TPOT and e2e and the throughputs within 3 %,
# p99s within 8 % (p99 TTFT 10 %), the preemption count within 5 %.
DEFAULT_GATES = {"mean_pct": 3.0, "p99_pct": 8.0, "p99_ttft_pct": 10.0, "preemptions_pct": 5.0}
GATED_BY: dict[str, str] = {
    **{f"{stat}_{name}_ms": "mean_pct" for name in ("ttft", "tpot", "e2el")
       for stat in ("mean", "median")},
    "request_throughput": "mean_pct", "output_throughput": "mean_pct",
    "p99_ttft_ms": "p99_ttft_pct", "p99_tpot_ms": "p99_pct", "p99_itl_ms": "p99_pct",
    "p99_e2el_ms": "p99_pct",
    "num_preemptions": "preemptions_pct",
}
CDF_COLUMNS: tuple[tuple[str, str], ...] = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"),
                                            ("e2el_ms", "E2E"))


UNSET = object()  # a gate not given on the command line
# The simulator predicts a run's expected metrics: the mean over this many runs of its random
# draws (a p99 of one run moves by several % between draws; the engine's run is one draw).
DEFAULT_SIM_RUNS = 5


class ValidationInputError(ValueError):
    """Bad input: exit status 2."""


# ---- pure functions on summaries ---------------------------------------------------------------

def error_pct(engine: float, sim: float) -> float | None:
    """Signed (sim - engine) / engine × 100. With engine = 0: 0 if sim is 0 too, else None (an
    infinite relative error, which fails any gate)."""
    engine, sim = float(engine), float(sim)
    if engine == 0.0:
        return 0.0 if sim == 0.0 else None
    return (sim - engine) / abs(engine) * 100.0


def compare_summaries(engine: dict, sim: dict,
                      metrics: tuple[str, ...] = METRICS) -> dict[str, dict]:
    """{name: {"engine": x, "sim": y, "error_pct": e}} for every metric of `metrics`."""
    missing = [name for name in metrics if name not in engine or name not in sim]
    if missing:
        raise ValidationInputError(f"summaries lack the metrics {missing}")
    return {name: {"engine": engine[name], "sim": sim[name],
                   "error_pct": error_pct(engine[name], sim[name])} for name in metrics}


def check_gates(metrics: dict[str, dict], gates: dict[str, float | None]) -> list[str]:
    """The gated metrics whose |error| passes their gate, as 'name: error % (gate ±g %)' lines.
    A gate of None switches that gate off; an error of None (engine 0, sim not) always fails."""
    failures = []
    for name, gate_name in GATED_BY.items():
        gate = gates.get(gate_name)
        if gate is None or name not in metrics:
            continue
        error = metrics[name]["error_pct"]
        if error is None or not math.isfinite(error) or abs(error) > gate:
            shown = "inf" if error is None else f"{error:+.3f} %"
            failures.append(f"{name}: {shown} (gate ±{gate:g} %, {gate_name})")
    return failures


def resolve_gates(cli: dict[str, float | None | str], config=None) -> dict[str, float | None]:
    """Each gate from the command line if given there, else from the config's `validate` node
    (`+validate.gate_mean_pct=5`), else the default. UNSET on the command line means not given."""
    config = config or {}
    gates = {}
    for name, default in DEFAULT_GATES.items():
        value = cli.get(name, UNSET)
        if value is UNSET:
            value = config.get(f"gate_{name}", default)
            if value is not None and (isinstance(value, bool) or
                                      not isinstance(value, (int, float)) or value < 0):
                raise ValidationInputError(f"validate.gate_{name} must be a percentage >= 0 or "
                                           f"null, got {value!r}")
        gates[name] = None if value is None else float(value)
    return gates


def speedup(engine_wall_s: float, sim_wall_s: float) -> float | None:
    return engine_wall_s / sim_wall_s if sim_wall_s > 0 else None


# ---- report ------------------------------------------------------------------------------------

def _fmt(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, int) or float(value).is_integer() and abs(value) >= 1000:
        return f"{int(value):,}"
    return f"{value:,.3f}"


def _fmt_error(error: float | None) -> str:
    return "inf" if error is None else f"{error:+.2f}"


def report_rows(metrics: dict[str, dict]) -> list[tuple[str, str, str, str, str]]:
    rows = []
    for name, values in metrics.items():
        gate = GATED_BY.get(name, "")
        rows.append((name, _fmt(values["engine"]), _fmt(values["sim"]),
                     _fmt_error(values["error_pct"]), gate))
    return rows


def rich_table(result: dict) -> Table:
    table = Table(title=f"validation: engine vs simulator (speedup "
                        f"{_fmt(result['speedup'])}×)")
    for column in ("metric", "engine", "sim", "error %", "gate"):
        table.add_column(column, justify="left" if column in ("metric", "gate") else "right")
    failed = {line.split(":")[0] for line in result["failures"]}
    for row in report_rows(result["metrics"]):
        table.add_row(*row, style="red" if row[0] in failed else None)
    return table


def engine_clock_line(conditions: dict) -> str:
    if conditions.get("clock") != "profile speed":
        return "engine steps timed as measured (wall clock)"
    return (f"engine steps normalised to the profile's machine speed: the machine ran "
            f"{conditions['speed_factor_median']:.3f}× the profile's step times (median of "
            f"{conditions['speed_probes']} probes; 5-95 %: {conditions['speed_factor_p05']:.3f}-"
            f"{conditions['speed_factor_p95']:.3f}×)")


def markdown_report(result: dict) -> str:
    lines = ["# Validation: engine vs profiled simulator", "",
             f"profile: `{result['profile']}`", "",
             f"engine wall time {result['engine_wall_time_s']:.3f} s, simulator "
             f"{result['sim_wall_time_s']:.3f} s: speedup {_fmt(result['speedup'])}×", "",
             engine_clock_line(result.get("engine_conditions") or {}), "",
             "| metric | engine | sim | error % | gate |", "|---|---:|---:|---:|---|"]
    lines += [f"| {' | '.join(row)} |" for row in report_rows(result["metrics"])]
    gates = ", ".join(f"{k} {'off' if v is None else f'±{v:g} %'}"
                      for k, v in result["gates"].items())
    lines += ["", f"gates: {gates}", ""]
    if result["failures"]:
        lines += ["**FAILED**:", ""] + [f"- {line}" for line in result["failures"]]
    else:
        lines.append("**passed**: every gated error is within its gate.")
    if result.get("overrides"):
        lines += ["", "overrides: `" + " ".join(result["overrides"]) + "`"]
    return "\n".join(lines) + "\n"


def read_latencies_ms(requests_csv: Path) -> dict[str, np.ndarray]:
    """The TTFT/TPOT/E2E columns of a requests.csv (empty cells skipped), in ms."""
    values: dict[str, list[float]] = {column: [] for column, _ in CDF_COLUMNS}
    with open(requests_csv, newline="") as file:
        for row in csv.DictReader(file):
            for column in values:
                if row.get(column):
                    values[column].append(float(row[column]))
    return {column: np.asarray(v, dtype=np.float64) for column, v in values.items()}


def plot_cdfs(engine_csv: Path, sim_csvs: list[Path], out_path: Path) -> Path:
    """The engine's CDFs over the simulator's (every simulator run's requests pooled)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sim_latencies = [read_latencies_ms(path) for path in sim_csvs]
    pooled = {column: np.concatenate([run[column] for run in sim_latencies])
              for column, _ in CDF_COLUMNS}
    runs = {"engine": read_latencies_ms(engine_csv), "sim (profiled)": pooled}
    fig, axes = plt.subplots(1, len(CDF_COLUMNS), figsize=(5 * len(CDF_COLUMNS), 4))
    for ax, (column, title) in zip(axes, CDF_COLUMNS):
        ax.set_title(f"{title} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0.0, 1.0)
        ax.grid(True, alpha=0.3)
        for (label, values), style in zip(runs.items(), ("-", "--")):
            data = np.sort(values[column])
            if data.size:
                ax.step(data, np.arange(1, data.size + 1) / data.size, where="post",
                        linestyle=style, label=label)
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path


# ---- the two runs ------------------------------------------------------------------------------

def compose_configs(overrides: list[str]):
    """(engine config, sim config) from conf/ plus `overrides`: identical but for the backend,
    with the KV pool the engine's memory arithmetic gives (unless kv_cache.num_blocks is set) so
    the two replicas schedule over the same pool."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    reserved = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") in ("backend", "cost_model")]
    if reserved:
        raise ValidationInputError(f"{reserved}: validation sets the backend (engine and sim) "
                                   f"and the cost model (profiled) itself; pass "
                                   f"cost_model.profile=<path> or --profile")
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            base = ["progress=false", "cost_model=profiled", *overrides]
            engine_cfg = compose("config", overrides=[*base, "backend=engine"])
            sim_cfg = compose("config", overrides=[*base, "backend=sim"])
    except (HydraException, OmegaConfBaseException) as error:
        raise ValidationInputError(f"bad override: {error}") from None
    if OmegaConf.is_missing(sim_cfg.cost_model, "profile"):
        raise ValidationInputError("no profile: pass cost_model.profile=<path> or --profile <path> "
                                   "(profiles/<device>/<model>.json from twinserve-profile)")
    if not sim_cfg.workload.get("with_token_ids", False):
        raise ValidationInputError("the engine needs token ids: add workload.with_token_ids=true")
    return engine_cfg, sim_cfg


def pin_kv_pool(engine_cfg, sim_cfg) -> int:
    """Set kv_cache.num_blocks of both configs to the engine's pool size."""
    from omegaconf import open_dict

    from sim.core.build import num_kv_blocks
    from sim.core.specs import HardwareSpec, ModelSpec

    model = ModelSpec.from_config(engine_cfg.model)
    hardware = HardwareSpec.from_config(engine_cfg.hardware)
    blocks = num_kv_blocks(engine_cfg, model, hardware)
    for cfg in (engine_cfg, sim_cfg):
        with open_dict(cfg):
            cfg.kv_cache.num_blocks = blocks
    return blocks


def match_profile_conditions(profile_path: str, engine_cfg, normalize_speed: bool,
                             console: Console) -> dict:
    """Run the engine (engine_cfg) as the profile was measured: on CPU, with the profile's torch
    thread count (metadata.threads); with normalize_speed, at the profile's machine speed
    (engine/speed.py: backend.speed_reference) when the profile has a speed reference, else
    warns and keeps the wall clock. Warns when the torch version differs. Returns what was
    set."""
    import torch
    from omegaconf import open_dict

    profile = json.loads(Path(profile_path).read_text())
    metadata = profile.get("metadata") or {}
    conditions: dict = {"torch_version": torch.__version__, "clock": "wall"}
    if metadata.get("torch_version") not in (None, torch.__version__):
        console.print(f"[yellow]warning: the profile was taken with torch "
                      f"{metadata['torch_version']}, this is {torch.__version__}[/yellow]")
    threads = metadata.get("threads")
    if metadata.get("device_type", "cpu") == "cpu" and isinstance(threads, int) and threads > 0:
        torch.set_num_threads(threads)
    conditions["threads"] = torch.get_num_threads()
    if normalize_speed:
        if "speed_reference" not in profile:
            console.print(f"[yellow]warning: {profile_path} has no speed_reference (taken "
                          f"without the speed probe): the engine's steps are timed as measured, "
                          f"drift of the machine since profiling included[/yellow]")
        else:
            with open_dict(engine_cfg):
                engine_cfg.backend.speed_reference = profile_path
            conditions["clock"] = "profile speed"
    return conditions


def sim_run_dirs(out_dir: Path, sim_runs: int) -> list[Path]:
    """Where each simulator run writes: <out>/sim, then <out>/sim-run1, sim-run2, ..."""
    return [out_dir / ("sim" if run == 0 else f"sim-run{run}") for run in range(sim_runs)]


def mean_summary(summaries: list[dict], metrics: tuple[str, ...] = METRICS) -> dict:
    """Several simulator runs of one workload as one prediction: each metric's mean over the
    runs (their expected value, where one run is one draw of the residuals and acceptances)."""
    mean = {name: float(np.mean([summary[name] for summary in summaries]))
            for name in metrics if all(name in summary for summary in summaries)}
    mean["wall_time_s"] = float(np.mean([summary["wall_time_s"] for summary in summaries]))
    mean["completed"] = summaries[0]["completed"]
    return mean


def validate(overrides: list[str], out_dir: Path, gates: dict[str, float | None],
             console: Console | None = None, normalize_speed: bool = True,
             sim_runs: int = DEFAULT_SIM_RUNS) -> dict:
    """Run both backends, write the report into out_dir, and return validation.json's dict.
    With normalize_speed the engine's step durations are normalised to the profile's machine
    speed (engine/speed.py), when the profile has a speed reference. The simulator runs
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
        # The simulator first: a bad profile is bad input, found before minutes of engine steps.
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


# ---- the grid ------------------------------------------------------------------------------------

# The columns of the grid table: the errors people compare simulators by.
GRID_METRICS: tuple[str, ...] = (
    "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
    "p99_tpot_ms", "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms", "request_throughput",
    "num_preemptions",
)


def expand_sweep(overrides: list[str]) -> list[list[str]]:
    """Every combination of the overrides' values, as Hydra's basic sweeper expands a multirun
    (`a=1,2 b=x,y` -> 4 lists; `range(...)`, `choice(...)` and glob work too). One list when
    nothing sweeps."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as error:
        raise ValidationInputError(f"bad override: {error}") from None
    if not any(override.is_sweep_override() for override in parsed):
        return [list(overrides)]
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def swept_values(jobs: list[list[str]]) -> list[dict[str, str]]:
    """Per job, {key: value} of the overrides that differ between jobs."""
    parsed = [dict(o.split("=", 1) if "=" in o else (o, "") for o in job) for job in jobs]
    keys = [key for key in parsed[0] if len({p.get(key) for p in parsed}) > 1]
    return [{key: p.get(key, "") for key in keys} for p in parsed]


def grid_rows(results: list[dict], swept: list[dict[str, str]]) -> list[dict]:
    rows = []
    for index, (result, values) in enumerate(zip(results, swept)):
        row = {"job": index, **values}
        for name in GRID_METRICS:
            row[f"{name}_error_pct"] = result["metrics"][name]["error_pct"]
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
    """The largest |error| of every metric over the grid (inf where an error was undefined),
    the mean |error|, and the overall speedup (Σ engine wall time / Σ simulator wall time)."""
    worst, mean = {}, {}
    for name in METRICS:
        errors = [r["metrics"][name]["error_pct"] for r in results]
        magnitudes = [math.inf if e is None else abs(e) for e in errors]
        worst[name] = max(magnitudes)
        mean[name] = float(np.mean(magnitudes))
    engine_s = sum(r["engine_wall_time_s"] for r in results)
    sim_s = sum(r["sim_wall_time_s"] for r in results)
    return {"num_jobs": len(results), "num_passed": sum(r["passed"] for r in results),
            "max_abs_error_pct": worst, "mean_abs_error_pct": mean,
            "speedup": speedup(engine_s, sim_s), "engine_wall_time_s": engine_s,
            "sim_wall_time_s": sim_s}


def grid_markdown(rows: list[dict], summary: dict, swept_keys: list[str], command: str) -> str:
    short = {"request_throughput": "req/s", "num_preemptions": "preempt"}
    names = [short.get(n, n.removesuffix("_ms")) for n in GRID_METRICS]
    header = ["job", *swept_keys, *(f"{n} %" for n in names), "preemptions e/s", "speedup",
              "machine speed"]
    lines = [f"Validation grid: signed error of the profiled simulator against the engine, %. "
             f"{summary['num_passed']}/{summary['num_jobs']} jobs within every gate.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [str(row["job"]), *(row[k] for k in swept_keys),
                 *(_fmt_error(row[f"{n}_error_pct"]) for n in GRID_METRICS),
                 f"{_fmt(row['engine_preemptions'])}/{_fmt(row['sim_preemptions'])}",
                 f"{_fmt(row['speedup'])}×", f"{row['speed_factor']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    worst = summary["max_abs_error_pct"]
    cells = ["max abs", *("" for _ in swept_keys),
             *(("inf" if math.isinf(worst[n]) else f"{worst[n]:.2f}") for n in GRID_METRICS),
             "", f"{_fmt(summary['speedup'])}×", ""]
    lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"command: `{command}`", ""]
    return "\n".join(lines)


def validate_grid(overrides: list[str], out_dir: Path, gates: dict[str, float | None],
                  console: Console | None = None, command: str = "twinserve-validate",
                  normalize_speed: bool = True, sim_runs: int = DEFAULT_SIM_RUNS) -> dict:
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
                                sim_runs))
    rows = grid_rows(results, swept)
    summary = grid_summary(results)
    swept_keys = list(swept[0])
    with open(out_dir / "grid.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (out_dir / "grid.md").write_text(grid_markdown(rows, summary, swept_keys, command))
    grid = {"summary": summary, "jobs": rows,
            "failures": {row["job"]: results[row["job"]]["failures"] for row in rows
                         if not row["passed"]}}
    (out_dir / "grid.json").write_text(json.dumps(grid, indent=2) + "\n")
    console.print((out_dir / "grid.md").read_text(), soft_wrap=True, markup=False)
    return grid


# ---- command line ------------------------------------------------------------------------------

def _gate(text: str) -> float | None:
    if text.lower() in ("none", "off", "null"):
        return None
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"a gate is a percentage >= 0 or 'off', got {text!r}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="twinserve-validate",
        description="Run one workload on the engine and on the profiled simulator and compare "
                    "their metrics. Other arguments are Hydra overrides, as for twinserve.")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=tiny-llama")
    parser.add_argument("--out", type=Path, default=Path("validation"),
                        help="output folder (default: ./validation)")
    parser.add_argument("--profile", help="the profile JSON (same as cost_model.profile=...)")
    parser.add_argument("--wall-clock", action="store_true",
                        help="time the engine's steps as measured, not normalised to the "
                             "profile's machine speed by the speed probe")
    parser.add_argument("--sim-runs", type=int, default=DEFAULT_SIM_RUNS,
                        help="simulator runs of the workload, each with its own residual and "
                             "acceptance draws (sim_seed, sim_seed + 1, ...); the simulator's "
                             f"value of a metric is its mean over them (default "
                             f"{DEFAULT_SIM_RUNS})")
    parser.add_argument("--gate-mean-pct", type=_gate, default=UNSET,
                        help="|error| %% gate on means/medians of TTFT, TPOT, e2e and throughputs "
                             "(default 3; 'off' disables a gate)")
    parser.add_argument("--gate-p99-pct", type=_gate, default=UNSET,
                        help="|error| %% gate on p99 TPOT, ITL and e2e (default 8)")
    parser.add_argument("--gate-p99-ttft-pct", type=_gate, default=UNSET,
                        help="|error| %% gate on p99 TTFT (default 10)")
    parser.add_argument("--gate-preemptions-pct", type=_gate,
                        default=UNSET,
                        help="|error| %% gate on the preemption count (default 5)")
    # Intermixed: overrides and options in any order, as Hydra users write them.
    return parser.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = list(args.overrides)
    if args.profile:
        overrides.append(f"cost_model.profile={args.profile}")
    gates = {"mean_pct": args.gate_mean_pct, "p99_pct": args.gate_p99_pct,
             "p99_ttft_pct": args.gate_p99_ttft_pct,
             "preemptions_pct": args.gate_preemptions_pct}
    try:
        if len(expand_sweep(overrides)) > 1:
            command = shlex.join(["twinserve-validate",
                                  *(argv if argv is not None else sys.argv[1:])])
            grid = validate_grid(overrides, args.out, gates, command=command,
                                 normalize_speed=not args.wall_clock, sim_runs=args.sim_runs)
            print(f"results in {args.out}")
            failed = grid["failures"]
            if failed:
                print(f"twinserve-validate: gate failed in {len(failed)} of "
                      f"{grid['summary']['num_jobs']} jobs: "
                      f"{', '.join(str(job) for job in failed)}", file=sys.stderr)
                return 1
            return 0
        result = validate(overrides, args.out, gates, normalize_speed=not args.wall_clock,
                          sim_runs=args.sim_runs)
    except ValueError as error:  # ValidationInputError, ProfileError, a bad config value
        print(f"twinserve-validate: error: {error}", file=sys.stderr)
        return 2
    print(f"results in {args.out}")
    if result["failures"]:
        print("twinserve-validate: gate failed:\n  " + "\n  ".join(result["failures"]),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
