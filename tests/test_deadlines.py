"""Clients that give up (Request.timeout_s: workload.timeout_s, a trace's timeout_s column): the
simulator aborts each such request at the first step boundary at or after its deadline, waiting
or running, gives back every block it held, ends it once, counts it in the summary, and comes out
the same with repeated steps as step by step."""
from __future__ import annotations

import csv
import math
import random

import pytest

from factories import assert_same_run, make_cfg, run_both_ways
from policies.types import Request
from runtime.policy_config import config_names
from sim.core.experiment import run_experiment
from sim.core.replica import Replica
from sim.core.workload import build_workload

# Service far longer than the clients wait: many requests abandoned mid-decode.
IMPATIENT = ["workload.num_requests=150", "workload.rate=25", "++workload.timeout_s=3"]
CLUSTERS = {
    "one replica": [],
    "two replicas": ["cluster.num_replicas=2"],
    "lockstep ranks": ["model=tiny-moe", "cluster.num_replicas=2",
                       "cluster.expert_parallel_size=2", "kv_cache.num_blocks=200",
                       "scheduler.max_num_seqs=2"],   # (a fast model: a longer queue)
    "pipeline stages": ["cluster.pipeline_parallel_size=2"],
}


@pytest.fixture(scope="module")
def impatient_trace(tmp_path_factory) -> list[str]:
    """A trace whose clients wait from 0.2 to 6 s, or for ever (an empty cell), some short ones
    queued behind long ones: requests are abandoned waiting and running (max_num_seqs=8)."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("trace") / "impatient.csv"
    rows = ["arrival_time,prompt_len,output_len,timeout_s"]
    for index in range(150):
        timeout = "" if index % 7 == 0 else f"{rng.choice([0.2, 0.5, 1.0, 3.0, 6.0]):g}"
        rows.append(f"{index * 0.04:.2f},{rng.randint(16, 600)},{rng.randint(8, 400)},{timeout}")
    path.write_text("\n".join(rows) + "\n")
    return ["workload=trace", f"workload.trace_path={path}", "scheduler.max_num_seqs=8"]


def ended_requests(monkeypatch) -> list[Request]:
    """Every request a replica reports ended (finished, rejected or abandoned), as reported."""
    ended = []

    def recording(report):
        def record(self, requests):
            ended.extend(requests)
            report(self, requests)
        return record

    monkeypatch.setattr(Replica, "ended", recording(Replica.ended))
    return ended


def schedulers_of(result) -> list:
    return [scheduler for replica in result.replicas for scheduler in replica.schedulers]


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_abandoned_requests_give_back_their_blocks_and_end_once(cluster, impatient_trace,
                                                                 monkeypatch):
    ended = ended_requests(monkeypatch)
    # An SLO every finished request meets: what it misses is the abandoned requests.
    result = run_experiment(make_cfg(*impatient_trace, *CLUSTERS[cluster], "slo.e2el_ms=1e9"),
                            plots=False)
    summary, requests = result.summary, result.requests
    abandoned = [request for request in requests if request.abandoned_time is not None]
    # Not vacuous: clients gave up on requests running and waiting.
    assert summary["completed"] and summary["abandoned_before_first_token"], summary
    assert any(request.first_token_time is not None for request in abandoned)
    for request in abandoned:
        assert request.finish_time is None
        assert request.deadline <= request.abandoned_time
    assert summary["abandoned"] == len(abandoned)
    assert summary["abandoned_fraction"] == pytest.approx(len(abandoned) / len(requests))
    assert summary["abandoned_output_tokens"] == sum(r.num_output_tokens for r in abandoned)
    assert summary["completed"] + summary["abandoned"] + summary["rejected"] == len(requests)
    assert summary["slo_attainment"] == pytest.approx(
        summary["completed"] / (summary["completed"] + summary["abandoned"]))
    assert summary["goodput"] == pytest.approx(summary["request_throughput"])
    # The summary's throughputs count finished requests' tokens alone: the goodput left.
    finished = [request for request in requests if request.finish_time is not None]
    assert summary["total_output_tokens"] == sum(r.num_output_tokens for r in finished)
    # Every request ended exactly once, and every block and seat is back.
    assert sorted(r.request_id for r in ended) == [r.request_id for r in requests]
    for scheduler in schedulers_of(result):
        assert not scheduler.has_unfinished() and scheduler.num_running_seqs == 0
        assert scheduler.kv_cache.num_used_blocks() == 0
        assert scheduler.kv_cache.num_free_blocks() == scheduler.kv_cache.num_blocks


@pytest.mark.parametrize("workload", ["synthetic", "trace"])
@pytest.mark.parametrize("scheduler", config_names("scheduler"))
def test_repeated_steps_stop_at_deadlines_as_step_by_step(scheduler, workload, impatient_trace,
                                                          monkeypatch):
    """A run of repeated steps ends at the step during which the earliest deadline
    passes (and a blocked queue's run at the next arrival, which may give up before it would
    end): every row, latency and request time equals the step-by-step run's."""
    overrides = [f"scheduler={scheduler}", "seed=3",
                 *(IMPATIENT if workload == "synthetic" else impatient_trace)]
    if scheduler == "sjf":
        overrides.append("predictor=noisy")
    repeated, step_by_step, repeated_runs = run_both_ways(overrides, monkeypatch)
    assert_same_run(repeated, step_by_step)
    assert [r.abandoned_time for r in repeated.requests] == \
           [r.abandoned_time for r in step_by_step.requests]
    # Not vacuous: clients gave up, and decode batches ran as one event, several steps each.
    assert repeated.summary["abandoned"] > 0
    if type(repeated.replicas[0].scheduler).repeated_steps:
        assert repeated_runs and max(repeated_runs) > 1


