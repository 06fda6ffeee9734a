"""Replaying measured serving runs (calibration/realrun/, twinserve-validate --real): the
readers, settings to overrides, load stages, per-stage metrics and the replay itself."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from calibration.realrun.readers import read_run
from calibration.realrun.replay import compose_replay_config, replay, simulate
from calibration.realrun.report import stage_rows
from calibration.realrun.run import RealRunError
from calibration.realrun.settings import (match_hardware, match_model, settings_overrides)
from calibration.realrun.stage_metrics import (Latencies, compare_stage, stage_metrics,
                                                   ttft_slope)
from calibration.realrun.stages import detect_boundaries, find_stages
from calibration.validate.cli import main
from calibration.validate.report import format_error, format_value

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "data" / "real-runs" / "llmservingsim"
SMALL = ["model=llama-2-7b", "hardware=a100-80gb", "scheduler=chunked_prefill"]


def write_csv(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


# ---- readers ------------------------------------------------------------------------------------

def test_csv_run_sorted_rebased_and_tpot_from_e2e(tmp_path):
    path = write_csv(tmp_path / "run.csv", [
        {"arrival_s": 12.0, "prompt_len": 10, "output_len": 5, "ttft_s": 0.2, "e2e_s": 1.0},
        {"arrival_s": 10.0, "prompt_len": 20, "output_len": 1, "ttft_s": 0.1, "e2e_s": 0.1},
    ])
    run = read_run(path)
    assert run.arrival_s.tolist() == [0.0, 2.0]
    assert run.prompt_len.tolist() == [20, 10]
    assert run.ttft_s.tolist() == [0.1, 0.2]
    assert np.isnan(run.tpot_s[0])                       # one token: no TPOT
    assert run.tpot_s[1] == pytest.approx((1.0 - 0.2) / 4)
    assert run.engine_settings == {}


def test_csv_run_reads_a_traces_arrival_time_column_too(tmp_path):
    """A trace's `arrival_time` is a --real CSV's `arrival_s` (sim/core/column_aliases.py)."""
    row = {"prompt_len": 10, "output_len": 5, "ttft_s": 0.2, "e2e_s": 1.0}
    run = read_run(write_csv(tmp_path / "trace.csv", [{"arrival_time": 3.0, **row},
                                                      {"arrival_time": 1.0, **row}]))
    assert run.arrival_s.tolist() == [0.0, 2.0]
    agree = write_csv(tmp_path / "agree.csv", [{"arrival_s": 1.0, "arrival_time": "1", **row}])
    assert read_run(agree).num_requests == 1
    disagree = write_csv(tmp_path / "disagree.csv",
                         [{"arrival_s": 1.0, "arrival_time": 1.0, **row},
                          {"arrival_s": 2.0, "arrival_time": 2.5, **row}])
    with pytest.raises(RealRunError, match=r"disagree.csv: line 3: columns arrival_s and "
                                           r"arrival_time are the same column under two names"):
        read_run(disagree)


def test_csv_run_errors_name_the_field(tmp_path):
    row = {"arrival_s": 0.0, "prompt_len": 10, "output_len": 5, "ttft_s": 0.2, "e2e_s": 1.0}
    missing = write_csv(tmp_path / "a.csv", [{k: v for k, v in row.items() if k != "e2e_s"}])
    with pytest.raises(RealRunError, match="missing column 'e2e_s'"):
        read_run(missing)
    bad = write_csv(tmp_path / "b.csv", [{**row, "ttft_s": "soon"}])
    with pytest.raises(RealRunError, match=r"line 2: column 'ttft_s' must be a number"):
        read_run(bad)
    backwards = write_csv(tmp_path / "c.csv", [{**row, "ttft_s": 2.0}])
    with pytest.raises(RealRunError, match="ttft_s=2 and e2e_s=1"):
        read_run(backwards)
    zero = write_csv(tmp_path / "d.csv", [{**row, "output_len": 0}])
    with pytest.raises(RealRunError, match="'output_len' of request 0 must be a whole number"):
        read_run(zero)


def vllm_result(**changes) -> dict:
    result = {"model_id": "meta-llama/Llama-2-7b-hf", "input_lens": [100, 200, 300],
              "output_lens": [3, 2, 4], "ttfts": [0.05, 0.04, 0.0],
              "itls": [[0.01, 0.02], [0.03], []],
              "start_times": [5000.5, 5000.0, 5001.0], "errors": ["", "", "timeout"]}
    result.update(changes)
    return result


def test_vllm_detailed_json(tmp_path):
    path = tmp_path / "vllm.json"
    path.write_text(json.dumps(vllm_result()))
    run = read_run(path)
    assert run.num_requests == 2                          # the failed one left out
    assert run.arrival_s.tolist() == [0.0, 0.5]           # perf_counter times, rebased, sorted
    assert run.prompt_len.tolist() == [200, 100]
    assert run.e2e_s.tolist() == pytest.approx([0.04 + 0.03, 0.05 + 0.03])   # ttft + sum(itls)
    assert run.tpot_s.tolist() == pytest.approx([0.03, 0.015])
    assert run.engine_settings == {"model": "meta-llama/Llama-2-7b-hf"}
    assert "1 failed requests left out" in run.notes[0]


def test_vllm_json_without_start_times_says_how_to_supply_them(tmp_path):
    result = vllm_result()
    del result["start_times"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(result))
    with pytest.raises(RealRunError, match="has no 'start_times'.*arrival_s"):
        read_run(path)
    path.write_text(json.dumps(vllm_result(ttfts=[0.1, 0.2])))
    with pytest.raises(RealRunError, match="field 'ttfts' has 2 values for 3 requests"):
        read_run(path)


def test_twinserve_bench_json(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(vllm_result(
        start_times=[0.0, 1.0, 2.0], e2els=[0.5, 0.6, 0.7], errors=["", "", ""],
        stages=["low", "low", "high"],
        engine_settings={"model": "meta-llama/Llama-3.1-8B", "hardware": "rtx-4090",
                         "num_gpu_blocks": 100})))
    run = read_run(path)
    assert run.e2e_s.tolist() == [0.5, 0.6, 0.7]          # e2els, not ttft + sum(itls)
    assert run.stage_labels == ["low", "low", "high"]
    assert run.engine_settings["num_gpu_blocks"] == 100
    assert run.engine_settings["model"] == "meta-llama/Llama-3.1-8B"   # not model_id
    assert "twinserve-bench" in run.source


def test_a_bench_run_with_deadlines_replays_them_abandoned_requests_included(tmp_path):
    """twinserve-bench's run file keeps each request's timeout_s and which were abandoned (408):
    the replay sends every request with its deadline, the abandoned ones too (they loaded the
    server), and compares latencies over the completed ones."""
    from calibration.realrun.cli import write_replayed_requests
    from calibration.realrun.replay import run_requests
    from sim.tools.bench_run_file import RequestRecord, build_run_file

    records = [RequestRecord(prompt_len=30, expected_output_len=4, start_time=0.0,
                             token_times=[0.1, 0.2, 0.3, 0.4], num_tokens=4, timeout_s=5.0),
               RequestRecord(prompt_len=40, expected_output_len=50, start_time=0.2,
                             timeout_s=0.5, abandoned_time=0.7),
               RequestRecord(prompt_len=20, expected_output_len=3, start_time=0.3,
                             token_times=[0.5, 0.6, 0.7], num_tokens=3)]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(build_run_file(records, 1.0, info={"engine_settings": {}})))
    run = read_run(path)
    assert run.num_requests == 3 and run.output_len.tolist() == [4, 50, 3]
    assert np.isnan(run.ttft_s[1]) and np.isnan(run.e2e_s[1])
    assert any("1 requests abandoned at their timeout_s" in note for note in run.notes)
    assert [r.timeout_s for r in run_requests(run)] == [5.0, 0.5, None]
    assert Latencies.of_run(run).e2e_s[[0, 2]] == pytest.approx([0.4, 0.4])
    assert stage_metrics(Latencies.of_run(run), np.arange(3))["completed"] == 2
    trace = write_replayed_requests(run, tmp_path / "replayed.csv").read_text().splitlines()
    assert trace[0].endswith(",timeout_s") and trace[1].endswith(",5.0")
    assert trace[3].endswith(",")   # (no deadline: an empty cell)
    [stage] = replay(run, ["model=tiny-llama", "hardware=cpu"])["stages"]
    assert stage["real"]["completed"] == 2 and stage["num_requests"] == 3
    completed_row = [row for row in stage_rows(stage) if row[0] == "completed"]
    assert completed_row == [("completed", "2", format_value(stage["sim"]["completed"]),
                              format_error(stage["error_pct"]["completed"]))]


def test_llmservingsim_folder_with_meta(tmp_path):
    folder = tmp_path / "GPU" / "model"
    folder.mkdir(parents=True)
    lines = [{"request_id": "a", "input_toks": 50, "output_toks": 3, "queued_ts": 100.0,
              "first_token_ts": 100.25, "last_token_ts": 100.75},
             {"request_id": "b", "input_toks": 60, "output_toks": 1, "queued_ts": 100.5,
              "first_token_ts": 101.0, "last_token_ts": 101.0}]
    (folder / "vllm_requests.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    (folder / "vllm_meta.json").write_text(json.dumps({
        "vllm_version": "0.19.0", "engine_kwargs": {"model": "m/x", "max_num_seqs": 64},
        "kv_cache": {"num_gpu_blocks": 321, "block_size": 32},
        "hardware": {"device_name": "NVIDIA H100 80GB HBM3"},
        "resolved_config": {"scheduler_config": {"enable_chunked_prefill": False}}}))
    run = read_run(folder)
    assert run.name == "GPU/model"
    assert run.arrival_s.tolist() == [0.0, 0.5]
    assert run.ttft_s.tolist() == [0.25, 0.5]
    assert run.e2e_s.tolist() == [0.75, 0.5]
    assert run.tpot_s[0] == pytest.approx(0.25)
    assert run.engine_settings["num_gpu_blocks"] == 321
    assert run.engine_settings["enable_chunked_prefill"] is False
    assert run.engine_settings["hardware"] == "NVIDIA H100 80GB HBM3"
    del lines[1]["first_token_ts"]
    (folder / "vllm_requests.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    with pytest.raises(RealRunError, match="line 2 lacks field 'first_token_ts'"):
        read_run(folder)


def test_shipped_llmservingsim_run_matches_its_published_summary():
    """LLMServingSim's own validation_summary.txt: vLLM TTFT mean 65456.6 ms, TPOT mean 32.4,
    latency mean 86578.3 (TTFT = first - queued, TPOT = (last - first) / (out - 1))."""
    run = read_run(SHIPPED / "RTX4090" / "Llama-3.1-8B")
    assert run.num_requests == 300
    assert run.ttft_s.mean() * 1000 == pytest.approx(65456.6, abs=0.1)
    assert np.nanmean(run.tpot_s) * 1000 == pytest.approx(32.4, abs=0.05)
    assert run.e2e_s.mean() * 1000 == pytest.approx(86578.3, abs=0.1)
    assert run.engine_settings["num_gpu_blocks"] == 2588


def test_unknown_format_and_missing_folder_file(tmp_path):
    with pytest.raises(RealRunError, match="must hold vllm_requests.jsonl"):
        read_run(tmp_path)
    (tmp_path / "x.txt").write_text("")
    with pytest.raises(RealRunError, match="unknown run format .txt"):
        read_run(tmp_path / "x.txt")


# ---- settings -----------------------------------------------------------------------------------

def test_names_match_conf():
    assert match_model("meta-llama/Llama-3.1-8B") == "llama-3.1-8b"
    assert match_model("/models/Llama-3.1-8B-Instruct") == "llama-3.1-8b"
    assert match_model("Qwen/Qwen3-30B-A3B-Instruct-2507") == "qwen3-30b-a3b"   # release date
    assert match_model("Qwen/Qwen3-235B-A22B") is None
    assert match_hardware("NVIDIA GeForce RTX 4090") == "rtx-4090"
    assert match_hardware("NVIDIA A100-SXM4-80GB") == "a100-80gb"
    assert match_hardware("NVIDIA A100-SXM4-40GB") == "a100-40gb"
    assert match_hardware("NVIDIA H100 80GB HBM3") == "h100-80gb"
    assert match_hardware("RTXPRO6000") == "rtx-pro-6000"
    assert match_hardware("NVIDIA A100 PCIe") is None                    # 40 or 80 GB?
    assert match_hardware("NVIDIA A100 PCIe", 80 * 10**9) == "a100-80gb"
    # twinserve-serve records conf names: they match themselves.
    assert match_model("tiny-llama") == "tiny-llama" and match_hardware("cpu") == "cpu"


def test_settings_become_overrides_and_the_command_line_wins():
    settings = {"model": "meta-llama/Llama-3.1-8B", "hardware": "NVIDIA GeForce RTX 4090",
                "tensor_parallel_size": 2, "max_num_seqs": 128, "max_num_batched_tokens": 2048,
                "block_size": 16, "num_gpu_blocks": 2588, "enable_prefix_caching": True,
                "enable_chunked_prefill": True, "gpu_memory_utilization": 0.9}
    overrides, provenance = settings_overrides(settings, [], "run")
    assert overrides == ["model=llama-3.1-8b", "hardware=rtx-4090", "scheduler=chunked_prefill",
                         "cluster.tensor_parallel_size=2", "scheduler.max_num_seqs=128",
                         "scheduler.max_num_batched_tokens=2048", "kv_cache.block_size=16",
                         "kv_cache.num_blocks=2588", "kv_cache.enable_prefix_caching=true",
                         "gpu_memory_utilization=0.9"]
    assert provenance["num_gpu_blocks"]["source"] == "file: 2588"
    user = ["kv_cache.num_blocks=100", "model=llama-3-8b", "scheduler=continuous"]
    overrides, provenance = settings_overrides(settings, user, "run")
    assert not any(o.startswith(("kv_cache.num_blocks=", "model=", "scheduler="))
                   for o in overrides)
    assert provenance["num_gpu_blocks"]["source"].startswith("command line")
    v1, provenance = settings_overrides({"model": "meta-llama/Llama-3.1-8B", "hardware": "RTX4090",
                                         "vllm_version": "0.19.0"}, [], "run")
    assert "scheduler=chunked_prefill" in v1
    # V1 keeps no blocks back at admission; the conf default (V0's 1 %) stays for other runs.
    assert "kv_cache.watermark=0.0" in v1
    assert provenance["watermark"]["source"] == "vLLM 0.19.0 (V1) default"
    assert not any(o.startswith("kv_cache.watermark") for o in overrides)


def test_missing_or_unknown_required_setting_is_named():
    with pytest.raises(RealRunError, match="run.csv: the run does not record the hardware"):
        settings_overrides({"model": "meta-llama/Llama-3.1-8B"}, [], "run.csv")
    overrides, _ = settings_overrides({"model": "meta-llama/Llama-3.1-8B"},
                                      ["hardware=h100-80gb"], "run.csv")
    assert overrides == ["model=llama-3.1-8b"]
    with pytest.raises(RealRunError, match="model 'acme/unknown-9b' matches no conf/model"):
        settings_overrides({"model": "acme/unknown-9b"}, ["hardware=h100-80gb"], "run.csv")


# ---- stages -------------------------------------------------------------------------------------

def poisson_arrivals(rates_and_counts, seed):
    rng = np.random.default_rng(seed)
    gaps = np.concatenate([rng.exponential(1.0 / rate, count) for rate, count in rates_and_counts])
    return np.cumsum(gaps)


@pytest.mark.parametrize("seed", range(5))
def test_one_rate_is_one_stage(seed):
    arrivals = poisson_arrivals([(10.0, 600)], seed)
    assert detect_boundaries(arrivals) == []


@pytest.mark.parametrize("seed", range(5))
def test_two_rates_are_two_stages(seed):
    arrivals = poisson_arrivals([(5.0, 150), (20.0, 150)], seed)
    stages = find_stages(arrivals)
    assert len(stages) == 2
    assert abs(stages[1].requests[0] - 150) <= 5
    assert stages[0].arrival_rate == pytest.approx(5.0, rel=0.3)
    assert stages[1].arrival_rate == pytest.approx(20.0, rel=0.3)


def test_labelled_stages_in_order_of_first_arrival():
    stages = find_stages(np.arange(5.0), ["b", "a", "b", "a", "c"])
    assert [stage.label for stage in stages] == ["b", "a", "c"]
    assert stages[1].requests.tolist() == [1, 3]


# ---- per-stage metrics --------------------------------------------------------------------------

def test_stage_metrics_by_hand():
    latencies = Latencies(arrival_s=np.array([0.0, 1.0, 2.0, 3.0]),
                          output_len=np.array([2, 3, 1, 5]),
                          ttft_s=np.array([0.1, 0.2, 0.3, 0.4]),
                          tpot_s=np.array([0.01, 0.02, np.nan, 0.04]),
                          e2e_s=np.array([0.2, 0.5, 0.3, 1.0]))
    metrics = stage_metrics(latencies, np.array([1, 2, 3]))
    assert metrics["mean_ttft_ms"] == pytest.approx(300.0)
    assert metrics["median_ttft_ms"] == pytest.approx(300.0)
    assert metrics["p99_ttft_ms"] == pytest.approx(200.0 + 0.99 * 2 * 100.0)
    assert metrics["mean_tpot_ms"] == pytest.approx(30.0)               # NaN left out
    assert metrics["mean_e2el_ms"] == pytest.approx(600.0)
    # window: first arrival 1.0 to last completion 3.0 + 1.0 = 4.0 -> 3 s
    assert metrics["request_throughput"] == pytest.approx(3 / 3.0)
    assert metrics["output_throughput"] == pytest.approx(9 / 3.0)
    assert metrics["ttft_slope"] == pytest.approx(0.1)
    assert metrics["overloaded"] is True


def test_overload_is_growing_ttft_and_disagreement_is_flagged():
    arrival = np.linspace(0.0, 60.0, 200)
    assert ttft_slope(arrival, 0.5 + 0.0 * arrival) == pytest.approx(0.0)
    growing = Latencies(arrival, np.full(200, 4), 0.5 + 0.3 * arrival, np.full(200, 0.02),
                        1.0 + 0.3 * arrival)
    steady = Latencies(arrival, np.full(200, 4), np.full(200, 0.5), np.full(200, 0.02),
                       np.full(200, 1.0))
    everyone = np.arange(200)
    comparison = compare_stage(stage_metrics(growing, everyone), stage_metrics(steady, everyone))
    assert comparison["overloaded"] == {"real": True, "sim": False, "disagree": True}
    assert comparison["error_pct"]["mean_tpot_ms"] == pytest.approx(0.0)
    assert comparison["error_pct"]["mean_ttft_ms"] < -80


# ---- replay -------------------------------------------------------------------------------------

def test_replay_of_the_simulators_own_run_reproduces_it(tmp_path):
    """Simulate a two-rate workload, write its requests as a CSV run, replay: errors ~0."""
    arrivals = poisson_arrivals([(4.0, 60), (40.0, 60)], seed=3)
    rng = np.random.default_rng(4)
    rows = [{"arrival_s": repr(float(t)), "prompt_len": int(p), "output_len": int(o),
             "ttft_s": 0.0, "e2e_s": 0.0}
            for t, p, o in zip(arrivals, rng.integers(50, 800, 120), rng.integers(2, 200, 120))]
    workload = read_run(write_csv(tmp_path / "workload.csv", rows))
    simulated = simulate(workload, compose_replay_config(workload, SMALL))
    for row, request in zip(rows, simulated.requests):
        row["ttft_s"] = repr(request.first_token_time - request.arrival_time)
        row["e2e_s"] = repr(request.finish_time - request.arrival_time)
        row["stage"] = "slow" if request.request_id < 60 else "fast"
    run = read_run(write_csv(tmp_path / "measured.csv", rows))
    result = replay(run, SMALL)
    assert [stage["label"] for stage in result["stages"]] == ["slow", "fast"]
    for stage in result["stages"]:
        for name, error in stage["error_pct"].items():
            assert error == pytest.approx(0.0, abs=1e-6), (stage["label"], name)
    assert result["stages"][1]["real"]["mean_ttft_ms"] > 0


def test_cli_writes_the_report_and_bad_input_exits_2(tmp_path, capsys):
    arrivals = poisson_arrivals([(5.0, 50)], seed=1)
    rows = [{"arrival_s": float(t), "prompt_len": 100, "output_len": 20, "ttft_s": 0.05,
             "e2e_s": 0.5} for t in arrivals]
    path = write_csv(tmp_path / "run.csv", rows)
    out = tmp_path / "out"
    assert main(["--real", str(path), "--out", str(out), *SMALL]) == 0
    report = json.loads((out / "validation.json").read_text())
    stage = report["runs"][0]["stages"][0]
    assert stage["num_requests"] == 50 and set(stage) >= {"real", "sim", "error_pct",
                                                          "overloaded"}
    assert report["runs"][0]["settings"]["model"]["source"] == "command line"
    for name in ("validation.md", "cdfs.png", "replayed_requests.csv"):
        assert (out / name).stat().st_size > 0
    assert main(["--real", str(path), "--out", str(out), "model=llama-2-7b"]) == 2
    assert "the run does not record the hardware" in capsys.readouterr().err


def test_the_report_names_the_cost_model_that_ran(tmp_path):
    """On hardware no GPU measurement covers, the default GPU model falls back to the roofline:
    the report names the roofline, not the config's GPU model."""
    rows = [{"arrival_s": 0.1 * i, "prompt_len": 30, "output_len": 5, "ttft_s": 0.05,
             "e2e_s": 0.5} for i in range(5)]
    run = read_run(write_csv(tmp_path / "run.csv", rows))
    assert replay(run, ["model=tiny-llama", "hardware=cpu"])["cost_model"] == "RooflineCostModel"
    assert replay(run, SMALL)["cost_model"] == "GPUCostModel"


def test_command_line_wins_in_the_composed_config(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(vllm_result(
        start_times=[0.0, 1.0, 2.0], e2els=[0.5, 0.6, 0.7], errors=["", "", ""],
        engine_settings={"model": "meta-llama/Llama-3.1-8B", "hardware": "NVIDIA H100 80GB HBM3",
                         "num_gpu_blocks": 2588, "max_num_seqs": 64})))
    config = compose_replay_config(read_run(path), ["kv_cache.num_blocks=100"])
    assert config.kv_cache.num_blocks == 100                  # the command line's
    assert config.scheduler.max_num_seqs == 64                # the file's
    assert config.model.name == "llama-3.1-8b" and config.hardware.name == "h100-80gb"
