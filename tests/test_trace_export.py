"""trace_export=true: trace.json beside steps.csv, in the Trace Event Format (Perfetto,
chrome://tracing), its step events the rows of steps.csv and its request slices the times of
requests.csv."""
from __future__ import annotations

import csv
import json
from collections import defaultdict
from pathlib import Path

import pytest

from sim.core.experiment import run_experiment

from factories import make_cfg


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def check_trace_event_format(trace: dict) -> list[dict]:
    """The trace's events once they are valid Trace Event Format (the JSON object form): each
    with its name, phase, process and thread; timed events with ts (and X a duration); every
    async "b" closed by an "e" of the same name, category and id, nested and in time order."""
    assert isinstance(trace, dict) and isinstance(trace["traceEvents"], list)
    assert trace.get("displayTimeUnit") in ("ms", "ns")
    open_slices: dict[tuple, list[dict]] = defaultdict(list)
    for event in trace["traceEvents"]:
        assert isinstance(event["name"], str) and event["ph"] in "XbeiM", event
        assert all(isinstance(event[key], int) for key in ("pid", "tid")), event
        if event["ph"] == "M":
            assert event["name"] in ("process_name", "process_sort_index", "thread_name")
            continue
        assert isinstance(event["ts"], (int, float)) and event["ts"] >= 0, event
        if event["ph"] == "X":
            assert isinstance(event["dur"], (int, float)) and event["dur"] >= 0, event
        elif event["ph"] == "i":
            assert event["s"] in "gpt"
        else:
            key = (event["cat"], event["id"], event["pid"])
            if event["ph"] == "b":
                assert not open_slices[key] or open_slices[key][-1]["ts"] <= event["ts"]
                open_slices[key].append(event)
            else:
                opened = open_slices[key].pop()
                assert opened["name"] == event["name"] and opened["ts"] <= event["ts"], event
    assert not any(open_slices.values()), "async slices never closed"
    return [event for event in trace["traceEvents"] if event["ph"] != "M"]


def slices(events: list[dict]) -> dict[int, list[tuple[str, float, float]]]:
    """Per request id, its async slices as (name, begin µs, end µs), in the order they open."""
    by_id: dict[int, list] = defaultdict(list)
    stack: dict[int, list] = defaultdict(list)
    for event in events:
        if event["ph"] == "b":
            stack[event["id"]].append(len(by_id[event["id"]]))
            by_id[event["id"]].append([event["name"], event["ts"], None])
        elif event["ph"] == "e":
            by_id[event["id"]][stack[event["id"]].pop()][2] = event["ts"]
    return {key: [tuple(entry) for entry in value] for key, value in by_id.items()}


def us(seconds: str) -> float:
    return pytest.approx(float(seconds) * 1e6, abs=1e-3)


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory) -> Path:
    """Two replicas, a pool small enough to preempt, and prompts some of which are too long."""
    out = tmp_path_factory.mktemp("trace")
    run_experiment(make_cfg("trace_export=true", "workload.num_requests=40",
                            "cluster.num_replicas=2", "kv_cache.num_blocks=300",
                            "++workload.prompt_len={dist: uniform, low: 16, high: 4500}"), out)
    return out


def test_the_trace_is_valid_trace_event_format(traced_run):
    trace = json.loads((traced_run / "trace.json").read_text())
    events = check_trace_event_format(trace)
    names = {(event["pid"], event["args"]["name"]) for event in trace["traceEvents"]
             if event["name"] == "process_name"}
    assert {(0, "replica 0"), (1, "replica 1")} <= names
    assert [event["ts"] for event in events] == sorted(event["ts"] for event in events)


def test_the_step_events_are_the_rows_of_steps_csv(traced_run):
    events = check_trace_event_format(json.loads((traced_run / "trace.json").read_text()))
    steps = [event for event in events if event["ph"] == "X"]
    rows = read_csv(traced_run / "steps.csv")
    assert len(steps) == len(rows) > 0
    for event, row in zip(steps, rows):
        assert (event["pid"], event["tid"]) == (int(row["replica_id"]), 0)
        assert event["ts"] == us(row["start_time"]) and event["dur"] == us(row["duration"])
        assert event["args"]["num_batched_tokens"] == int(row["num_batched_tokens"])
        assert event["name"] == ("mixed" if int(row["num_prefill_seqs"]) and
                                 int(row["num_decode_seqs"]) else
                                 "prefill" if int(row["num_prefill_seqs"]) else "decode")
    assert {"prefill", "decode"} <= {event["name"] for event in steps}


def test_each_request_is_a_slice_of_its_phases_at_its_times(traced_run):
    events = check_trace_event_format(json.loads((traced_run / "trace.json").read_text()))
    by_id = slices(events)
    rows = read_csv(traced_run / "requests.csv")
    rejected = [row for row in rows if row["rejected_reason"]]
    assert rejected and len(rejected) < len(rows)
    instants = {event["name"]: event for event in events if event["ph"] == "i"}
    for row in rows:
        request_id = int(row["request_id"])
        if row["rejected_reason"]:
            instant = instants[f"request {request_id} rejected"]
            assert instant["args"]["rejected_reason"] == row["rejected_reason"]
            assert request_id not in by_id
            continue
        arrival, scheduled, first_token, finish = (
            row[key] for key in ("arrival_time", "first_scheduled_time", "first_token_time",
                                 "finish_time"))
        assert by_id[request_id] == [
            (f"request {request_id}", us(arrival), us(finish)),
            ("queue", us(arrival), us(scheduled)),
            ("prefill", us(scheduled), us(first_token)),
            ("decode", us(first_token), us(finish))]
        pids = {event["pid"] for event in events if event.get("id") == request_id}
        assert pids == {int(row["replica_id"])}


def test_a_disaggregated_request_shows_its_kv_transfer(tmp_path):
    run_experiment(make_cfg("trace_export=true", "cluster=disaggregated",
                            "workload.num_requests=12"), tmp_path)
    events = check_trace_event_format(json.loads((tmp_path / "trace.json").read_text()))
    by_id = slices(events)
    moved = [row for row in read_csv(tmp_path / "requests.csv") if row["kv_transfer_end_time"]]
    assert moved
    for row in moved:
        names = [name for name, _, _ in by_id[int(row["request_id"])]]
        assert names[1:] == ["queue", "prefill", "kv transfer", "decode"]
        (_, start, end), = [entry for entry in by_id[int(row["request_id"])]
                            if entry[0] == "kv transfer"]
        assert (start, end) == (us(row["kv_handoff_time"]), us(row["kv_transfer_end_time"]))


def test_no_trace_by_default(tmp_path):
    run_experiment(make_cfg("workload.num_requests=5"), tmp_path, plots=False)
    assert (tmp_path / "steps.csv").is_file() and not (tmp_path / "trace.json").exists()
