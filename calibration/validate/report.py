"""One validation's report: the rich table on the terminal, validation.md, and validation_cdf.png
(the engine's TTFT, TPOT and E2E CDFs over the simulator's)."""
from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
from rich.table import Table

from calibration.validate.compare import GATED_BY
from calibration.validate.profile_conditions import engine_clock_line

CDF_COLUMNS: tuple[tuple[str, str], ...] = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"),
                                            ("e2el_ms", "E2E"))


def format_value(value) -> str:
    """A metric's value for a table: n/a, 1,234 (large integers) or 12.345."""
    if value is None:
        return "n/a"
    if isinstance(value, int) or float(value).is_integer() and abs(value) >= 1000:
        return f"{int(value):,}"
    return f"{value:,.3f}"


def format_error(error: float | None) -> str:
    """A signed error % for a table (inf where it is undefined)."""
    return "inf" if error is None else f"{error:+.2f}"


def format_spread(spread: float | None) -> str:
    """The engine's spread % for a table: ±1.23 (inf where it is infinite)."""
    return "inf" if spread is None else f"±{spread:.2f}"


def has_engine_noise(metrics: dict[str, dict]) -> bool:
    """Whether the metrics carry the engine's spread and verdicts (engine repeats > 1)."""
    return any("engine_spread_pct" in values for values in metrics.values())


def report_columns(metrics: dict[str, dict]) -> tuple[str, ...]:
    noise = ("engine spread %", "verdict") if has_engine_noise(metrics) else ()
    return ("metric", "engine", "sim", "error %", *noise, "gate")


def report_rows(metrics: dict[str, dict]) -> list[tuple[str, ...]]:
    """(metric, engine, sim, error %, [engine spread %, verdict,] gate) per metric, formatted;
    the engine's value is the mean over its repeats."""
    noise = has_engine_noise(metrics)
    rows = []
    for name, values in metrics.items():
        gate = GATED_BY.get(name, "")
        extra = ((format_spread(values.get("engine_spread_pct")), values.get("verdict", ""))
                 if noise else ())
        rows.append((name, format_value(values["engine"]), format_value(values["sim"]),
                     format_error(values["error_pct"]), *extra, gate))
    return rows


def rich_table(result: dict) -> Table:
    table = Table(title=f"validation: engine vs simulator (speedup "
                        f"{format_value(result['speedup'])}×)")
    for column in report_columns(result["metrics"]):
        table.add_column(column, justify="left" if column in ("metric", "gate", "verdict")
                         else "right")
    failed = {line.split(":")[0] for line in result["failures"]}
    for row in report_rows(result["metrics"]):
        table.add_row(*row, style="red" if row[0] in failed else None)
    return table


def markdown_report(result: dict) -> str:
    lines = ["# Validation: engine vs profiled simulator", "",
             f"profile: `{result['profile']}`", "",
             f"engine wall time {result['engine_wall_time_s']:.3f} s, simulator "
             f"{result['sim_wall_time_s']:.3f} s: speedup {format_value(result['speedup'])}×", "",
             engine_clock_line(result.get("engine_conditions") or {}), ""]
    columns = report_columns(result["metrics"])
    if "verdict" in columns:
        lines += [f"engine: the mean of {result.get('engine_repeats', 'several')} repeats (same "
                  f"config and seed); engine spread: their relative half-range, (max - min) / 2 / "
                  f"|mean| × 100; verdict: within gate, else within engine noise (|error| <= "
                  f"spread, still a gate failure), else outside both", ""]
    lines += ["| " + " | ".join(columns) + " |",
              "|" + "".join("---|" if column in ("metric", "gate", "verdict") else "---:|"
                            for column in columns)]
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


def plot_cdfs(engine_csvs: Path | list[Path], sim_csvs: list[Path], out_path: Path) -> Path:
    """The engine's CDFs over the simulator's (every engine repeat's and every simulator run's
    requests pooled)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sim_latencies = [read_latencies_ms(path) for path in sim_csvs]
    pooled = {column: np.concatenate([run[column] for run in sim_latencies])
              for column, _ in CDF_COLUMNS}
    engine_csvs = [engine_csvs] if isinstance(engine_csvs, (str, Path)) else engine_csvs
    engine_latencies = [read_latencies_ms(path) for path in engine_csvs]
    engine = {column: np.concatenate([run[column] for run in engine_latencies])
              for column, _ in CDF_COLUMNS}
    runs = {"engine": engine, "sim (profiled)": pooled}
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
