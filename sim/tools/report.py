"""`twinserve-report` (or `python -m sim.tools.report`): one table and one comparison figure for a
Hydra sweep (docs/sweeps.md).

    twinserve-report multirun/2024-05-01/12-00-00                # x = workload.rate if it varies
    twinserve-report SWEEP --x kv_cache.block_size --metrics kv_waste_fraction,peak_num_seqs

report.csv has a row per job (its overrides, summary keys dotted, three figures from steps.csv);
the PNG a panel per metric against the x override, a line per *policy* (the combination of the
other varying overrides). Jobs without summary.json are listed with their status only.
"""
from __future__ import annotations

import argparse
import csv
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from sim.tools.report_labels import (format_value, metric_heading, metric_label, policy_label,
                                     short_names, value_texts)
from sim.tools.report_runs import RUNS_NOTE, runs_table
from sim.tools.sweep_jobs import (DEFAULT_X_KEY, STEP_METRICS, Job, ReportError, as_number,
                                  choose_x_key, is_numeric_key, load_jobs, natural_key,
                                  override_keys, varying_keys)

DEFAULT_METRICS: tuple[str, ...] = ("request_throughput", "p99_ttft_ms", "p99_tpot_ms")
# The default's fourth panel where the runs report energy (docs/energy.md): 0.0 where a hardware
# spec states no board power, and absent from summaries written before energy was modelled.
DEFAULT_ENERGY_METRIC = "tokens_per_joule"
REPORT_CSV = "report.csv"
PER_CLASS_PLOT = "per_class.png"   # written when the runs have request classes


# ---- what is plotted ----------------------------------------------------------------------------

def policy_styles(policies: dict[str, list[Job]], policy_keys: list[str]) -> dict[str, dict]:
    """Matplotlib line styles per policy: with two varying keys colour follows the second and
    line style the first, so that the pairs to compare stand side by side."""
    colors = [f"C{index}" for index in range(10)]
    dashes = ["-", "--", ":", "-."]
    if len(policy_keys) != 2:
        return {label: {"color": colors[index % len(colors)], "linestyle": "-"}
                for index, label in enumerate(policies)}
    first_values = list(dict.fromkeys(members[0].overrides.get(policy_keys[0])
                                      for members in policies.values()))
    second_values = list(dict.fromkeys(members[0].overrides.get(policy_keys[1])
                                       for members in policies.values()))
    return {label: {
        "color": colors[second_values.index(members[0].overrides.get(policy_keys[1]))
                        % len(colors)],
        "linestyle": dashes[first_values.index(members[0].overrides.get(policy_keys[0]))
                            % len(dashes)],
    } for label, members in policies.items()}


def check_metrics(jobs: list[Job], metrics: Sequence[str]) -> list[str]:
    """The metrics, once each is known to be in some finished job's results."""
    finished = [job for job in jobs if job.summary is not None]
    known = sorted({key for job in finished for key in [*job.summary, *job.step_metrics]})
    for key in metrics:
        if finished and not any(job.metric(key) is not None for job in finished):
            raise ReportError(f"metric {key!r} is in no job's summary; known metrics: "
                              f"{', '.join(known)}")
    return list(metrics)


def default_metrics(jobs: list[Job]) -> list[str]:
    """DEFAULT_METRICS, and DEFAULT_ENERGY_METRIC where a finished job reports energy."""
    reports_energy = any((job.metric(DEFAULT_ENERGY_METRIC) or 0) > 0 for job in jobs
                         if job.summary is not None)
    return [*DEFAULT_METRICS, *([DEFAULT_ENERGY_METRIC] if reports_energy else [])]


# ---- outputs ------------------------------------------------------------------------------------

def write_csv(jobs: list[Job], path: Path) -> Path:
    """One row per job: folder, status, every override key, every summary key, step metrics."""
    keys = override_keys(jobs)
    summary_keys: dict[str, None] = {}
    for job in jobs:
        if job.summary is not None:
            summary_keys.update(dict.fromkeys(job.summary))
    summary_keys.update(dict.fromkeys(key for key in STEP_METRICS
                                      if any(key in job.step_metrics for job in jobs)))
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["job", "status", *keys, *summary_keys])
        for job in jobs:
            metrics = [job.metric(key) for key in summary_keys]
            writer.writerow([job.name, job.status, *(job.overrides.get(key, "") for key in keys),
                             *("" if value is None else value for value in metrics)])
    return path


def default_plot_name(x_key: str | None) -> str:
    """throughput_vs_load.png for a load sweep, else metrics_vs_<x less its group>.png."""
    if x_key == DEFAULT_X_KEY:
        return "throughput_vs_load.png"
    name = short_names([x_key])[x_key] if x_key else "job"
    return f"metrics_vs_{re.sub(r'[^A-Za-z0-9]+', '_', name).strip('_')}.png"


