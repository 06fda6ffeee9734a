"""Metrics: summary arithmetic against numpy on the same numbers, weighted ITL percentiles against
the expanded list, the output files, the plots, and the empty run."""
from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from policies.types import Request, Sequence, SequenceStatus, StepPlan
from runtime.metrics import STEP_COLUMNS, MetricsCollector, StepRecorder, weighted_percentiles
from runtime.metrics.statistics import completed_requests, is_completed, output_tokens
from sim.tools.console_summary import format_summary_table, print_summary
from sim.tools.plots import downsample_indices, write_plots
from sim.tools.run_outputs import REQUEST_COLUMNS, write_run_outputs

LATENCY_KEYS = [f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el")
                for stat in ("mean", "median", "p90", "p99")]
REQUIRED_KEYS = ["completed", "rejected", "duration_s", "request_throughput", "output_throughput",
                 "total_token_throughput", *LATENCY_KEYS, "num_preemptions", "peak_kv_blocks",
                 "kv_waste_fraction", "swap_bytes", "num_steps", "wall_time_s"]


def make_request(request_id, arrival, prompt_len, sample_tokens, first_token=None, finish=None,
                 *, preemptions=0, rejected=None, replica_id=0):
    """A request whose i-th sample generated sample_tokens[i] tokens."""
    request = Request(request_id=request_id, arrival_time=arrival, prompt_len=prompt_len,
                      output_len=max(sample_tokens, default=1), n=max(1, len(sample_tokens)))
    for index, tokens in enumerate(sample_tokens):
        seq = Sequence(request_id * 100 + index, request, num_output_tokens=tokens)
        seq.status = SequenceStatus.FINISHED if finish is not None else SequenceStatus.RUNNING
        request.sequences.append(seq)
    request.replica_id = replica_id
    request.first_scheduled_time = None if first_token is None else arrival + 0.001
    request.first_token_time = first_token
    request.finish_time = finish
    request.num_preemptions = preemptions
    request.rejected_reason = rejected
    return request


def make_plan(num_prefill=0, prefill_tokens=0, num_decode=0, *, recompute=0, swap=0,
              swap_out=0, swap_in=0, copies=0):
    plan = StepPlan()
    dummy = Request(request_id=-1, arrival_time=0.0, prompt_len=1, output_len=1)
    plan.seqs = [Sequence(i, dummy) for i in range(num_prefill + num_decode)]
    plan.num_new_tokens = [1] * len(plan.seqs)
    plan.num_prefill_seqs = num_prefill
    plan.num_prefill_tokens = prefill_tokens
    plan.num_decode_seqs = num_decode
    plan.preempted_recompute = [dummy] * recompute
    plan.preempted_swap = [dummy] * swap
    plan.blocks_to_swap_out = [(i, i) for i in range(swap_out)]
    plan.blocks_to_swap_in = [(i, i) for i in range(swap_in)]
    plan.blocks_to_copy = [(i, i) for i in range(copies)]
    return plan


def record(collector, replica_id, start, plan, duration=0.01, *, used=0, allocated=0, stored=0,
           waiting=0, running=0, swapped=0):
    collector.record_step(replica_id, start, plan, duration, kv_blocks_used=used,
                          kv_slots_allocated=allocated, kv_tokens_stored=stored,
                          num_waiting=waiting, num_running=running, num_swapped=swapped)


@pytest.fixture
def run():
    """Five completed requests (one with n=2, one with a single token), one rejected, one still
    running; four steps on two replicas; ITL histograms from both replicas."""
    requests = [
        make_request(0, 0.0, 10, [5], first_token=0.2, finish=1.0, preemptions=1),
        make_request(1, 0.5, 20, [3, 8], first_token=0.9, finish=2.3, replica_id=1),
        make_request(2, 1.0, 5, [1], first_token=1.4, finish=1.4),
        make_request(3, 1.2, 7, [4], first_token=1.5, finish=3.0, preemptions=2),
        make_request(4, 2.0, 30, [10], first_token=2.1, finish=4.0, replica_id=1),
        make_request(5, 0.1, 99, [], rejected="prompt too long"),
        make_request(6, 3.5, 12, [2], first_token=3.9),  # running when the run ended
    ]
    collector = MetricsCollector(kv_bytes_per_block=1024)
    record(collector, 0, 0.0, make_plan(2, 30, 0), used=4, allocated=64, stored=32, waiting=3)
    record(collector, 1, 0.0, make_plan(1, 20, 3, recompute=1), used=9, allocated=0, stored=0)
    record(collector, 0, 0.5, make_plan(0, 0, 4, swap=1, swap_out=3, copies=2), used=7,
           allocated=100, stored=75, running=4)
    record(collector, 1, 0.7, make_plan(0, 0, 2, swap_in=5), used=2, allocated=10, stored=10,
           swapped=1)
    collector.add_itl_counts({0.05: 3, 0.1: 2})
    collector.add_itl_counts({0.1: 4, 0.2: 1})
    return collector, requests


