"""The replay's report: a table per run and load stage (real, simulated, signed error %), the
overload flags, a combined table over several runs, validation.md and cdfs.png (TTFT, TPOT and
E2E CDFs, real solid and simulated dashed, one colour per stage)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from calibration.realrun.stage_metrics import METRICS
from calibration.validate.report import format_error, format_value

COMBINED_METRICS = ("mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
                    "mean_e2el_ms", "median_e2el_ms")


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def stage_title(run: dict, stage: dict) -> str:
    rate = stage["arrival_rate"]
    overloaded = stage["overloaded"]
    flag = "  DISAGREE" if overloaded["disagree"] else ""
    return (f"{run['name']} · {stage['label']}: requests {stage['first_request']}–"
            f"{stage['last_request']} ({stage['num_requests']}), "
            f"{'inf' if rate is None else f'{rate:.2f}'} req/s · overloaded: real "
            f"{_yes(overloaded['real'])}, sim {_yes(overloaded['sim'])}{flag}")


def stage_rows(stage: dict) -> list[tuple[str, str, str, str]]:
    return [(name, format_value(stage["real"][name]), format_value(stage["sim"][name]),
             format_error(stage["error_pct"][name]) if stage["error_pct"][name] is not None
             or stage["real"][name] is None else "inf")
            for name in METRICS]


def settings_lines(run: dict) -> list[str]:
    lines = [f"{name}: {info['override'] or info['value']}  ({info['source']})"
             for name, info in run["settings"].items()]
    hit_rate = run.get("sim_prefix_cache_hit_rate")
    cache = [] if hit_rate is None else [f"sim prefix cache hit rate: {100 * hit_rate:.1f} % of "
                                         f"prompt tokens"]
    return (lines + [f"cost model: {run['cost_model']}"] + cache
            + [f"note: {note}" for note in run["notes"]])


def print_run(run: dict, console: Console) -> None:
    console.print(f"[bold]{run['name']}[/bold]: {run['source']}")
    for line in settings_lines(run):
        console.print(f"  {line}")
    for stage in run["stages"]:
        table = Table(title=stage_title(run, stage),
                      title_style="bold red" if stage["overloaded"]["disagree"] else None)
        for column in ("metric", "real", "sim", "error %"):
            table.add_column(column, justify="left" if column == "metric" else "right")
        for row in stage_rows(stage):
            table.add_row(*row)
        console.print(table)


def combined_rows(runs: list[dict]) -> list[tuple[str, ...]]:
    """(run, stage, req/s, the COMBINED_METRICS' errors %, overloaded real/sim) per stage."""
    rows = []
    for run in runs:
        for stage in run["stages"]:
            rate = stage["arrival_rate"]
            overloaded = stage["overloaded"]
            rows.append((run["name"], stage["label"], "inf" if rate is None else f"{rate:.2f}",
                         *(format_error(stage["error_pct"][name]) for name in COMBINED_METRICS),
                         f"{_yes(overloaded['real'])}/{_yes(overloaded['sim'])}"
                         + (" DISAGREE" if overloaded["disagree"] else "")))
    return rows


COMBINED_COLUMNS = ("run", "stage", "req/s", *(f"{name} err %" for name in COMBINED_METRICS),
                    "overloaded real/sim")


def print_combined(runs: list[dict], console: Console) -> None:
    table = Table(title="real runs: signed error % of the simulator, per stage")
    for column in COMBINED_COLUMNS:
        table.add_column(column, justify="left" if column in ("run", "stage") else "right")
    for row in combined_rows(runs):
        table.add_row(*row)
    console.print(table)


def _markdown_table(columns, rows) -> list[str]:
    return (["| " + " | ".join(columns) + " |",
             "|" + "".join("---|" if i == 0 else "---:|" for i in range(len(columns)))]
            + [f"| {' | '.join(row)} |" for row in rows])


def markdown_report(runs: list[dict], command: str) -> str:
    lines = ["# Real runs replayed through the simulator", "", f"`{command}`", "",
             "Errors are signed, (sim - real) / real × 100. Overloaded: the stage's TTFT grows "
             "by 0.1 s or more per second of arrivals (least-squares slope over its requests).",
             ""]
    if len(runs) > 1:
        lines += _markdown_table(COMBINED_COLUMNS, combined_rows(runs)) + [""]
    for run in runs:
        lines += [f"## {run['name']}", "", f"{run['source']}", ""]
        lines += [f"- {line}" for line in settings_lines(run)] + [""]
        for stage in run["stages"]:
            lines += [f"### {stage_title(run, stage)}", ""]
            lines += _markdown_table(("metric", "real", "sim", "error %"), stage_rows(stage))
            lines.append("")
    return "\n".join(lines)


def plot_cdfs(run: dict, real, sim, stage_requests: list[np.ndarray], out_path: Path) -> Path:
    """TTFT, TPOT and E2E CDFs side by side: real solid, simulated dashed, a colour per stage
    (`stage_requests`: each stage's request indices)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "E2E"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (field, title) in zip(axes, panels):
        ax.set_title(f"{run['name']}: {title} CDF", fontsize=9)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of the stage's requests")
        ax.set_ylim(0.0, 1.0)
        ax.grid(True, alpha=0.3)
        for number, (stage, indices) in enumerate(zip(run["stages"], stage_requests)):
            for side, values, style in (("real", real, "-"), ("sim", sim, "--")):
                data = getattr(values, field)[indices] * 1000.0
                data = np.sort(data[np.isfinite(data)])
                if data.size:
                    label = side if len(run["stages"]) == 1 else f"{stage['label']} {side}"
                    ax.step(data, np.arange(1, data.size + 1) / data.size, where="post",
                            linestyle=style, color=colours[number % len(colours)], label=label)
        ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path
