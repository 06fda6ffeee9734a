"""The sweep report (sim/tools/report.py), its Hydra callback and the experiment presets."""
from __future__ import annotations

import csv
import itertools
import json
import re
import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from sim.tools.report import main, write_report
from sim.tools.sweep_jobs import ReportError, flatten_summary

from factories import twinserve

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
PRESETS = sorted(path.stem for path in (CONF / "experiment").glob("*.yaml"))


def read_report(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """A real 2 schedulers x 2 rates sweep, tiny workloads."""
    cwd = tmp_path_factory.mktemp("sweep")
    result = twinserve("-m", "scheduler=static,continuous", "workload.rate=5,20",
                       "workload.num_requests=30", "progress=false", "hydra.sweep.dir=sweep",
                       cwd=cwd)
    assert result.returncode == 0, result.stderr
    return cwd / "sweep"


def write_job(sweep_dir: Path, name: str, overrides: list[str], summary: dict | None) -> None:
    """A job folder by hand: overrides.yaml and (unless None) summary.json."""
    job = sweep_dir / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {line}\n" for line in overrides))
    if summary is not None:
        (job / "summary.json").write_text(json.dumps(summary))


# ---- the report on a real sweep -----------------------------------------------------------------

def test_report_has_a_row_per_job_with_its_overrides_and_summary(sweep, tmp_path):
    csv_path = write_report(sweep, out_dir=tmp_path)
    rows = read_report(csv_path)
    assert [row["job"] for row in rows] == ["0", "1", "2", "3"]
    for row in rows:
        summary = json.loads((sweep / row["job"] / "summary.json").read_text())
        assert row["status"] == "ok"
        for key, value in flatten_summary(summary).items():   # (nested maps: dotted keys)
            if isinstance(value, str):
                assert row[key] == value, key
            else:
                assert float(row[key]) == pytest.approx(value), key
        assert int(row["peak_num_seqs"]) >= 1 and float(row["mean_kv_blocks_used"]) > 0
    assert {(row["scheduler"], row["workload.rate"]) for row in rows} == {
        ("static", "5"), ("static", "20"), ("continuous", "5"), ("continuous", "20")}
    # Overrides that do not vary still get their column.
    assert {row["workload.num_requests"] for row in rows} == {"30"}
    assert (tmp_path / "throughput_vs_load.png").stat().st_size > 10_000


def test_command_line_writes_into_the_sweep_folder_and_prints_the_table(sweep, capsys):
    main([str(sweep), "--x", "workload.rate"])
    out = capsys.readouterr().out
    assert "continuous" in out and "p99 TTFT ms" in out
    assert (sweep / "report.csv").is_file() and (sweep / "throughput_vs_load.png").is_file()


def test_failed_job_is_listed_and_left_out_of_the_plot(sweep, tmp_path):
    copy = tmp_path / "sweep"
    shutil.copytree(sweep, copy)
    (copy / "2" / "summary.json").unlink()
    rows = read_report(write_report(copy, metrics=["request_throughput", "peak_num_seqs"]))
    failed = [row for row in rows if row["status"] != "ok"]
    assert [row["job"] for row in failed] == ["2"]
    assert failed[0]["request_throughput"] == "" and failed[0]["scheduler"] == "continuous"
    assert (copy / "throughput_vs_load.png").is_file()


def test_categorical_x_draws_bars(sweep, tmp_path):
    write_report(sweep, x_key="scheduler", out_dir=tmp_path)
    assert (tmp_path / "metrics_vs_scheduler.png").stat().st_size > 10_000


# ---- choosing x, and bad input ------------------------------------------------------------------

def test_default_x_is_the_rate_else_the_first_numeric_override_that_varies(tmp_path):
    summary = {"request_throughput": 1.0, "p99_ttft_ms": 2.0, "p99_tpot_ms": 3.0}
    for job, (manager, size) in enumerate(itertools.product(["paged", "contiguous"], [8, 16])):
        write_job(tmp_path, str(job), ["workload.rate=5", f"kv_manager={manager}",
                                       f"kv_cache.block_size={size}"], summary)
    write_report(tmp_path)
    assert (tmp_path / "metrics_vs_block_size.png").is_file()


def test_missing_folder_is_one_clear_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "nowhere")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "nowhere" in err and "does not exist" in err


