"""Tests for the per-request metadata in a run's outputs: requests.csv's columns, per_tenant /
per_priority, jain_fairness and per-request SLOs in the summary, the table, the sweep report."""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from factories import make_cfg
from rich.console import Console

from policies.types import Request, Sequence, SequenceStatus
from sim.core.experiment import run_experiment
from runtime.metrics import GROUP_LATENCY_KEYS, MetricsCollector, jain_fairness
from sim.tools.console_summary import format_summary_table
from sim.tools.run_outputs import REQUEST_COLUMNS
from sim.tools.report import write_csv
from sim.tools.sweep_jobs import flatten_summary, load_jobs

TWO_TENANTS = ("workload.num_requests=200", "workload.rate=12", "slo.ttft_ms=80",
               "workload.classes=[{share: 0.5, tenant: a},"
               " {share: 0.5, tenant: b, priority: 1, slo_ttft_ms: 40, slo_tpot_ms: 30,"
               " output_len: {dist: fixed, value: 64}}]")


def done_request(request_id, prompt_len, output_tokens, ttft_s, e2el_s, *, tenant="default",
                 priority=0, slo_ttft_ms=None, slo_tpot_ms=None, arrival=0.0):
    """A completed request with one sample of `output_tokens` tokens."""
    request = Request(request_id=request_id, arrival_time=arrival, prompt_len=prompt_len,
                      output_len=output_tokens, tenant=tenant, priority=priority,
                      slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms)
    seq = Sequence(request_id, request, num_output_tokens=output_tokens)
    seq.status = SequenceStatus.FINISHED
    request.sequences.append(seq)
    request.first_scheduled_time = arrival
    request.first_token_time = arrival + ttft_s
    request.finish_time = arrival + e2el_s
    return request


def read_rows(path):
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def cell(value: str):
    return None if value == "" else float(value)


def recompute(rows: list[dict], duration_s: float, slos_ms: dict[str, float]) -> dict:
    """A group's per_tenant entry from its requests.csv rows alone."""
    done = [row for row in rows if row["finish_time"] and not row["rejected_reason"]]
    result = {"completed": len(done),
              "request_throughput": len(done) / duration_s,
              "output_throughput": sum(int(row["num_output_tokens"]) for row in done) / duration_s}
    for name in ("ttft", "tpot", "e2el"):
        values = np.array([float(row[f"{name}_ms"]) for row in done if row[f"{name}_ms"]])
        result[f"mean_{name}_ms"] = float(values.mean())
        result[f"median_{name}_ms"] = float(np.percentile(values, 50))
        result[f"p99_{name}_ms"] = float(np.percentile(values, 99))
    good = 0
    for row in done:
        limits = dict(slos_ms)
        for name in ("ttft", "tpot"):
            if row[f"slo_{name}_ms"]:
                limits[name] = float(row[f"slo_{name}_ms"])
        good += all(cell(row[f"{name}_ms"]) is None or cell(row[f"{name}_ms"]) <= limit
                    for name, limit in limits.items())
    result["slo_attainment"] = good / len(done)
    return result


@pytest.fixture(scope="module")
def two_tenant_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("two_tenants")
    result = run_experiment(make_cfg(*TWO_TENANTS), out_dir=out, plots=False)
    return result, out


def test_requests_csv_carries_the_metadata(two_tenant_run):
    result, out = two_tenant_run
    rows = read_rows(out / "requests.csv")
    assert tuple(rows[0]) == REQUEST_COLUMNS
    assert {(row["tenant"], row["priority"], row["slo_ttft_ms"], row["slo_tpot_ms"],
             row["predicted_output_len"]) for row in rows} == {
        ("a", "0", "", "", ""), ("b", "1", "40.0", "30.0", "")}
    assert {row["output_len"] for row in rows if row["tenant"] == "b"} == {"64"}


def test_per_tenant_and_per_priority_match_requests_csv(two_tenant_run):
    result, out = two_tenant_run
    summary = json.loads((out / "summary.json").read_text())
    rows = read_rows(out / "requests.csv")
    duration_s = summary["duration_s"]
    for key, column, names in (("per_tenant", "tenant", ("a", "b")),
                               ("per_priority", "priority", ("0", "1"))):
        assert list(summary[key]) == list(names)
        for name in names:
            group = [row for row in rows if row[column] == name]
            expected = recompute(group, duration_s, {"ttft": 80.0})
            # (A tenant's part of the windowed fairness: tests/test_windowed_fairness.py.)
            if key == "per_tenant":
                expected.update({part: summary[key][name][part]
                                 for part in ("backlogged_windows", "mean_backlogged_service")})
            assert set(summary[key][name]) == set(expected)
            assert summary[key][name] == pytest.approx(expected, rel=1e-12)
    # The groups split the run: their counts and throughputs add up to its own.
    tenants = summary["per_tenant"].values()
    assert sum(group["completed"] for group in tenants) == summary["completed"] == 200
    assert sum(group["output_throughput"] for group in tenants) == pytest.approx(
        summary["output_throughput"])
    # Tenant b's own, tighter TTFT SLO counts in the run's attainment too.
    assert summary["slo_attainment"] == pytest.approx(
        recompute(rows, duration_s, {"ttft": 80.0})["slo_attainment"])
    # ...and makes a difference here, so the comparisons above see it.
    b_rows = [{**row, "slo_ttft_ms": "", "slo_tpot_ms": ""}
              for row in rows if row["tenant"] == "b"]
    assert summary["per_tenant"]["b"]["slo_attainment"] != recompute(
        b_rows, duration_s, {"ttft": 80.0})["slo_attainment"]


