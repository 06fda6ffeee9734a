"""Resuming an interrupted sweep (`resume=true`, sim/tools/resume.py): complete jobs are skipped,
missing and partial ones rerun, on the basic and the joblib launchers; results are written whole
or not at all."""
from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from sim.tools.report import write_report
from sim.tools.resume import COMPLETE_FILE, complete_summary, mark_complete
from sim.tools.run_outputs import atomic_file, write_run_outputs

from factories import make_cfg, twinserve

TINY = ["workload.num_requests=20", "progress=false", "hydra.sweep.dir=sweep"]
OUTPUT_FILES = ("summary.json", "requests.csv", "steps.csv", "latency_cdf.png")


def file_identities(job_dir: Path) -> dict[str, tuple[int, int]]:
    """{output file: (inode, mtime)}: a file written again (atomically: a new inode) changes."""
    return {name: ((job_dir / name).stat().st_ino, (job_dir / name).stat().st_mtime_ns)
            for name in OUTPUT_FILES}


def test_atomic_file_killed_mid_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text("old")
    with pytest.raises(RuntimeError), atomic_file(path) as file:
        file.write("half of the new")
        raise RuntimeError("killed")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]   # no temporary left behind


class StepsLostMidWrite:
    """Metrics whose steps fail while being written, as a run killed at that point would."""

    @property
    def step_rows(self):
        raise RuntimeError("killed while writing steps.csv")


def test_a_run_killed_writing_its_outputs_leaves_no_summary(tmp_path):
    with pytest.raises(RuntimeError):
        write_run_outputs(tmp_path, StepsLostMidWrite(), [], {"completed": 0}, plots=False)
    assert not (tmp_path / "summary.json").exists()


def test_resume_is_off_by_default():
    assert make_cfg().resume is False


def test_a_folder_of_other_overrides_is_refused_and_its_hydra_files_kept(tmp_path):
    hydra_dir = tmp_path / ".hydra"
    hydra_dir.mkdir()
    (hydra_dir / "overrides.yaml").write_text("- workload.rate=5\n")
    (tmp_path / "summary.json").write_text('{"completed": 20}')
    mark_complete(tmp_path, ["workload.rate=5", "progress=false"], hydra_dir)
    # How a run is watched or resumed does not make it another run.
    assert complete_summary(tmp_path, ["workload.rate=5", "resume=true"], hydra_dir) == {
        "completed": 20}
    (hydra_dir / "overrides.yaml").write_text("- workload.rate=7\n")   # as Hydra rewrites it
    with pytest.raises(ValueError, match="hydra.sweep.dir"):
        complete_summary(tmp_path, ["workload.rate=7", "resume=true"], hydra_dir)
    assert (hydra_dir / "overrides.yaml").read_text() == "- workload.rate=5\n"


def test_a_job_that_runs_again_is_not_complete_until_it_finishes(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / COMPLETE_FILE).write_text('{"overrides": []}')   # of an earlier run
    failed = twinserve("hydra.run.dir=run", "workload.rate=-1", "progress=false", cwd=tmp_path)
    assert failed.returncode == 2
    assert not (tmp_path / "run" / COMPLETE_FILE).exists()


@pytest.fixture(scope="module")
def interrupted_sweep(tmp_path_factory) -> Path:
    """A folder holding the sweep of four rates interrupted after its first two jobs, and while
    job 2 was writing: Hydra's files, a summary, half of steps.csv, no complete.json."""
    folder = tmp_path_factory.mktemp("interrupted")
    first = twinserve("-m", "workload.rate=5,10", *TINY, cwd=folder)
    assert first.returncode == 0, first.stderr
    sweep = folder / "sweep"
    shutil.copytree(sweep / "0", sweep / "2")
    (sweep / "2" / COMPLETE_FILE).unlink(missing_ok=True)
    (sweep / "2" / "steps.csv").write_text("time,dura")
    return sweep


@pytest.mark.parametrize("launcher", [["hydra/launcher=basic"],
                                      ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]])
def test_resumed_sweep_runs_only_the_missing_and_partial_jobs(tmp_path, interrupted_sweep,
                                                              launcher):
    sweep = tmp_path / "sweep"
    shutil.copytree(interrupted_sweep, sweep)
    finished = {job: file_identities(sweep / job) for job in ("0", "1")}

    resumed = twinserve("-m", *launcher, "workload.rate=5,10,20,40", "resume=true", *TINY,
                        cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    skipped = [line for line in resumed.stdout.splitlines() if "resume: skipped" in line]
    assert sorted(Path(line.split(", ")[1].split()[0]).name for line in skipped) == ["0", "1"]
    for job in ("0", "1"):
        assert file_identities(sweep / job) == finished[job], job
    for job in ("0", "1", "2", "3"):   # the Hydra files a refused rerun would put back: these
        done = json.loads((sweep / job / COMPLETE_FILE).read_text())
        assert done["hydra_files"]["overrides.yaml"] == (
            sweep / job / ".hydra" / "overrides.yaml").read_text(), job
    for job, rate in (("2", 20), ("3", 40)):
        done = json.loads((sweep / job / COMPLETE_FILE).read_text())
        assert f"workload.rate={rate}" in done["overrides"]
        assert json.loads((sweep / job / "summary.json").read_text())["completed"] == 20
    assert (sweep / "2" / "steps.csv").stat().st_size > 100   # rewritten whole
    throughput = {job: json.loads((sweep / job / "summary.json").read_text())["request_throughput"]
                  for job in ("0", "2")}
    assert throughput["2"] > throughput["0"]   # job 2's own run, not the copy it held

    with open(write_report(sweep)) as file:
        rows = list(csv.DictReader(file))
    assert {(row["job"], row["workload.rate"], row["status"]) for row in rows} == {
        ("0", "5", "ok"), ("1", "10", "ok"), ("2", "20", "ok"), ("3", "40", "ok")}