def test_summary_matches_numpy(run):
    collector, requests = run
    summary = collector.summary(requests, wall_time_s=2.5)
    assert all(key in summary for key in REQUIRED_KEYS)

    completed = requests[:5]
    ttft = np.array([r.first_token_time - r.arrival_time for r in completed]) * 1000
    e2el = np.array([r.finish_time - r.arrival_time for r in completed]) * 1000
    # TPOT divides by the longest sample's tokens - 1 and skips single-token requests.
    tpot = np.array([(1.0 - 0.2) / 4, (2.3 - 0.9) / 7, (3.0 - 1.5) / 3, (4.0 - 2.1) / 9]) * 1000
    itl = np.repeat([0.05, 0.1, 0.2], [3, 6, 1]) * 1000
    for name, values in (("ttft", ttft), ("tpot", tpot), ("e2el", e2el), ("itl", itl)):
        assert summary[f"mean_{name}_ms"] == pytest.approx(values.mean())
        for label, pct in (("median", 50), ("p90", 90), ("p99", 99)):
            assert summary[f"{label}_{name}_ms"] == pytest.approx(np.percentile(values, pct))

    assert summary["completed"] == 5
    assert summary["rejected"] == 1
    duration = 4.0 - 0.0
    assert summary["duration_s"] == pytest.approx(duration)
    assert summary["request_throughput"] == pytest.approx(5 / duration)
    output_tokens = 5 + 11 + 1 + 4 + 10
    assert summary["output_throughput"] == pytest.approx(output_tokens / duration)
    assert summary["total_token_throughput"] == pytest.approx((72 + output_tokens) / duration)

    assert summary["num_preemptions"] == 3
    assert summary["peak_kv_blocks"] == 9
    # The step with no allocated slots is left out of the mean.
    assert summary["kv_waste_fraction"] == pytest.approx(np.mean([0.5, 0.25, 0.0]))
    assert summary["swap_bytes"] == (3 + 5) * 1024
    assert summary["num_steps"] == 4
    assert summary["wall_time_s"] == 2.5


def test_goodput(run):
    collector, requests = run
    summary = collector.summary(requests, 1.0, slos_ms={"ttft": 350, "e2el": 1500})
    # TTFT (ms): 200, 400, 400, 300, 100; E2EL (ms): 1000, 1800, 400, 1800, 2000.
    assert summary["slo_attainment"] == pytest.approx(1 / 5)
    assert summary["goodput"] == pytest.approx(1 / 4.0)
    with pytest.raises(ValueError):
        collector.summary(requests, 1.0, slos_ms={"itl": 10})


@pytest.mark.parametrize("slo", ["slo_ttft_ms", "slo_tpot_ms"])
def test_a_request_slo_alone_adds_goodput(run, slo):
    """One request's own TTFT or TPOT SLO, without run SLOs, is enough for goodput."""
    collector, requests = run
    assert "goodput" not in collector.summary(requests, 1.0)
    setattr(requests[3], slo, 250)   # its TTFT is 300 ms, its TPOT 500 ms: it misses
    assert collector.summary(requests, 1.0)["slo_attainment"] == pytest.approx(4 / 5)


def test_record_step_row(run):
    collector, _ = run
    assert len(collector.step_rows[0]) == len(STEP_COLUMNS)
    row = dict(zip(STEP_COLUMNS, collector.step_rows[2]))
    assert row["num_seqs"] == 4 and row["num_decode_seqs"] == 4
    assert row["num_batched_tokens"] == 4
    assert row["num_preempted_swap"] == 1 and row["num_preempted_recompute"] == 0
    assert (row["num_blocks_swapped_out"], row["num_blocks_copied"]) == (3, 2)
    row = dict(zip(STEP_COLUMNS, collector.step_rows[1]))
    assert row["num_batched_tokens"] == 23 and row["num_preempted_recompute"] == 1


