"""`twinserve-validate --real RUN... [--out DIR] [overrides...]`: replay measured runs and write
validation.json, validation.md, cdfs.png and replayed_requests.csv (a `workload=trace` file that
reruns the simulation), into DIR/<run name>/ when there are several."""
from __future__ import annotations

import csv
import json
import re
from pathlib import Path

from rich.console import Console

from calibration.realrun.readers import read_run
from calibration.realrun.replay import replay_deadlines, replay_details
from calibration.realrun.report import (markdown_report, plot_cdfs, print_combined,
                                            print_run)
from calibration.realrun.run import RealRun


def is_override(argument: str) -> bool:
    """A Hydra override (key=value, +key=value, ~key) rather than a run's path."""
    return "=" in argument or argument.startswith(("~", "+"))


def write_replayed_requests(run: RealRun, path: Path) -> Path:
    """The run's requests as a plain trace CSV (arrival_time, prompt_len, output_len, and
    timeout_s where the run has deadlines: an empty cell, none)."""
    columns = ["arrival_time", "prompt_len", "output_len"]
    rows = zip(run.arrival_s.tolist(), run.prompt_len.tolist(), run.output_len.tolist())
    if run.timeout_s is not None:
        columns.append("timeout_s")
        rows = ((*row, "" if deadline is None else repr(deadline))
                for row, deadline in zip(rows, replay_deadlines(run)))
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(columns)
        for arrival, *rest in rows:
            writer.writerow([repr(arrival), *rest])
    return path


def _folder_names(runs: list[RealRun]) -> list[str]:
    """A distinct folder name per run (its name with '/' as '_', numbered on a clash)."""
    names, seen = [], {}
    for run in runs:
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", run.name) or "run"
        seen[name] = seen.get(name, 0) + 1
        names.append(name if seen[name] == 1 else f"{name}-{seen[name]}")
    return names


def _write(out_dir: Path, runs: list[dict], command: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "validation.json").write_text(
        json.dumps({"command": command, "runs": runs}, indent=2) + "\n")
    (out_dir / "validation.md").write_text(markdown_report(runs, command))


def validate_real(paths: list[str | Path], out_dir: Path, overrides: list[str],
                  command: str = "twinserve-validate --real",
                  console: Console | None = None) -> list[dict]:
    """Replay every run of `paths` with `overrides`, print and write the report; return the
    runs' replay dicts. Every run is read before any is replayed (bad input fails first)."""
    console = console or Console()
    out_dir = Path(out_dir)
    runs = [read_run(path) for path in paths]
    several = len(runs) > 1
    results = []
    for run, folder in zip(runs, _folder_names(runs)):
        outcome = replay_details(run, overrides)
        run_dir = out_dir / folder if several else out_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        write_replayed_requests(run, run_dir / "replayed_requests.csv")
        plot_cdfs(outcome.result, outcome.real, outcome.sim, outcome.stage_requests,
                  run_dir / "cdfs.png")
        if several:
            _write(run_dir, [outcome.result], command)
        print_run(outcome.result, console)
        results.append(outcome.result)
    if several:
        print_combined(results, console)
    _write(out_dir, results, command)
    return results