def x_value(job: Job, x_key: str | None, texts: dict[str, dict[str, str]]) -> str:
    """The job's x as text: its override value as `texts` (value_texts) shows it, or its folder
    when there is no x key."""
    if not x_key:
        return job.name
    value = job.overrides.get(x_key, "")
    return texts.get(x_key, {}).get(value, value)


def plot_comparison(jobs: list[Job], x_key: str | None, metrics: list[str], path: Path,
                    title: str | None = None) -> Path:
    """One panel per metric; one line per policy against a numeric x, grouped bars otherwise."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finished = [job for job in jobs if job.summary is not None]
    policy_keys = [key for key in varying_keys(finished) if key != x_key]
    texts = value_texts([job.overrides for job in finished],
                        policy_keys + ([x_key] if x_key else []))
    policies: dict[str, list[Job]] = {}
    for job in finished:
        policies.setdefault(policy_label(job.overrides, policy_keys, texts), []).append(job)
    numeric_x = x_key is not None and is_numeric_key(finished, x_key)

    # Up to three panels in a row, then a second row.
    num_columns = len(metrics) if len(metrics) <= 3 else math.ceil(len(metrics) / 2)
    num_rows = math.ceil(len(metrics) / num_columns)
    figure, axes = plt.subplots(num_rows, num_columns, squeeze=False, layout="constrained",
                                figsize=(4.4 * num_columns, 3.4 * num_rows + 0.6))
    styles = policy_styles(policies, policy_keys)
    for ax, metric in zip(axes.flat, metrics):
        if numeric_x:
            plot_lines(ax, policies, styles, x_key, metric)
        else:
            plot_bars(ax, policies, styles, [x_value(job, x_key, texts) for job in finished],
                      x_key, metric, texts)
        ax.set_title(metric_label(metric), fontsize=10)
        ax.set_xlabel(x_key or "job")
        ax.grid(True, alpha=0.3)
        values = [job.metric(metric) for job in finished if job.metric(metric) is not None]
        # Latencies of an overloaded policy can be 100x another's: log y keeps both readable.
        if values and min(values) > 0 and max(values) / min(values) > 50:
            ax.set_yscale("log")
        elif values and min(values) >= 0:
            ax.set_ylim(bottom=0)
    for ax in axes.flat[len(metrics):]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if labels:
        # As many legend columns as the figure's width holds (~0.07 in per character at size 8).
        label_width_in = 0.8 + 0.07 * max(len(label) for label in labels)
        num_columns = max(1, min(len(labels), int(figure.get_figwidth() / label_width_in)))
        figure.legend(handles, labels, loc="outside lower center", ncol=num_columns,
                      fontsize=8, frameon=False)
    if title:
        figure.suptitle(title)
    figure.savefig(path, dpi=80)
    plt.close(figure)
    return path


def plot_lines(ax, policies: dict[str, list[Job]], styles: dict[str, dict], x_key: str,
               metric: str) -> None:
    xs = sorted({as_number(job.values[x_key]) for members in policies.values()
                 for job in members})
    for label, members in policies.items():
        points = sorted((as_number(job.values[x_key]), job.metric(metric))
                        for job in members if job.metric(metric) is not None)
        ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=label,
                **styles[label])
    # Block sizes double from point to point: a log2 axis spaces them evenly.
    if xs[0] > 0 and xs[-1] / xs[0] >= 16:
        ax.set_xscale("log", base=2)
    if len(xs) <= 12:
        ax.set_xticks(xs, [f"{x:g}" for x in xs])


def plot_bars(ax, policies: dict[str, list[Job]], styles: dict[str, dict],
              categories: list[str], x_key: str | None, metric: str,
              texts: dict[str, dict[str, str]]) -> None:
    categories = list(dict.fromkeys(categories))
    width = 0.8 / len(policies)
    for index, (label, members) in enumerate(policies.items()):
        heights = {x_value(job, x_key, texts): job.metric(metric) for job in members
                   if job.metric(metric) is not None}
        offset = (index - (len(policies) - 1) / 2) * width
        ax.bar([position + offset for position, category in enumerate(categories)
                if category in heights],
               [heights[category] for category in categories if category in heights],
               width=width, label=label, color=styles[label]["color"])
    rotate = len(categories) > 4
    ax.set_xticks(range(len(categories)), categories, rotation=30 if rotate else 0,
                  ha="right" if rotate else "center")


def report_table(jobs: list[Job], x_key: str | None, metrics: list[str]) -> Table:
    """The terminal view: each job's varying overrides, completed count and the metrics."""
    shown_keys = varying_keys(jobs)
    headings = short_names(shown_keys)
    texts = value_texts([job.overrides for job in jobs], shown_keys)
    table = Table(title="sweep report", title_justify="left")
    table.add_column("job")
    # fold, not ellipsis: a narrow terminal wraps names instead of cutting them.
    for key in shown_keys:
        table.add_column(headings[key], style="bold" if key == x_key else None, overflow="fold")
    table.add_column("done", justify="right")
    for metric in metrics:
        table.add_column(metric_heading(metric), justify="right", overflow="fold")
    for job in jobs:
        values = [texts[key].get(job.overrides[key], "") if key in job.overrides else ""
                  for key in shown_keys]
        if job.summary is None:
            table.add_row(job.name, *values, Text(job.status, style="red"),
                          *("" for _ in metrics))
            continue
        table.add_row(job.name, *values,
                      f"{job.summary.get('completed', '')}",
                      *(format_value(job.metric(metric)) for metric in metrics))
    return table