def test_step_column_total_is_the_column_sum_as_an_integer(run):
    collector, _ = run
    totals = collector.step_totals()
    for name in STEP_COLUMNS[3:]:   # the counts, past the replica id, start and duration
        total = collector.step_column_total(name)
        assert type(total) is int and total == totals[name], name
    assert collector.step_column_total("num_blocks_swapped_in") == 5


@pytest.mark.parametrize("not_completed", [None, "finish_time", "rejected_reason"])
@pytest.mark.parametrize("samples", [[[5], [1], [0], [9]], [[5], [2, 7], [1], [3, 3, 1]]])
def test_completed_and_output_tokens_match_each_request(samples, not_completed):
    """The summary's C-pass helpers give what the per-request definitions give, whether all
    requests completed and have one sample (their fast path) or not."""
    requests = [make_request(index, 0.1 * index, 4, tokens, first_token=1.0, finish=2.0)
                for index, tokens in enumerate(samples)]
    if not_completed == "finish_time":
        requests[1].finish_time = None
    elif not_completed == "rejected_reason":
        requests[2].rejected_reason = "too long"
    completed = completed_requests(requests)
    assert completed == [request for request in requests if is_completed(request)]
    assert output_tokens(completed) == [request.num_output_tokens for request in completed]
    assert output_tokens(completed, per_sample=True) == [
        request.num_output_tokens_per_sample for request in completed]


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.floats(0.0, 10.0, allow_nan=False), st.integers(0, 50),
                       min_size=1, max_size=30).filter(lambda h: sum(h.values()) > 0),
       st.lists(st.floats(0.0, 100.0), min_size=1, max_size=8))
def test_weighted_percentiles_equal_expanded(histogram, percentiles):
    values = np.array(list(histogram.keys()))
    counts = np.array(list(histogram.values()))
    expanded = np.repeat(values, counts)
    np.testing.assert_allclose(weighted_percentiles(values, counts, percentiles),
                               np.percentile(expanded, percentiles), rtol=1e-12, atol=0)


def test_weighted_percentiles_seeds():
    for seed in range(20):
        rng = np.random.default_rng(seed)
        values = rng.lognormal(-3, 1, size=rng.integers(1, 200))
        counts = rng.integers(0, 1000, size=values.size)
        counts[0] += 1
        percentiles = [0, 1, 25, 50, 90, 99, 99.9, 100]
        np.testing.assert_array_equal(weighted_percentiles(values, counts, percentiles),
                                      np.percentile(np.repeat(values, counts), percentiles))


def test_add_itl_counts_merges():
    collector = MetricsCollector()
    collector.add_itl_counts({0.1: 2})
    collector.add_itl_counts({0.1: 3, 0.2: 1})
    assert collector.itl_counts == {0.1: 5, 0.2: 1}


@pytest.mark.parametrize("max_logged", [1, 5, StepRecorder.MAX_LOGGED_ITLS])
def test_logged_itls_count_as_dict_updates_would(max_logged, monkeypatch):
    """The recorder logs latencies and counts them later (in pieces when the log grows long):
    the histogram, and the order of its keys (the order numpy sums them in), are those of one
    dict update per latency as it arose."""
    monkeypatch.setattr(StepRecorder, "MAX_LOGGED_ITLS", max_logged)
    rng = np.random.default_rng(max_logged)
    recorder, expected = StepRecorder(MetricsCollector()), {}
    times = rng.choice([0.25, 0.5, 0.75], size=12).round(2).tolist()   # many repeated latencies
    for step in range(40):
        # A run of repeated steps: the first step's latencies, then every later step's.
        ends = sorted(rng.choice([1.0, 1.25, 1.5, 2.0, 2.5], size=rng.integers(1, 5)).tolist())
        recorder.record_repeated_itls(times, ends)
        for last_time in times:
            expected[ends[0] - last_time] = expected.get(ends[0] - last_time, 0) + 1
        for end, next_end in zip(ends, ends[1:]):
            expected[next_end - end] = expected.get(next_end - end, 0) + len(times)
        if step == 20:
            assert recorder.itl_counts == expected   # read midway: counting goes on after
    assert list(recorder.itl_counts.items()) == list(expected.items())


def read_csv(path):
    with open(path, newline="") as file:
        rows = list(csv.reader(file))
    return rows[0], rows[1:]


