"""Resuming an interrupted sweep: `twinserve -m resume=true hydra.sweep.dir=<its folder> ...` with
the sweep's own overrides skips every job whose folder holds a complete run and reruns the rest.

A job is complete when its folder has COMPLETE_FILE, written last and naming the job's overrides,
so that a folder another sweep filled is never taken for this one's (its Hydra files, which Hydra
rewrites first, are then put back). The skip happens in the job itself, so that it works with
every launcher and keeps Hydra's job numbers.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from sim.tools.loggers import simulated_overrides
from sim.tools.run_outputs import atomic_file

COMPLETE_FILE = "complete.json"


def clear_complete(out_dir: Path) -> None:
    """Forget that `out_dir` held a complete run, before a run overwrites its files."""
    (Path(out_dir) / COMPLETE_FILE).unlink(missing_ok=True)


def mark_complete(out_dir: Path, overrides: Iterable[str], hydra_dir: Path | None) -> None:
    """Record that `out_dir` holds the complete run of `overrides`, with the Hydra files in
    `hydra_dir` (None: Hydra writes none)."""
    hydra_files = {} if hydra_dir is None else {
        path.name: path.read_text() for path in sorted(Path(hydra_dir).glob("*.yaml"))}
    with atomic_file(Path(out_dir) / COMPLETE_FILE) as file:
        json.dump({"overrides": simulated_overrides(overrides), "hydra_files": hydra_files},
                  file, indent=2)
        file.write("\n")


def complete_summary(out_dir: Path, overrides: Iterable[str],
                     hydra_dir: Path | None) -> dict | None:
    """The summary of the complete run of `overrides` in `out_dir`, or None; ValueError when it
    holds a complete run of other overrides (after putting that run's Hydra files back)."""
    out_dir = Path(out_dir)
    try:
        done = json.loads((out_dir / COMPLETE_FILE).read_text())
        summary = json.loads((out_dir / "summary.json").read_text())
    except (OSError, ValueError):   # missing or unreadable: not a complete run
        return None
    if not isinstance(done, dict):
        return None
    wanted = simulated_overrides(overrides)
    if done.get("overrides") != wanted:
        if hydra_dir is not None:
            for name, text in done.get("hydra_files", {}).items():
                with atomic_file(Path(hydra_dir) / name) as file:
                    file.write(text)
        raise ValueError(
            f"resume=true: {out_dir} holds a run of {done.get('overrides')}, not of this job's "
            f"{wanted}; resume with the interrupted sweep's own overrides, or give a new "
            f"hydra.sweep.dir")
    return summary