@pytest.mark.parametrize("make, kwargs, message", [
    (lambda path: None, {}, "no job folders"),
    (lambda path: write_job(path, "0", ["scheduler=static"], {"request_throughput": 1.0}),
     {"x_key": "workload.rate"}, "--x workload.rate is not among the sweep's overrides: scheduler"),
    (lambda path: write_job(path, "0", ["scheduler=static"], {"request_throughput": 1.0}),
     {"metrics": ["goodput"]}, "metric 'goodput' is in no job's summary"),
])
def test_bad_input_names_what_is_wrong(tmp_path, make, kwargs, message):
    make(tmp_path)
    with pytest.raises(ReportError, match=re.escape(message)):
        write_report(tmp_path, **kwargs)


# ---- the experiment presets ---------------------------------------------------------------------

@pytest.mark.parametrize("preset", PRESETS)
def test_every_job_of_every_preset_composes(preset):
    assert {"chunked_prefill", "paged_vs_contiguous", "parallel_sampling", "recompute_vs_swap",
            "static_vs_continuous"} <= set(PRESETS)
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        hydra_cfg = compose("config", overrides=[f"+experiment={preset}"],
                            return_hydra_config=True).hydra
        assert hydra_cfg.mode.name == "MULTIRUN"
        assert hydra_cfg.callbacks.report._target_ == "sim.tools.callbacks.ReportCallback"
        # Every value of every swept key at least once (the whole grid takes too long to compose).
        choices = [[f"{key}={value}" for value in str(values).split(",")]
                   for key, values in hydra_cfg.sweeper.params.items()]
        for index in range(max(len(values) for values in choices)):
            overrides = [values[index % len(values)] for values in choices]
            cfg = compose("config", overrides=[f"+experiment={preset}", *overrides])
            resolved = OmegaConf.to_container(cfg, resolve=True)
            assert resolved["kv_cache"]["_target_"] and resolved["scheduler"]["_target_"]


def test_preset_runs_end_to_end_and_the_callback_writes_the_report(tmp_path):
    # No -m: the preset's hydra.mode makes it a sweep. block_size=16 narrows it to 3 jobs.
    result = twinserve("+experiment=paged_vs_contiguous", "block_size=16",
                       "workload.num_requests=20", "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    sweep_dir = tmp_path / "sweep"
    rows = read_report(sweep_dir / "report.csv")
    assert [row["kv_manager"] for row in rows] == ["paged", "contiguous_max",
                                                   "contiguous_oracle"]
    assert all(row["completed"] == "20" for row in rows)
    waste = {row["kv_manager"]: float(row["kv_waste_fraction"]) for row in rows}
    assert waste["paged"] < waste["contiguous_oracle"] < waste["contiguous_max"]
    assert (sweep_dir / "metrics_vs_block_size.png").stat().st_size > 10_000
    assert "sweep report" in result.stdout


def test_a_sweep_with_request_classes_gets_a_per_class_figure(tmp_path):
    for job, (rate, ttft_0, ttft_1) in enumerate([(5, 200.0, 300.0), (10, 250.0, 900.0)]):
        write_job(tmp_path, str(job), [f"workload.rate={rate}"], {
            "completed": 10, "request_throughput": rate / 2, "p99_ttft_ms": ttft_1,
            "p99_tpot_ms": 20.0,
            "per_priority": {"0": {"p99_ttft_ms": ttft_0, "slo_attainment": 1.0},
                             "1": {"p99_ttft_ms": ttft_1, "slo_attainment": 0.5}}})
    write_report(tmp_path)
    assert (tmp_path / "per_class.png").stat().st_size > 10_000
    row = read_report(tmp_path / "report.csv")[1]
    assert float(row["per_priority.1.p99_ttft_ms"]) == 900.0
    # Without classes, no such figure.
    plain = tmp_path / "plain"
    write_job(plain, "0", ["workload.rate=5"], {"completed": 10, "request_throughput": 2.5,
                                                 "p99_ttft_ms": 1.0, "p99_tpot_ms": 1.0})
    write_report(plain)
    assert not (plain / "per_class.png").exists()