def test_write_outputs(run, tmp_path):
    collector, requests = run
    summary = collector.summary(requests, wall_time_s=1.0)
    written = write_run_outputs(tmp_path / "out", collector, requests, summary)
    out = tmp_path / "out"
    assert {path.name for path in written} == {
        "summary.json", "requests.csv", "steps.csv",
        "latency_cdf.png", "kv_blocks.png", "batch_size.png"}

    assert json.loads((out / "summary.json").read_text()) == summary
    header, rows = read_csv(out / "requests.csv")
    assert tuple(header) == REQUEST_COLUMNS and len(rows) == len(requests)
    by_id = {row[0]: dict(zip(header, row)) for row in rows}
    assert float(by_id["0"]["ttft_ms"]) == pytest.approx(200.0)
    assert float(by_id["0"]["tpot_ms"]) == pytest.approx(200.0)
    assert by_id["2"]["tpot_ms"] == ""  # a single token has no TPOT
    assert by_id["5"]["rejected_reason"] == "prompt too long" and by_id["5"]["ttft_ms"] == ""
    assert by_id["1"]["num_output_tokens"] == "11"
    header, rows = read_csv(out / "steps.csv")
    assert tuple(header) == STEP_COLUMNS and len(rows) == 4

    for name in ("latency_cdf.png", "kv_blocks.png", "batch_size.png"):
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 1000


def test_empty_run(tmp_path):
    collector = MetricsCollector()
    summary = collector.summary([], wall_time_s=0.0)
    assert all(key in summary for key in REQUIRED_KEYS)
    for key, value in summary.items():
        assert value == 0, key
        assert not (isinstance(value, float) and math.isnan(value)), key
    # Only rejected requests: still no completed request, still zeros.
    rejected = [make_request(0, 0.0, 10, [], rejected="too long")]
    summary = collector.summary(rejected, wall_time_s=0.1)
    assert summary["rejected"] == 1 and summary["completed"] == 0
    assert summary["request_throughput"] == 0.0 and summary["mean_ttft_ms"] == 0.0
    write_run_outputs(tmp_path, collector, rejected, summary)
    for name in ("latency_cdf.png", "kv_blocks.png", "batch_size.png"):
        assert (tmp_path / name).stat().st_size > 0
    _, rows = read_csv(tmp_path / "steps.csv")
    assert rows == []


def test_print_summary(run):
    collector, requests = run
    summary = collector.summary(requests, wall_time_s=1.0)
    console = Console(record=True, width=120)
    print_summary(summary, console)
    text = console.export_text()
    assert "TTFT" in text and "E2E" in text and "output tok/s" in text
    format_summary_table(collector.summary([], 0.0))  # empty summary renders too


def test_downsample_keeps_peaks_and_bounds():
    values = np.zeros(100_000)
    values[12_345] = 7.0
    keep = downsample_indices(values, max_points=1000)
    assert len(keep) <= 1000
    assert 12_345 in keep and keep[0] == 0 and keep[-1] == values.size - 1
    assert np.all(np.diff(keep) > 0)
    np.testing.assert_array_equal(downsample_indices(np.arange(10.0)), np.arange(10))


def test_large_run_summary_and_steps_csv(tmp_path):
    """100k steps on 4 replicas: the summary and every steps.csv row."""
    collector = MetricsCollector()
    plan = make_plan(1, 100, 30)
    rng = np.random.default_rng(0)
    used = rng.integers(0, 5000, size=100_000).tolist()
    for index in range(100_000):
        record(collector, index % 4, index * 0.01, plan, used=used[index], allocated=512,
               stored=400, waiting=index % 17, running=31)
    summary = collector.summary([], 1.0)
    write_run_outputs(tmp_path, collector, [], summary, plots=False)
    assert summary["peak_kv_blocks"] == max(used)
    assert summary["kv_waste_fraction"] == pytest.approx(1 - 400 / 512)
    _, rows = read_csv(tmp_path / "steps.csv")
    assert len(rows) == 100_000


def test_write_plots_multi_replica(tmp_path):
    collector = MetricsCollector()
    for index in range(12_000):  # more than one line's point budget, so decimation runs
        record(collector, index % 3, index * 0.01, make_plan(0, 0, index % 50),
               used=index % 700, waiting=index % 9)
    requests = [make_request(i, i * 0.1, 10, [5], first_token=i * 0.1 + 0.05 * (i + 1),
                             finish=i * 0.1 + 0.5 * (i + 1)) for i in range(50)]
    written = write_plots(tmp_path, requests, collector.step_rows, STEP_COLUMNS)
    assert [path.name for path in written] == ["latency_cdf.png", "kv_blocks.png",
                                               "batch_size.png"]
    assert all(path.read_bytes().startswith(b"\x89PNG") for path in written)
