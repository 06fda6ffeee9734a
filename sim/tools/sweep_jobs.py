"""A Hydra sweep folder's jobs, read for the sweep reports: each job's overrides (parsed with
Hydra's grammar), its summary.json (nested maps as dotted keys) and three figures from its
steps.csv; which overrides vary, and which one is the x axis. A job without summary.json is
kept, its status saying why.
"""
from __future__ import annotations

import csv
import json
import math
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from sim.tools.report_runs import is_single_run

DEFAULT_X_KEY = "workload.rate"

# Figures summary.json does not hold, computed from each job's steps.csv.
STEP_METRICS: tuple[str, ...] = ("peak_num_seqs", "peak_num_running", "mean_kv_blocks_used")


class ReportError(ValueError):
    """Bad input to the report: the message is the one line the user sees."""


@dataclass
class Job:
    """One job folder of a sweep and what it left behind."""
    name: str                                   # folder relative to the sweep folder
    overrides: dict[str, str]                   # key -> value as written in the override
    values: dict[str, Any]                      # key -> parsed value (int, float, str, dict...)
    status: str = "ok"                          # or why there is no summary
    summary: dict | None = None
    step_metrics: dict[str, float] = field(default_factory=dict)
    single_run: bool = False                    # Hydra wrote it for `twinserve` without -m

    def metric(self, key: str) -> Any:
        if self.summary is not None and key in self.summary:
            return self.summary[key]
        return self.step_metrics.get(key)


# ---- reading a sweep ----------------------------------------------------------------------------

def natural_key(text: str) -> list:
    """Sort "2" before "10" (Hydra numbers its job folders 0, 1, ..., 10, ...)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def parse_overrides(lines: list[str], source: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """Keys and values of Hydra override strings (`scheduler=static`, `+experiment=x`,
    `++workload.prompt_len={dist: fixed, value: 512}`), parsed with Hydra's own grammar."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides([str(line) for line in lines])
    except HydraException as error:
        raise ReportError(f"{source}: cannot parse the overrides: {error}") from None
    as_text, as_value = {}, {}
    for override in parsed:
        key = override.key_or_group
        if override.package:
            key = f"{key}@{override.package}"
        as_text[key] = override.get_value_element_as_str()
        as_value[key] = override.value()
    return as_text, as_value


def step_metrics(steps_csv: Path) -> dict[str, float]:
    """Largest batch, peak running requests and the busy-time mean of KV blocks in use, from a
    job's steps.csv ({} when it has none). With several replicas these are per replica."""
    if not steps_csv.is_file():
        return {}
    with open(steps_csv, newline="") as file:
        header = next(csv.reader(file), [])
    wanted = ("duration", "num_seqs", "num_running", "kv_blocks_used")
    if any(column not in header for column in wanted):
        return {}
    columns = [header.index(column) for column in wanted]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # numpy warns about a header-only file
        steps = np.loadtxt(steps_csv, delimiter=",", skiprows=1, usecols=columns, ndmin=2)
    if steps.shape[0] == 0:
        return {"peak_num_seqs": 0, "peak_num_running": 0, "mean_kv_blocks_used": 0.0}
    duration, num_seqs, num_running, kv_blocks = steps.T
    busy = duration.sum()
    # Weighted by step duration: a long prefill step holds its blocks longer than a decode step.
    mean_blocks = float(np.dot(kv_blocks, duration) / busy) if busy > 0 else float(kv_blocks.mean())
    return {"peak_num_seqs": int(num_seqs.max()), "peak_num_running": int(num_running.max()),
            "mean_kv_blocks_used": mean_blocks}


def flatten_summary(summary: dict, prefix: str = "") -> dict:
    """The summary with nested maps (per_tenant, per_priority) as dotted keys, so that each is a
    report.csv column and a metric to plot."""
    flat = {}
    for key, value in summary.items():
        if isinstance(value, dict):
            flat.update(flatten_summary(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def load_jobs(sweep_dir: Path) -> list[Job]:
    """Every job folder under `sweep_dir` (any depth, so custom `hydra.sweep.subdir`s work)."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.exists():
        raise ReportError(f"sweep folder {sweep_dir} does not exist")
    if not sweep_dir.is_dir():
        raise ReportError(f"{sweep_dir} is not a folder")
    jobs = []
    for overrides_file in sweep_dir.rglob(".hydra/overrides.yaml"):
        job_dir = overrides_file.parent.parent
        try:
            lines = yaml.safe_load(overrides_file.read_text()) or []
        except yaml.YAMLError as error:
            raise ReportError(f"{overrides_file}: not valid YAML ({error})") from None
        if not isinstance(lines, list):
            raise ReportError(f"{overrides_file}: expected a list of overrides")
        overrides, values = parse_overrides(lines, overrides_file)
        job = Job(name=job_dir.relative_to(sweep_dir).as_posix(), overrides=overrides,
                  values=values, single_run=is_single_run(job_dir))
        summary_file = job_dir / "summary.json"
        if not summary_file.is_file():
            job.status = "failed (no summary.json)"
        else:
            try:
                job.summary = flatten_summary(json.loads(summary_file.read_text()))
                job.step_metrics = step_metrics(job_dir / "steps.csv")
            except ValueError:
                # A job killed while writing: list it, do not stop the report.
                job.summary, job.status = None, "unreadable summary.json or steps.csv"
        jobs.append(job)
    if not jobs:
        raise ReportError(f"no job folders in {sweep_dir} (a job folder holds "
                          ".hydra/overrides.yaml); is it a Hydra multirun folder?")
    return sorted(jobs, key=lambda job: natural_key(job.name))


# ---- what varies --------------------------------------------------------------------------------

def override_keys(jobs: list[Job]) -> list[str]:
    """Every override key, in the order the jobs first give them."""
    keys: dict[str, None] = {}
    for job in jobs:
        keys.update(dict.fromkeys(job.overrides))
    return list(keys)


def varying_keys(jobs: list[Job]) -> list[str]:
    """Override keys whose value differs between jobs (a key some jobs lack counts as varying)."""
    return [key for key in override_keys(jobs)
            if len({job.overrides.get(key) for job in jobs}) > 1]


def as_number(value: Any) -> float | None:
    """The value as a finite float, or None when it is not one (bools and "inf" are not)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return None
    else:
        return None
    return number if math.isfinite(number) else None


def is_numeric_key(jobs: list[Job], key: str) -> bool:
    return all(as_number(job.values.get(key)) is not None for job in jobs)


def normalise_key(key: str) -> str:
    """`+workload.rate` and `workload.rate` name the same override."""
    return key.lstrip("+~")


def choose_x_key(jobs: list[Job], x_key: str | None) -> str | None:
    """The override on the x axis: the one asked for, else workload.rate if it varies, else the
    first varying numeric override, else the first varying one, else None."""
    keys = override_keys(jobs)
    if x_key is not None:
        x_key = normalise_key(x_key)
        if x_key not in keys:
            raise ReportError(f"--x {x_key} is not among the sweep's overrides: "
                              f"{', '.join(keys) or '(none)'}")
        return x_key
    varying = varying_keys(jobs)
    if DEFAULT_X_KEY in varying:
        return DEFAULT_X_KEY
    numeric = [key for key in varying if is_numeric_key(jobs, key)]
    if numeric:
        return numeric[0]
    return varying[0] if varying else None
