"""Energy at equal SLO attainment for a sweep of policies over load (`+experiment=energy`).

    python -m sim.tools.report_energy SWEEP [--slo-attainment 0.9]

Tokens per joule at one request rate favour whichever policy is nearer saturation, so each policy
is compared at the highest swept rate where it still meets the SLO target. Writes
energy_at_slo.csv and energy_vs_slo.png into the sweep folder.
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from rich.table import Table

from policies.validators import number_in
from sim.tools.report import report_console
from sim.tools.report_labels import format_value, policy_label, value_texts
from sim.tools.sweep_jobs import (DEFAULT_X_KEY, Job, ReportError, as_number, load_jobs,
                                  varying_keys)

ENERGY_CSV = "energy_at_slo.csv"
ENERGY_PLOT = "energy_vs_slo.png"
ENERGY_COLUMNS = ("slo_attainment", "output_throughput", "tokens_per_joule",
                  "joules_per_output_token", "avg_power_w")
DEFAULT_TARGET = 0.9


def policies_by_label(jobs: list[Job], x_key: str) -> dict[str, list[Job]]:
    """The finished jobs grouped by policy (every varying override but `x_key`), each group in
    order of x."""
    finished = [job for job in jobs if job.summary is not None]
    missing = [job.name for job in finished if "tokens_per_joule" not in job.summary
               or "slo_attainment" not in job.summary]
    if missing:
        raise ReportError(f"{missing[0]}: summary.json has no tokens_per_joule or "
                          f"slo_attainment (set an slo.*_ms; run with this version)")
    policy_keys = [key for key in varying_keys(finished) if key != x_key]
    texts = value_texts([job.overrides for job in finished], policy_keys)
    policies: dict[str, list[Job]] = {}
    for job in finished:
        if as_number(job.values.get(x_key)) is None:
            raise ReportError(f"{job.name}: {x_key} is not a number in its overrides")
        policies.setdefault(policy_label(job.overrides, policy_keys, texts), []).append(job)
    for members in policies.values():
        members.sort(key=lambda job: as_number(job.values[x_key]))
    return policies


def energy_at_slo(policies: dict[str, list[Job]], x_key: str,
                  target: float) -> dict[str, dict[str, Any]]:
    """Per policy: the highest x at which its SLO attainment is at least `target` and the
    ENERGY_COLUMNS there; {} for a policy that met it at no swept x."""
    rows = {}
    for label, members in policies.items():
        meeting = [job for job in members if job.summary["slo_attainment"] >= target]
        if not meeting:
            rows[label] = {}
            continue
        best = meeting[-1]
        rows[label] = {x_key: as_number(best.values[x_key]),
                       **{column: best.summary[column] for column in ENERGY_COLUMNS}}
    return rows


def plot_energy(policies: dict[str, list[Job]], rows: dict[str, dict[str, Any]], x_key: str,
                target: float, path: Path, title: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (curve, bars) = plt.subplots(1, 2, layout="constrained", figsize=(10, 4))
    for index, (label, members) in enumerate(policies.items()):
        curve.plot([job.summary["slo_attainment"] for job in members],
                   [job.summary["tokens_per_joule"] for job in members], marker="o",
                   color=f"C{index % 10}", label=label)
    curve.axvline(target, color="grey", linestyle="--", linewidth=1)
    curve.set_xlabel("SLO attainment (a point per request rate)")
    curve.set_ylabel("output tokens per joule (modelled)")
    curve.grid(True, alpha=0.3)
    curve.legend(fontsize=8, frameon=False)
    labels = list(policies)
    heights = [rows[label].get("tokens_per_joule", 0.0) for label in labels]
    drawn = bars.bar(range(len(labels)), heights,
                     color=[f"C{index % 10}" for index in range(len(labels))])
    for bar, label in zip(drawn, labels):
        rate = rows[label].get(x_key)
        if rate is None:
            at = "none met"
        else:
            at = f"{rate:g} req/s" if x_key == DEFAULT_X_KEY else f"{x_key}={rate:g}"
            at += f"\n{bar.get_height():.2f} tok/J"
        bars.annotate(at,
                      (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                      ha="center", va="bottom", fontsize=8)
    bars.set_ylim(top=1.3 * max(heights + [1e-9]))   # room for the labels above the bars
    bars.set_xticks(range(len(labels)), labels, rotation=20, ha="right")
    bars.set_ylabel("output tokens per joule")
    bars.set_title(f"at each policy's highest {x_key} with SLO attainment >= {target:g}",
                   fontsize=9)
    bars.grid(True, axis="y", alpha=0.3)
    if title:
        figure.suptitle(title)
    figure.savefig(path, dpi=80)
    plt.close(figure)
    return path


def write_energy_report(sweep_dir: str | Path, target: float = DEFAULT_TARGET,
                        x_key: str = DEFAULT_X_KEY, title: str | None = None,
                        console=None) -> Path:
    """Write energy_at_slo.csv and energy_vs_slo.png into `sweep_dir`; print the table to
    `console` when given. Returns the CSV's path."""
    number_in("--slo-attainment", target, 0, 1)
    sweep_dir = Path(sweep_dir)
    policies = policies_by_label(load_jobs(sweep_dir), x_key)
    if not policies:
        raise ReportError(f"{sweep_dir}: no finished job")
    rows = energy_at_slo(policies, x_key, target)
    csv_path = sweep_dir / ENERGY_CSV
    with csv_path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["policy", x_key, *ENERGY_COLUMNS])
        for label, row in rows.items():
            writer.writerow([label, row.get(x_key, ""), *(row.get(c, "") for c in ENERGY_COLUMNS)])
    plot_path = plot_energy(policies, rows, x_key, target, sweep_dir / ENERGY_PLOT, title)
    if console is not None:
        table = Table(title=f"energy at SLO attainment >= {target:g} (modelled)",
                      title_justify="left")
        for heading in ("policy", f"max {x_key}", *ENERGY_COLUMNS):
            table.add_column(heading, justify="left" if heading == "policy" else "right")
        for label, row in rows.items():
            table.add_row(label, format_value(row.get(x_key)),
                          *(format_value(row.get(column)) for column in ENERGY_COLUMNS))
        console.print(table)
        console.print(f"energy report: {csv_path}, {plot_path}")
    return csv_path


class EnergyReportCallback(Callback):
    """Runs `write_energy_report` on the sweep folder at the end of a multirun."""

    def __init__(self, slo_attainment: float = DEFAULT_TARGET, x_key: str = DEFAULT_X_KEY,
                 title: str | None = None):
        self.target, self.x_key, self.title = slo_attainment, x_key, title

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            write_energy_report(config.hydra.sweep.dir, self.target, self.x_key, self.title,
                                report_console())
        except (ReportError, ValueError) as error:
            print(f"twinserve energy report: error: {error}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m sim.tools.report_energy",
        description="Tokens per joule at equal SLO attainment for a sweep over load.")
    parser.add_argument("sweep_dir", type=Path, help="a Hydra multirun folder")
    parser.add_argument("--slo-attainment", type=float, default=DEFAULT_TARGET,
                        help="the SLO attainment each policy must keep (default %(default)s)")
    parser.add_argument("--x", dest="x_key", default=DEFAULT_X_KEY,
                        help="the load override (default %(default)s)")
    parser.add_argument("--title", default=None, help="figure title")
    args = parser.parse_args(argv)
    try:
        write_energy_report(args.sweep_dir, args.slo_attainment, args.x_key, args.title,
                            console=report_console())
    except (ReportError, ValueError) as error:
        print(f"python -m sim.tools.report_energy: error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
