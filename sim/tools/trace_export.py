"""A run's schedule as a Chrome trace (`trace_export=true` writes trace.json), which Perfetto and
chrome://tracing load: per replica a process whose steps are complete events, and per request a
nestable async slice from arrival to finish holding its phases (queue, prefill, kv transfer,
decode); a rejected request is an instant event. Times are simulated microseconds."""
from __future__ import annotations

import json
from pathlib import Path

from policies.types import Request

STEPS_THREAD, REQUESTS_THREAD = 0, 1
# Step columns that locate the step rather than count what it did.
STEP_PLACE_COLUMNS = ("replica_id", "start_time", "duration")


def microseconds(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def step_name(counts: dict[str, float]) -> str:
    """What a step ran: prefill, decode, mixed (both), or blocks (only swaps and copies)."""
    prefill, decode = counts["num_prefill_seqs"] > 0, counts["num_decode_seqs"] > 0
    if prefill and decode:
        return "mixed"
    return "prefill" if prefill else "decode" if decode else "blocks"


def step_events(step_rows: list[tuple], step_columns: tuple[str, ...]) -> list[dict]:
    """One complete event per step row, on its replica's steps thread."""
    replica, start, duration = (step_columns.index(name) for name in STEP_PLACE_COLUMNS)
    counted = [(index, name) for index, name in enumerate(step_columns)
               if name not in STEP_PLACE_COLUMNS]
    events = []
    for row in step_rows:
        counts = {name: row[index] for index, name in counted}
        events.append({"name": step_name(counts), "cat": "step", "ph": "X",
                       "ts": microseconds(row[start]), "dur": microseconds(row[duration]),
                       "pid": int(row[replica]), "tid": STEPS_THREAD, "args": counts})
    return events


def request_phases(request: Request) -> list[tuple[str, float, float]]:
    """(phase, start s, end s) of a finished request, in order, each one's end the next one's
    start."""
    times = [("queue", request.arrival_time), ("prefill", request.first_scheduled_time)]
    if request.kv_transfer_end_time is not None:   # disaggregated: prefill, copy, then decode
        times += [("kv transfer", request.kv_handoff_time),
                  ("decode", request.kv_transfer_end_time)]
    else:
        times.append(("decode", request.first_token_time))
    times = [(name, time) for name, time in times if time is not None]
    ends = [time for _, time in times[1:]] + [request.finish_time]
    return [(name, start, end) for (name, start), end in zip(times, ends)]


def request_events(request: Request, pid: int) -> list[dict]:
    """The request's async slice and its phases, or a rejected request's instant event."""
    args = {"prompt_len": request.prompt_len, "output_len": request.output_len,
            "num_preemptions": request.num_preemptions}
    if request.rejected_reason is not None or request.finish_time is None:
        when = request.finish_time if request.finish_time is not None else request.arrival_time
        return [{"name": f"request {request.request_id} rejected", "cat": "request", "ph": "i",
                 "s": "p", "ts": microseconds(when), "pid": pid, "tid": REQUESTS_THREAD,
                 "args": {**args, "rejected_reason": request.rejected_reason}}]
    common = {"cat": "request", "id": request.request_id, "pid": pid, "tid": REQUESTS_THREAD}
    name = f"request {request.request_id}"
    events = [{"name": name, "ph": "b", "ts": microseconds(request.arrival_time), **common,
               "args": args}]
    for phase, start, end in request_phases(request):
        events.append({"name": phase, "ph": "b", "ts": microseconds(start), **common})
        events.append({"name": phase, "ph": "e", "ts": microseconds(end), **common})
    events.append({"name": name, "ph": "e", "ts": microseconds(request.finish_time), **common})
    return events


def metadata_events(pids: list[int], labels: dict[int, str]) -> list[dict]:
    """Each replica's process name and order, and its two threads' names."""
    events = []
    for pid in pids:
        events += [
            {"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
             "args": {"name": labels.get(pid, f"replica {pid}")}},
            {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
             "args": {"sort_index": pid}},
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": STEPS_THREAD,
             "args": {"name": "steps"}},
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": REQUESTS_THREAD,
             "args": {"name": "requests"}}]
    return events


def trace_events(step_rows: list[tuple], step_columns: tuple[str, ...],
                 requests: list[Request], replica_labels: dict[int, str] | None = None
                 ) -> list[dict]:
    """Every event of the trace: metadata first, then steps and requests in time order (a
    request's own events keep their nesting order at equal times)."""
    steps = step_events(step_rows, step_columns)
    replicas = sorted({event["pid"] for event in steps}
                      | {request.replica_id for request in requests if request.replica_id >= 0})
    labels = dict(replica_labels or {})
    # Requests that never reached a replica (rejected at arrival) get a process of their own.
    unrouted = max(replicas, default=-1) + 1
    if any(request.replica_id < 0 for request in requests):
        replicas.append(unrouted)
        labels[unrouted] = "not routed"
    timed = steps
    for request in requests:
        timed += request_events(request, request.replica_id if request.replica_id >= 0
                                else unrouted)
    timed.sort(key=lambda event: event["ts"])   # stable: nesting order kept
    return metadata_events(replicas, labels) + timed


def write_trace(path: Path, step_rows: list[tuple], step_columns: tuple[str, ...],
                requests: list[Request], replica_labels: dict[int, str] | None = None) -> Path:
    """Write the run's trace.json (the Trace Event Format's JSON object form)."""
    trace = {"traceEvents": trace_events(step_rows, step_columns, requests, replica_labels),
             "displayTimeUnit": "ms",
             "otherData": {"clock": "simulated time", "source": "twinserve"}}
    path = Path(path)
    with open(path, "w") as file:
        json.dump(trace, file, separators=(",", ":"))
    return path
