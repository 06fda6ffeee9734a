"""Where a run's results go besides its folder: `logger=none` or `logger=wandb`, which reads
what it logs from the files the job wrote, so that it needs nothing from the simulator's objects.
"""
from __future__ import annotations

import csv
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from runtime.metrics import STEP_COLUMNS

# A wandb chart stays responsive up to a few thousand points; a long run has 100k+ steps.
MAX_SERIES_POINTS = 5000
# A wandb.Table past ~10k rows is slow to upload and to browse; requests.csv has them all.
MAX_TABLE_ROWS = 10_000

# Step series logged against simulated time, downsampled: levels to each bucket's peak (so that
# the KV-blocks curve keeps its maximum), events summed (so that they add up to the run's total).
LEVEL_SERIES: tuple[str, ...] = ("kv_blocks_used", "num_seqs", "num_batched_tokens",
                                 "num_waiting", "num_running", "num_swapped")
EVENT_SERIES: tuple[str, ...] = ("num_preempted_recompute", "num_preempted_swap",
                                 "num_blocks_swapped_out", "num_blocks_swapped_in")
TIME_KEY = "sim_time_s"
# Overrides that change how a run is watched or resumed, not what it simulates: left out of the
# run name and of what a resumed sweep compares (sim/tools/resume.py).
NAME_EXCLUDED_KEYS = ("progress", "logger", "resume")


def log_run(cfg: DictConfig, summary: dict, out_dir: Path) -> None:
    name = cfg.logger.name
    if name == "none":
        return
    if name == "wandb":
        log_to_wandb(cfg, summary, out_dir)
        return
    raise ValueError(f"logger must be one of none, wandb; got {name!r}")


# ---- naming: which sweep a run belongs to, and what it varied ----------------------------------

def current_hydra_config() -> DictConfig | None:
    """The running Hydra job's `hydra` node; None when called outside a Hydra app (scripts)."""
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get() if HydraConfig.initialized() else None


def sweep_group(hydra_cfg: DictConfig | None) -> str | None:
    """For a job of a multirun, its sweep folder's last two path parts (the default
    `multirun/<date>/<time>` gives `<date>/<time>`, unique across days); else None."""
    from hydra.types import RunMode

    if hydra_cfg is None or hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    return "/".join(Path(str(hydra_cfg.sweep.dir)).parts[-2:])


def job_name(hydra_cfg: DictConfig | None) -> str | None:
    """The job's command-line overrides, e.g. "scheduler=static,workload.rate=5", less those in
    NAME_EXCLUDED_KEYS; None (wandb picks a name) when there are none."""
    if hydra_cfg is None:
        return None
    return ",".join(simulated_overrides(hydra_cfg.overrides.task)) or None


def simulated_overrides(overrides: Iterable[str]) -> list[str]:
    """The overrides less those whose key (or config group) is in NAME_EXCLUDED_KEYS."""
    kept = []
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key.split(".")[0].split("/")[0] not in NAME_EXCLUDED_KEYS:
            kept.append(override)
    return kept


# ---- what is logged ------------------------------------------------------------------------------

def read_steps(path: Path) -> dict[str, np.ndarray]:
    """steps.csv as {column: float array}, every column of STEP_COLUMNS."""
    table = np.loadtxt(path, delimiter=",", skiprows=1, ndmin=2)
    if table.size == 0:
        table = np.empty((0, len(STEP_COLUMNS)))
    return {column: table[:, index] for index, column in enumerate(STEP_COLUMNS)}


def step_series_rows(steps: dict[str, np.ndarray],
                     max_points: int = MAX_SERIES_POINTS) -> list[dict[str, float]]:
    """The rows to log, {TIME_KEY: start of its bucket, series: value}, at most max_points in all;
    each replica gets its own `replica<id>/` series and an equal share of the points."""
    replica_ids = np.unique(steps["replica_id"]).astype(int)
    points_per_replica = max(1, max_points // max(1, len(replica_ids)))
    rows = []
    for replica_id in replica_ids:
        mine = steps["replica_id"] == replica_id
        prefix = f"replica{replica_id}/" if len(replica_ids) > 1 else ""
        num_steps = int(mine.sum())
        # Consecutive buckets of (nearly) equal size; one step per bucket when the run is short.
        starts = np.unique(np.linspace(0, num_steps, min(num_steps, points_per_replica),
                                       endpoint=False).astype(int))
        series = {TIME_KEY: steps["start_time"][mine][starts]}
        for column in LEVEL_SERIES:
            series[prefix + column] = np.maximum.reduceat(steps[column][mine], starts)
        for column in EVENT_SERIES:
            series[prefix + column] = np.add.reduceat(steps[column][mine], starts)
        keys = list(series)
        rows += [dict(zip(keys, values)) for values in zip(*(series[k].tolist() for k in keys))]
    return rows


def _cell(text: str):
    """A requests.csv cell as int, float, None (empty) or str."""
    if text == "":
        return None
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def read_requests_table(path: Path, max_rows: int = MAX_TABLE_ROWS
                        ) -> tuple[list[str], list[list], int]:
    """(columns, rows, total number of requests) of requests.csv; at most max_rows rows, evenly
    spaced by arrival so a capped table still spans the whole run."""
    with path.open(newline="") as file:
        reader = csv.reader(file)
        columns = next(reader)
        lines = list(reader)
    keep = np.unique(np.linspace(0, len(lines), min(len(lines), max_rows),
                                 endpoint=False).astype(int))
    return columns, [[_cell(text) for text in lines[index]] for index in keep], len(lines)


def log_to_wandb(cfg: DictConfig, summary: dict, out_dir: Path) -> None:
    """One wandb run per job: config, summary, step series, the request table and the plots.
    Offline by default, so that nothing needs a login (`wandb sync` uploads it later); grouped by
    sweep and named after the job's overrides."""
    import wandb

    logger_cfg = cfg.logger
    hydra_cfg = current_hydra_config()
    run = wandb.init(
        project=logger_cfg.project, entity=logger_cfg.entity,
        group=logger_cfg.group or sweep_group(hydra_cfg), name=job_name(hydra_cfg),
        tags=list(logger_cfg.tags), mode=logger_cfg.mode, dir=str(out_dir),
        config=OmegaConf.to_container(cfg, resolve=True),
        # The simulation is over: there is no console output worth recording.
        settings=wandb.Settings(console="off"))
    try:
        steps_path = out_dir / "steps.csv"
        if steps_path.exists():
            rows = step_series_rows(read_steps(steps_path))
            run.define_metric(TIME_KEY)
            for key in sorted({key for row in rows for key in row} - {TIME_KEY}):
                run.define_metric(key, step_metric=TIME_KEY)
            for row in rows:
                run.log(row)

        requests_path = out_dir / "requests.csv"
        if requests_path.exists():
            columns, table_rows, num_requests = read_requests_table(requests_path)
            run.log({"requests": wandb.Table(columns=columns, data=table_rows)})
            if len(table_rows) < num_requests:
                run.summary["requests_table_note"] = (
                    f"{len(table_rows):,} of {num_requests:,} requests, evenly spaced by "
                    f"arrival; all of them are in {requests_path}")

        images = {path.stem: wandb.Image(str(path)) for path in sorted(out_dir.glob("*.png"))}
        if images:
            run.log(images)
        # Last, so that a logged series with the same name cannot shadow a summary value.
        run.summary.update(summary)
    finally:
        run.finish()
