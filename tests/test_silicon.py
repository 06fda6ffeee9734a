"""NVIDIA's measured vLLM rows (calibration/silicon.py) and the closed-loop workload that replays
them (workload=closed_loop): N requests in flight, fixed lengths, nothing lost; the CSV reader,
the row -> overrides mapping and twinserve-validate --silicon."""
from __future__ import annotations

import dataclasses
import json

import pytest

from calibration import silicon, silicon_feasibility
from calibration.validate.cli import main
from factories import make_cfg
from sim.core.experiment import run_experiment
from sim.core.workload import build_session_source

SMALL_LOOP = ["workload=closed_loop", "workload.input_len=48", "workload.output_len=6"]


def closed_loop_run(concurrency: int, num_requests: int, *extra: str):
    cfg = make_cfg(*SMALL_LOOP, f"workload.concurrency={concurrency}",
                   f"workload.num_requests={num_requests}", *extra)
    return run_experiment(cfg, plots=False).requests


@pytest.mark.parametrize("concurrency, num_requests, extra", [
    (4, 17, ()),
    (3, 10, ("scheduler=chunked_prefill", "scheduler.max_num_batched_tokens=64")),
    (5, 3, ()),                                         # fewer requests than clients
    (2, 9, ("++workload.think_time_s={dist: exponential, mean: 0.01}",)),
])
def test_closed_loop_keeps_n_in_flight(concurrency, num_requests, extra):
    requests = closed_loop_run(concurrency, num_requests, *extra)
    assert len(requests) == num_requests
    assert all(r.is_finished and r.rejected_reason is None for r in requests)
    assert {(r.prompt_len, r.num_output_tokens_per_sample) for r in requests} == {(48, 6)}
    no_gap = not extra or not extra[0].startswith("++workload.think_time_s")
    finishes = sorted(r.finish_time for r in requests)
    for request in requests:
        now = request.arrival_time
        in_flight = sum(1 for r in requests if r.arrival_time <= now < r.finish_time)
        remaining = sum(1 for r in requests if r.arrival_time > now)
        assert in_flight <= concurrency
        if no_gap and remaining:
            assert in_flight == concurrency
    if no_gap:   # every request after the first N is sent the moment one finishes
        later = sorted(r.arrival_time for r in requests)[concurrency:]
        assert all(arrival in finishes for arrival in later)


def test_closed_loop_bad_values_name_the_field():
    base = {"kind": "closed_loop", "concurrency": 2, "num_requests": 4, "input_len": 8,
            "output_len": 2}
    for key, value, wanted in [("concurrency", 0, "workload.concurrency must be >= 1"),
                               ("input_len", "x", "workload.input_len must be an integer"),
                               ("num_request", 5, "workload.num_request is not a known field")]:
        with pytest.raises(ValueError, match=wanted) as error:
            build_session_source({**base, key: value}, seed=0)
        assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="workload.output_len is required"):
        build_session_source({k: v for k, v in base.items() if k != "output_len"}, seed=0)


def test_reader_parses_the_shipped_rows():
    rows = silicon.read_silicon_rows()
    assert len(rows) == 1345
    qwen = silicon.select_rows(rows, system="h100_sxm", model="Qwen/Qwen3-32B", precision="bf16")
    assert len(qwen) == 90
    assert {(r.tp_size, r.backend_version) for r in qwen} == {
        (2, "0.12.0"), (4, "0.12.0"), (8, "0.12.0")}
    assert {r.concurrency for r in qwen} == {8, 16, 32, 64, 128}
    assert {(r.isl, r.osl) for r in qwen} == {(i, o) for i in (1024, 4096)
                                              for o in (128, 512, 1024)}
    assert len(silicon.select_rows(rows, mode=None)) == 1345
    assert len(silicon.select_rows(rows, model="Qwen/Qwen3-32B", limit=5)) == 5


@pytest.mark.parametrize("edit, wanted", [
    (lambda text: text.replace(",isl,", ",input_len,", 1), "no column isl"),
    (lambda text: text.replace(",4096,", ",4k,", 1), "column isl: '4k' is not an integer"),
    (lambda text: text.replace("154.2481599", "fast", 1),
     "column silicon_ttft_ms: 'fast' is not a number"),
])
def test_reader_refuses_a_malformed_file_in_one_line(tmp_path, edit, wanted):
    path = tmp_path / "rows.csv"
    path.write_text(edit(silicon.SILICON_CSV.read_text()))
    with pytest.raises(silicon.SiliconDataError, match=wanted) as error:
        silicon.read_silicon_rows(path)
    assert str(error.value).startswith(str(path)) and "\n" not in str(error.value)


def first_qwen_row() -> silicon.SiliconRow:
    return silicon.select_rows(silicon.read_silicon_rows(), system="h100_sxm",
                               model="Qwen/Qwen3-32B", precision="bf16")[0]


def test_a_row_becomes_overrides():
    row = first_qwen_row()
    assert (row.isl, row.osl, row.concurrency, row.tp_size) == (1024, 128, 8, 2)
    assert silicon.silicon_overrides(row, waves=3) == [
        "model=qwen3-32b", "hardware=h100-80gb", "cluster.tensor_parallel_size=2",
        "scheduler=chunked_prefill", "scheduler.max_num_batched_tokens=2532",
        "scheduler.max_num_seqs=8", "workload=closed_loop", "workload.concurrency=8",
        "workload.num_requests=24", "workload.input_len=1024", "workload.output_len=128",
        f"cluster.frontend_latency_s={silicon.CLIENT_ROUND_TRIP_S}",
        "kv_cache.enable_prefix_caching=true", "kv_cache.watermark=0.0",
        "workload.with_token_ids=true", "cost_model.engine_version=0.12.0"]
    # Before V1, vLLM's defaults were the conf's: no prefix cache, 1 % of the blocks kept back.
    v0 = silicon.silicon_overrides(dataclasses.replace(row, backend_version="0.6.3"))
    assert not any(o.startswith(("kv_cache.", "workload.with_token_ids")) for o in v0)
    vllm_serve = silicon.silicon_overrides(row, waves=3, engine_settings="vllm-serve")
    assert "scheduler.max_num_batched_tokens=8192" in vllm_serve
    assert "scheduler.max_num_seqs=1024" in vllm_serve


