"""`twinserve-report` on a folder of single runs (`outputs/`): a table of the runs, each with its
own overrides, since a sweep's columns and figure make sense only of one grid of overrides."""
from __future__ import annotations

from pathlib import Path

import yaml
from rich.table import Table
from rich.text import Text

from sim.tools.report_labels import format_value, metric_heading

HYDRA_FILE = Path(".hydra") / "hydra.yaml"
# What the report says about a folder of single runs, after its table.
RUNS_NOTE = ("single runs (twinserve without -m), not a sweep: no comparison figure; pass a "
             "multirun/<date>/<time> folder (twinserve -m ...) for one")


def is_single_run(job_dir: Path) -> bool:
    """Whether Hydra wrote `job_dir` for a single run (its hydra.yaml's hydra.mode is RUN), not
    for a sweep's job; a folder without hydra.yaml counts as a sweep's."""
    hydra_file = Path(job_dir) / HYDRA_FILE
    if not hydra_file.is_file():
        return False
    try:
        hydra = (yaml.safe_load(hydra_file.read_text()) or {}).get("hydra") or {}
    except (yaml.YAMLError, AttributeError):
        return False
    return str(hydra.get("mode")) == "RUN"


def runs_table(jobs: list, metrics: list[str]) -> Table:
    """One row per run (a sweep report's Job): its folder, its overrides as one column, the
    completed count and the metrics."""
    table = Table(title="runs (not a sweep)", title_justify="left")
    table.add_column("run")
    table.add_column("overrides", overflow="fold", max_width=60)
    table.add_column("done", justify="right")
    for metric in metrics:
        table.add_column(metric_heading(metric), justify="right", overflow="fold")
    for job in jobs:
        overrides = " ".join(f"{key}={value}" for key, value in job.overrides.items()) or "-"
        if job.summary is None:
            table.add_row(job.name, overrides, Text(job.status, style="red"),
                          *("" for _ in metrics))
            continue
        table.add_row(job.name, overrides, f"{job.summary.get('completed', '')}",
                      *(format_value(job.metric(metric)) for metric in metrics))
    return table
