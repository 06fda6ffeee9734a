"""The research workflow around one run: sweeps on the joblib and submitit launchers, the
SLURM/Ray/Optuna presets, and the wandb logger writing a real (offline) run."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import yaml

from sim.tools.loggers import (EVENT_SERIES, LEVEL_SERIES, MAX_SERIES_POINTS, TIME_KEY,
                         read_requests_table, step_series_rows)
from runtime.metrics import STEP_COLUMNS

from factories import twinserve

TINY = ["workload.num_requests=20", "progress=false"]


def job_summaries(sweep_dir: Path) -> dict[tuple[str, ...], dict]:
    """{the job's overrides: its summary.json} for every job folder of a sweep."""
    summaries = {}
    for summary_path in sorted(sweep_dir.glob("*/summary.json")):
        overrides = yaml.safe_load((summary_path.parent / ".hydra" / "overrides.yaml").read_text())
        summaries[tuple(overrides)] = json.loads(summary_path.read_text())
    return summaries


# ---- launchers -----------------------------------------------------------------------------------

def test_joblib_sweep_runs_four_jobs_two_at_a_time(tmp_path):
    result = twinserve("-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
                       "workload.rate=5,20", "kv_cache.block_size=16,32", *TINY,
                       "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    summaries = job_summaries(tmp_path / "sweep")
    assert len(summaries) == 4
    assert all(summary["completed"] == 20 for summary in summaries.values())
    rates = {overrides[0]: summary["request_throughput"]
             for overrides, summary in summaries.items()}
    assert rates["workload.rate=20"] > rates["workload.rate=5"]


def test_submitit_local_sweep(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    result = twinserve("-m", "hydra/launcher=submitit_local", "workload.rate=5,20", *TINY,
                       "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    summaries = job_summaries(tmp_path / "sweep")
    assert len(summaries) == 2
    assert all(summary["completed"] == 20 for summary in summaries.values())


@pytest.mark.parametrize("preset, plugin, expected", [
    ("slurm", "hydra_plugins.hydra_submitit_launcher",
     {"_target_": "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher",
      "cpus_per_task": 1, "partition": "cpu"}),
    ("ray_local", "hydra_plugins.hydra_ray_launcher",
     {"_target_": "hydra_plugins.hydra_ray_launcher.ray_launcher.RayLauncher"}),
])
def test_launcher_presets_compose(tmp_path, preset, plugin, expected):
    """The presets extend the plugins' own configs (running them needs a cluster or Ray)."""
    pytest.importorskip(plugin)
    override = "hydra.launcher.partition=cpu" if preset == "slurm" else "workload.rate=5"
    result = twinserve(f"hydra/launcher={preset}", override, "--cfg", "hydra",
                       "--package", "hydra.launcher", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    launcher = yaml.safe_load(result.stdout.split("\n", 1)[1])  # after "# @package hydra.launcher"
    assert expected.items() <= launcher.items()


def test_optuna_preset_tunes_over_a_few_trials(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    result = twinserve("-m", "hydra/sweeper=optuna_tune", "hydra.sweeper.n_trials=2",
                       "scheduler.max_num_seqs=int(tag(log, interval(8, 512)))",
                       "kv_cache.block_size=choice(8,16,32)", *TINY,
                       "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    best = yaml.safe_load((tmp_path / "sweep" / "optimization_results.yaml").read_text())
    assert set(best["best_params"]) == {"scheduler.max_num_seqs", "kv_cache.block_size"}
    throughputs = [summary["request_throughput"]
                   for summary in job_summaries(tmp_path / "sweep").values()]
    assert len(throughputs) == 2 and best["best_value"] == pytest.approx(max(throughputs))


# ---- wandb: what is logged -----------------------------------------------------------------------

def fake_steps(num_steps: int, replica_ids=(0,)) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    steps = {column: rng.integers(0, 50, num_steps).astype(float) for column in STEP_COLUMNS}
    steps["replica_id"] = np.resize(np.asarray(replica_ids, dtype=float), num_steps)
    steps["start_time"] = np.arange(num_steps) * 0.01
    return steps


def test_series_are_downsampled_keeping_peaks_and_totals():
    steps = fake_steps(60_000)
    steps["kv_blocks_used"][12_345] = 10_000  # a one-step spike
    rows = step_series_rows(steps)
    assert len(rows) <= MAX_SERIES_POINTS
    times = [row[TIME_KEY] for row in rows]
    assert times == sorted(times) and times[0] == 0.0
    assert max(row["kv_blocks_used"] for row in rows) == 10_000
    for column in EVENT_SERIES:
        assert sum(row[column] for row in rows) == steps[column].sum()
    assert set(rows[0]) == {TIME_KEY, *LEVEL_SERIES, *EVENT_SERIES}


def test_series_of_several_replicas_are_kept_apart():
    rows = step_series_rows(fake_steps(20_000, replica_ids=(0, 1)))
    assert len(rows) <= MAX_SERIES_POINTS
    assert {key for row in rows for key in row} == {
        TIME_KEY, *(f"replica{r}/{c}" for r in (0, 1) for c in LEVEL_SERIES + EVENT_SERIES)}


def test_short_series_keep_every_step():
    assert len(step_series_rows(fake_steps(123))) == 123


def test_requests_table_is_capped_evenly(tmp_path):
    path = tmp_path / "requests.csv"
    path.write_text("request_id,ttft_ms,rejected_reason\n"
                    + "".join(f"{i},{i / 2},\n" for i in range(25_000)))
    columns, rows, total = read_requests_table(path, max_rows=10_000)
    assert columns == ["request_id", "ttft_ms", "rejected_reason"] and total == 25_000
    assert len(rows) == 10_000 and rows[0] == [0, 0.0, None] and rows[-1][0] > 24_990


# ---- wandb: a real offline run -------------------------------------------------------------------

def wandb_records(run_file: Path):
    """The protobuf records of a run's `.wandb` file: LevelDB's log format (32 KiB blocks of
    checksummed chunks) after a 7-byte W&B header. wandb >= 0.19 keeps an offline run's
    summary and config only there; `wandb sync` replays the same records."""
    from wandb.proto import wandb_internal_pb2

    data, block, position, chunks = run_file.read_bytes(), 32 * 1024, 7, []
    assert data[:4] == b":W&B"
    while position + 7 <= len(data):
        space = block - position % block
        _checksum, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if space < 7 or (kind == 0 and length == 0):  # zero padding at a block's end
            position += space
            continue
        chunks.append(data[position + 7:position + 7 + length])
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            yield record


def read_offline_run(run_dir: Path) -> dict:
    """group, name, config and summary of an offline run folder."""
    (run_file,) = run_dir.glob("run-*.wandb")
    run = {"summary": {}, "config": {}, "num_history_rows": 0}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["group"], run["name"] = record.run.run_group, record.run.display_name
            run["config"] = {item.key: json.loads(item.value_json)
                             for item in record.run.config.update}
        elif kind == "summary":
            run["summary"].update({item.key: json.loads(item.value_json)
                                   for item in record.summary.update if item.key})
        elif kind == "history":
            run["num_history_rows"] += 1
    return run


def test_wandb_offline_run_of_a_sweep_job_is_grouped_and_named(tmp_path):
    pytest.importorskip("wandb")
    env = {key: value for key, value in os.environ.items() if not key.startswith("WANDB_")}
    # Everything wandb writes stays in tmp_path; offline and silent: no login, no network.
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(tmp_path),
               WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"),
               WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"),
               WANDB_DATA_DIR=str(tmp_path / "wandb-data"))
    # A sweep of one job: enough to be grouped, and wandb's start-up is the slow part.
    result = twinserve("-m", "logger=wandb", "workload.rate=5", *TINY,
                       "hydra.sweep.dir=sweeps/rates", cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    for job, rate in ((0, 5),):
        job_dir = tmp_path / "sweeps" / "rates" / str(job)
        (run_dir,) = (job_dir / "wandb").glob("offline-run-*")
        run = read_offline_run(run_dir)
        summary = json.loads((job_dir / "summary.json").read_text())
        assert run["group"] == "sweeps/rates"
        assert run["name"] == f"workload.rate={rate},workload.num_requests=20"
        assert run["config"]["workload"]["rate"] == rate
        assert run["config"]["scheduler"]["_target_"].endswith("ContinuousBatchingScheduler")
        for key in ("completed", "mean_ttft_ms", "p99_tpot_ms", "request_throughput",
                    "num_preemptions", "peak_kv_blocks"):
            assert run["summary"][key] == pytest.approx(summary[key]), key
        # One history row per step (a short run), plus the requests table and the plots.
        assert run["num_history_rows"] == summary["num_steps"] + 2
        images = (run_dir / "files" / "media" / "images").glob("*.png")
        assert len(list(images)) == 4   # latency_cdf, kv_blocks, batch_size and power