def test_rows_that_cannot_replay_say_why():
    rows = {row.id: row for row in silicon.read_silicon_rows()}
    reasons = {silicon.skip_reason(row) for row in rows.values()}
    assert "model MiniMaxAI/MiniMax-M2.5 has no conf/model entry" in reasons
    llama = next(row for row in rows.values() if row.model == "meta-llama/Llama-3.1-70B"
                 and row.system == "b200_sxm")
    assert silicon.skip_reason(llama) == "system b200_sxm has no conf/hardware entry"
    fp8 = next(row for row in rows.values() if row.model == "nvidia/Llama-3.1-8B-Instruct-FP8")
    assert silicon.skip_reason(fp8) is None
    assert "model.quantization=fp8" in silicon.silicon_overrides(fp8)
    disagg = next(row for row in rows.values() if row.mode == "disagg")
    assert silicon.skip_reason(disagg).startswith("mode disagg")
    with pytest.raises(silicon.SkippedRow, match="mode disagg"):
        silicon.silicon_overrides(disagg)


def test_predict_row_runs_the_rows_benchmark_and_overrides_win():
    row = first_qwen_row()
    predicted = silicon.predict_row(row, overrides=["workload.num_requests=4"], waves=2)
    assert predicted["num_requests"] == 4
    assert predicted["overrides"][-1] == "workload.num_requests=4"
    assert predicted["sim_ttft_ms"] > 0 and predicted["sim_tpot_ms"] > 0


def test_cli_on_two_rows_prints_the_table_and_summary(tmp_path, capsys):
    out = tmp_path / "silicon.json"
    assert main(["--silicon", "--system", "h100_sxm", "--model", "Qwen/Qwen3-32B",
                 "--precision", "bf16", "--limit", "2", "--waves", "1",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].split()[:5] == ["row", "isl", "osl", "conc", "tp"]
    assert printed[1].startswith(first_qwen_row().id)
    assert printed[3].startswith("2 rows (0 skipped), 1 waves") and "|TPOT error| mean" in printed[3]
    report = json.loads(out.read_text())
    assert [r["concurrency"] for r in report["rows"]] == [8, 8]
    summary = report["summary"]
    errors = [abs(r["ttft_error_pct"]) for r in report["rows"]]
    assert summary["worst_abs_ttft_error_pct"] == max(errors)
    assert summary["mean_abs_ttft_error_pct"] == pytest.approx(sum(errors) / 2)


def test_cli_refuses_bad_arguments_in_one_line(capsys):
    assert main(["--silicon", "--precision", "fp4"]) == 2
    assert main(["--silicon", "--model", "no/such-model"]) == 2
    assert main(["--silicon", "--limit", "0"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["twinserve-validate: error: --precision must be one of bf16, fp8, got 'fp4'",
                     "twinserve-validate: error: no silicon row matches "
                     "--system/--model/--precision",
                     "twinserve-validate: error: --limit must be >= 1, got 0"]


def test_a_rows_implied_tokens_per_second_come_from_its_closed_loop():
    row = dataclasses.replace(first_qwen_row(), concurrency=4, isl=900, osl=101, ttft_ms=500.0,
                              tpot_ms=15.0)
    # Each client sends a request every 0.5 + 100 x 0.015 = 2 s, of 1,001 tokens.
    assert silicon_feasibility.implied_tokens_per_s(row) == pytest.approx(4 / 2.0 * 1001)


def test_latencies_faster_than_the_kernels_can_run_are_named():
    row = first_qwen_row()
    measured = silicon_feasibility.feasibility(row)
    assert 0 < measured["load"] < 1 and not measured["beyond"]
    twenty_times_faster = dataclasses.replace(row, ttft_ms=row.ttft_ms / 20,
                                              tpot_ms=row.tpot_ms / 20)
    impossible = silicon_feasibility.feasibility(twenty_times_faster)
    assert impossible["load"] == pytest.approx(20 * measured["load"]) and impossible["beyond"]
    assert silicon_feasibility.beyond_line([measured]) is None
    assert silicon_feasibility.beyond_line([measured, impossible]).startswith(
        "1 of 2 rows imply more tokens per second than the forward kernels (vLLM 0.14.0 on "
        "h100_sxm) can run")
    assert silicon_feasibility.deployments_beyond_the_kernels([row, twenty_times_faster]) == {
        (row.model, row.system, row.backend_version)}
    assert silicon_feasibility.deployments_beyond_the_kernels([row]) == set()


def test_cli_names_rows_beyond_the_kernels(tmp_path, capsys):
    out = tmp_path / "silicon.json"
    assert main(["--silicon", "--model", "nvidia/Llama-3.1-8B-Instruct-FP8", "--limit", "1",
                 "--waves", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-2].startswith("1 of 1 rows imply more tokens per second than the forward "
                                  "kernels (vLLM 0.14.0 on h200_sxm) can run")
    assert json.loads(out.read_text())["rows"][0]["kernel_load"] > 1