def test_workload_and_trace_deadlines(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("arrival_time,prompt_len,output_len,timeout_s\n"
                     "0.0,10,5,2.5\n"
                     "1.0,10,5,\n")
    cfg = {"kind": "trace", "trace_path": str(trace)}
    first, second = build_workload(cfg, seed=0)
    assert (first.timeout_s, second.timeout_s) == (2.5, None)
    assert (first.deadline, second.deadline) == (2.5, None)
    # workload.timeout_s is every row's whose cell is empty.
    first, second = build_workload({**cfg, "timeout_s": 4}, seed=0)
    assert (first.timeout_s, second.timeout_s) == (2.5, 4.0)
    assert second.deadline == 5.0
    trace.write_text("arrival_time,prompt_len,output_len,timeout_s\n0.0,10,5,-1\n")
    with pytest.raises(ValueError, match=r"timeout_s.*a positive number of seconds or empty"):
        build_workload(cfg, seed=0)


@pytest.mark.parametrize("value", [-1, 0, "soon", math.nan])
def test_a_bad_workload_timeout_is_one_line_naming_the_key(value):
    cfg = {"kind": "synthetic", "num_requests": 3, "rate": 1.0, "timeout_s": value,
           "prompt_len": {"dist": "fixed", "value": 8}, "output_len": {"dist": "fixed",
                                                                      "value": 8}}
    with pytest.raises(ValueError, match=r"^workload\.timeout_s must be") as error:
        build_workload(cfg, seed=0)
    assert "\n" not in str(error.value)


def test_deadlines_need_a_scheduler_that_aborts_and_replicas_that_keep_requests():
    with pytest.raises(ValueError, match=r"scheduler LeastAttainedService has no abort"):
        run_experiment(make_cfg("scheduler._target_=las_scheduler.LeastAttainedService",
                                *IMPATIENT), plots=False)
    with pytest.raises(ValueError, match=r"not modelled with prefill and decode pools"):
        run_experiment(make_cfg("cluster=disaggregated", *IMPATIENT), plots=False)


def test_the_console_summary_shows_the_abandoned_requests():
    from test_console_summary import console_text

    summary = run_experiment(make_cfg(*IMPATIENT), plots=False).summary
    words = " ".join(console_text(summary, 100).split())
    assert f"abandoned {summary['abandoned']:,} ({summary['abandoned_fraction']:.1%})" in words
    assert summary["abandoned"] > 0


def test_requests_csv_says_which_requests_were_abandoned(tmp_path):
    result = run_experiment(make_cfg(*IMPATIENT), tmp_path, plots=False)
    with open(tmp_path / "requests.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    assert [row["abandoned_time"] != "" for row in rows] == \
           [request.abandoned_time is not None for request in result.requests]
    assert {row["timeout_s"] for row in rows} == {"3.0"}
    assert any(row["abandoned_time"] for row in rows)
