"""What a new user tripped over in twinserve-report: a sweep over `scheduler._target_` (README's
way to name a plug-in) is labelled by class name, and a folder of single runs (`outputs/`) is a
table of the runs, not a garbled sweep table."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import matplotlib.figure
import pytest

from sim.tools.report import main, write_report
from sim.tools.report_labels import short_names, value_texts
from sim.tools.report_runs import RUNS_NOTE, is_single_run

from factories import twinserve

SUMMARY = {"completed": 3, "request_throughput": 1.0, "p99_ttft_ms": 2.0, "p99_tpot_ms": 3.0}
SHORTEST = "my_policies.ShortestPromptFirst"
FCFS = "policies.batching.ContinuousBatchingScheduler"


def write_job(folder: Path, overrides: list[str], summary: dict | None = SUMMARY,
              mode: str | None = None) -> None:
    """A job folder by hand: overrides.yaml, summary.json and, with `mode`, hydra.yaml."""
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if mode is not None:
        (folder / ".hydra" / "hydra.yaml").write_text(f"hydra:\n  mode: {mode}\n")
    if summary is not None:
        (folder / "summary.json").write_text(json.dumps(summary))


@pytest.fixture
def target_sweep(tmp_path) -> Path:
    for job, (target, rate) in enumerate([(SHORTEST, 5), (SHORTEST, 20), (FCFS, 5), (FCFS, 20)]):
        write_job(tmp_path / "sweep" / str(job), [f"scheduler._target_={target}",
                                                  f"workload.rate={rate}"],
                  {**SUMMARY, "request_throughput": float(job + 1)})
    return tmp_path / "sweep"


def test_a_sweep_over_target_has_a_legend_of_class_names(target_sweep, tmp_path, monkeypatch):
    """Matplotlib drops legend labels that start with `_`: `_target_=...` drew no legend."""
    legends = []
    original = matplotlib.figure.Figure.legend

    def record(figure, handles, labels, **kwargs):
        legends.append(list(labels))
        return original(figure, handles, labels, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "legend", record)
    write_report(target_sweep, out_dir=tmp_path / "report")
    assert legends == [["scheduler=ShortestPromptFirst",
                        "scheduler=ContinuousBatchingScheduler"]]
    assert (tmp_path / "report" / "throughput_vs_load.png").is_file()
    # report.csv keeps the overrides as written.
    with open(tmp_path / "report" / "report.csv", newline="") as file:
        assert {row["scheduler._target_"] for row in csv.DictReader(file)} == {SHORTEST, FCFS}


def test_the_table_heads_the_column_by_the_group_and_shows_class_names(target_sweep, capsys):
    main([str(target_sweep)])
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if " job " in line)
    assert "scheduler" in header and "_target_" not in header
    assert "ShortestPromptFirst" in out and SHORTEST not in out


def test_class_names_that_two_paths_share_stay_whole():
    texts = value_texts([{"k": "a.Foo"}, {"k": "b.Foo"}, {"r": "c.Bar"}, {"r": "0.5"}],
                        ["k", "r"])
    assert texts == {"k": {"a.Foo": "a.Foo", "b.Foo": "b.Foo"},
                     "r": {"c.Bar": "Bar", "0.5": "0.5"}}
    assert short_names(["scheduler._target_", "kv_cache.block_size"]) == {
        "scheduler._target_": "scheduler", "kv_cache.block_size": "block_size"}
    # The group itself varies too: both keep their whole names.
    assert short_names(["scheduler", "scheduler._target_"]) == {
        "scheduler": "scheduler", "scheduler._target_": "scheduler._target_"}


def test_a_folder_of_single_runs_is_a_table_of_the_runs(tmp_path, capsys):
    """`twinserve-report outputs`: each run with its own overrides, one column, and a line that
    says what the folder is; no comparison figure across unrelated runs."""
    result = twinserve("workload.num_requests=10", "progress=false", "hydra.run.dir=outputs/a",
                       cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert is_single_run(tmp_path / "outputs" / "a")
    many = [f"kv_cache.block_size={8 * (run + 1)}" if run % 2 else f"workload.rate={run}"
            for run in range(12)]
    for run, override in enumerate(many):
        write_job(tmp_path / "outputs" / f"r{run}", ["workload.num_requests=10", override,
                                                     f"seed={run}"], mode="RUN")
    write_job(tmp_path / "outputs" / "broken", ["scheduler=static"], summary=None, mode="RUN")
    main([str(tmp_path / "outputs")])
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("runs (not a sweep)")
    assert RUNS_NOTE.split(":")[0] in out.replace("\n", "")
    rows = [line for line in lines if line.startswith("│ ")]
    # One row per run (two lines at most, the overrides folding), the failed one marked.
    assert len(rows) <= 2 * 14 and sum(" r" in row[:6] or " a " in row[:6] for row in rows) == 13
    assert any("broken" in row and "no summary.json" in row for row in rows)
    assert "workload.rate=4 seed=4" in out
    assert not list((tmp_path / "outputs").glob("*.png"))


def test_a_sweep_folder_is_still_a_sweep(tmp_path):
    write_job(tmp_path / "0", ["workload.rate=5"], mode="MULTIRUN")
    write_job(tmp_path / "1", ["workload.rate=10"], mode="MULTIRUN")
    write_report(tmp_path)
    assert not is_single_run(tmp_path / "0")
    assert (tmp_path / "throughput_vs_load.png").is_file()