def report_console() -> Console:
    """The terminal's width on a terminal; 160 columns when piped into a log, where rich would
    otherwise assume 80 and fold every column."""
    console = Console()
    return console if console.is_terminal else Console(width=160)


def class_metrics(jobs: list[Job]) -> list[str]:
    """A sweep whose runs have request classes (per_tenant / per_priority): each class's p99
    TTFT, and its SLO attainment where the runs have SLOs."""
    keys = {key for job in jobs if job.summary is not None for key in job.summary
            if key.startswith(("per_tenant.", "per_priority."))
            and key.endswith((".p99_ttft_ms", ".slo_attainment"))}
    return sorted(keys, key=natural_key)


def write_report(sweep_dir: str | Path, x_key: str | None = None, out_dir: str | Path | None = None,
                 metrics: Sequence[str] | None = None, title: str | None = None,
                 plot_name: str | None = None, console: Console | None = None) -> Path:
    """Write report.csv and the comparison PNG of `metrics` for `sweep_dir` into `out_dir`
    (default: the sweep folder); returns the path of report.csv."""
    sweep_dir = Path(sweep_dir)
    jobs = load_jobs(sweep_dir)
    x_key = choose_x_key(jobs, x_key)
    metrics = check_metrics(jobs, [str(metric) for metric in metrics or ()]
                            or default_metrics(jobs))
    out_dir = Path(out_dir) if out_dir is not None else sweep_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path = write_csv(jobs, out_dir / REPORT_CSV)
    if any(job.single_run for job in jobs):   # outputs/: the runs, each with its overrides
        if console is not None:
            console.print(runs_table(jobs, metrics))
            console.print(f"{sweep_dir}: {RUNS_NOTE}; report: {csv_path}")
        return csv_path
    written = [csv_path]
    if any(job.summary is not None for job in jobs):
        written.append(plot_comparison(jobs, x_key, metrics,
                                       out_dir / (plot_name or default_plot_name(x_key)), title))
        per_class = class_metrics(jobs)
        if per_class:
            written.append(plot_comparison(jobs, x_key, per_class, out_dir / PER_CLASS_PLOT,
                                           "p99 TTFT and SLO attainment by request class"))
    if console is not None:
        console.print(report_table(jobs, x_key, metrics))
        console.print("report: " + ", ".join(str(path) for path in written))
    return csv_path


# ---- command line -------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="twinserve-report",
        description="Table (report.csv) and comparison plot of a twinserve sweep folder.")
    parser.add_argument("sweep_dir", type=Path, help="a Hydra multirun folder")
    parser.add_argument("--x", dest="x_key", default=None,
                        help="override on the x axis (default: workload.rate if it varies, else "
                             "the first numeric override that varies)")
    parser.add_argument("--metrics", default="",
                        help="comma-separated summary keys (or peak_num_seqs, peak_num_running, "
                             "mean_kv_blocks_used), one panel each; default: "
                             f"{','.join(DEFAULT_METRICS)}, and {DEFAULT_ENERGY_METRIC} where "
                             "the runs report energy")
    parser.add_argument("--title", default=None, help="figure title")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for report.csv and the plot (default: the sweep folder)")
    args = parser.parse_args(argv)
    metrics = [metric.strip() for metric in args.metrics.split(",") if metric.strip()]
    try:
        write_report(args.sweep_dir, x_key=args.x_key, out_dir=args.out, metrics=metrics,
                     title=args.title, console=report_console())
    except ReportError as error:
        print(f"twinserve-report: error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