def test_jain_fairness_matches_requests_csv(two_tenant_run):
    result, out = two_tenant_run
    rows = read_rows(out / "requests.csv")
    service = {tenant: sum(int(row["prompt_len"]) + 2 * int(row["num_output_tokens"])
                           for row in rows if row["tenant"] == tenant) for tenant in "ab"}
    x = np.array(list(service.values()), dtype=float)
    assert result.summary["jain_fairness"] == pytest.approx(x.sum() ** 2 / (2 * (x ** 2).sum()))
    assert result.summary["jain_fairness"] < 1.0


def test_jain_fairness_is_one_for_equal_service_and_less_for_unequal():
    assert jain_fairness([5.0, 5.0, 5.0]) == 1.0
    assert jain_fairness([1.0, 0.0]) == 0.5
    assert jain_fairness([0.0, 0.0]) == 0.0
    # Service is input + 2 x output tokens: 100 + 2*50 = 180 + 2*10, equal in VTC's weighting.
    equal = [done_request(0, 100, 50, 0.1, 1.0, tenant="a"),
             done_request(1, 180, 10, 0.1, 1.0, tenant="b")]
    assert MetricsCollector().summary(equal, 1.0)["jain_fairness"] == pytest.approx(1.0)
    # Equal in plain tokens (150 each) but not in VTC's weighting (200 against 160).
    unequal = [done_request(0, 100, 50, 0.1, 1.0, tenant="a"),
               done_request(1, 140, 10, 0.1, 1.0, tenant="b")]
    fairness = MetricsCollector().summary(unequal, 1.0)["jain_fairness"]
    assert fairness == pytest.approx(360 ** 2 / (2 * (200 ** 2 + 160 ** 2)))
    assert fairness < 1.0


def test_one_tenant_and_priority_adds_no_group_keys():
    requests = [done_request(i, 10, 5, 0.1, 1.0) for i in range(3)]
    summary = MetricsCollector().summary(requests, 1.0, slos_ms={"ttft": 200})
    assert not {"per_tenant", "per_priority", "jain_fairness"} & set(summary)
    # One tenant, two priorities: only per_priority.
    requests[0].priority = 1
    summary = MetricsCollector().summary(requests, 1.0)
    assert set(summary) & {"per_tenant", "per_priority", "jain_fairness"} == {"per_priority"}
    assert set(summary["per_priority"]["1"]) == {"completed", "request_throughput",
                                                 "output_throughput", *GROUP_LATENCY_KEYS}


def test_a_request_slo_replaces_the_runs_limit():
    fast = done_request(0, 10, 5, 0.050, 1.0)     # TTFT 50 ms
    slow = done_request(1, 10, 5, 0.150, 1.0)     # TTFT 150 ms
    collector = MetricsCollector()
    assert collector.summary([fast, slow], 1.0, {"ttft": 100})["slo_attainment"] == 0.5
    slow.slo_ttft_ms = 200.0                      # the slow one may take longer: both meet
    summary = collector.summary([fast, slow], 1.0, {"ttft": 100})
    assert summary["slo_attainment"] == 1.0 and summary["goodput"] == pytest.approx(2.0)
    fast.slo_ttft_ms = 10.0                       # the fast one must be faster: it misses
    assert collector.summary([fast, slow], 1.0, {"ttft": 100})["slo_attainment"] == 0.5
    # A TPOT SLO of its own adds a limit the run does not have: (1 - 0.15) / 4 s = 212.5 ms.
    fast.slo_ttft_ms, slow.slo_tpot_ms = None, 200.0
    assert collector.summary([fast, slow], 1.0, {"ttft": 1000})["slo_attainment"] == 0.5


def test_request_slos_alone_give_goodput_and_none_give_none():
    fast = done_request(0, 10, 5, 0.050, 1.0)
    slow = done_request(1, 10, 5, 0.150, 1.0)
    assert "slo_attainment" not in MetricsCollector().summary([fast, slow], 1.0)
    slow.slo_ttft_ms = 100.0
    summary = MetricsCollector().summary([fast, slow], 1.0)
    assert summary["slo_attainment"] == 0.5 and summary["goodput"] == pytest.approx(1.0)


def test_the_table_shows_groups_only_when_present(two_tenant_run):
    result, _ = two_tenant_run
    console = Console(record=True, width=120)
    console.print(format_summary_table(result.summary))
    text = console.export_text()
    assert "tenant a" in text and "priority 1" in text and "Jain fairness" in text
    plain = MetricsCollector().summary([done_request(0, 10, 5, 0.1, 1.0)], 1.0)
    console = Console(record=True, width=120)
    console.print(format_summary_table(plain))
    assert "tenant" not in console.export_text() and "Jain" not in console.export_text()


def test_report_flattens_group_maps_into_columns(two_tenant_run, tmp_path):
    result, out = two_tenant_run
    flat = flatten_summary({"completed": 3, "per_tenant": {"a": {"p99_ttft_ms": 1.5}}})
    assert flat == {"completed": 3, "per_tenant.a.p99_ttft_ms": 1.5}
    job = tmp_path / "sweep" / "0"
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("- workload.rate=12\n")
    for name in ("summary.json", "steps.csv"):
        (job / name).write_text((out / name).read_text())
    report = write_csv(load_jobs(tmp_path / "sweep"), tmp_path / "report.csv")
    row = read_rows(report)[0]
    assert float(row["per_tenant.b.p99_ttft_ms"]) == pytest.approx(
        result.summary["per_tenant"]["b"]["p99_ttft_ms"])
    assert "per_tenant" not in row
