"""Run metrics: one row per step while the run goes, everything else computed once at the end.

Names and units follow `vllm bench serve` where it has one (TTFT, TPOT, ITL, E2EL in ms;
throughputs per second of simulated time), so the two can be compared side by side.

A summary value that has no data to stand on (no completed request, no step) is 0.0, never NaN:
summary.json must stay valid JSON and scripts must not have to special-case empty runs.

A run whose requests carry more than one tenant (or priority) also gets `per_tenant` (or
`per_priority`): the headline numbers of each group's requests; with more than one tenant,
`jain_fairness` of the service they got. A request's own `slo_ttft_ms` / `slo_tpot_ms` replace
the run's limits for that request wherever SLOs are counted.
"""
from __future__ import annotations

import array
import bisect
import csv
import itertools
import json
import math
import operator
import re
from collections import defaultdict
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table
from rich.text import Text

from policies.protocols import Scheduler
from policies.types import Request, Sequence, StepPlan, StepResult

STEP_COLUMNS: tuple[str, ...] = (
    "replica_id", "start_time", "duration",
    "num_seqs", "num_prefill_seqs", "num_prefill_tokens", "num_decode_seqs", "num_batched_tokens",
    "kv_blocks_used", "kv_slots_allocated", "kv_tokens_stored",
    "num_waiting", "num_running", "num_swapped",
    "num_preempted_recompute", "num_preempted_swap",
    "num_blocks_swapped_out", "num_blocks_swapped_in", "num_blocks_copied",
    "num_draft_tokens", "num_accepted_tokens",
    "num_blocks_offloaded", "num_blocks_loaded",
)

REQUEST_COLUMNS: tuple[str, ...] = (
    "request_id", "replica_id", "arrival_time", "prompt_len", "output_len", "n",
    "num_output_tokens", "first_scheduled_time", "first_token_time", "finish_time",
    "ttft_ms", "tpot_ms", "e2el_ms", "num_preemptions", "rejected_reason",
    "priority", "tenant", "slo_ttft_ms", "slo_tpot_ms", "predicted_output_len",
    "prefill_replica_id", "kv_handoff_time", "kv_transfer_start_time", "kv_transfer_end_time",
    "kv_transfer_bytes",
)

LATENCY_METRICS: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")
PERCENTILES: tuple[tuple[str, float], ...] = (("median", 50.0), ("p90", 90.0), ("p99", 99.0))
# What each per_tenant / per_priority entry holds of a group's latencies (ms).
GROUP_LATENCY_KEYS: tuple[str, ...] = tuple(
    f"{stat}_{name}_ms" for name in ("ttft", "tpot", "e2el") for stat in ("mean", "median", "p99"))
# VTC's service weights (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024):
# an output token costs twice an input token, roughly its share of the work.
SERVICE_INPUT_WEIGHT, SERVICE_OUTPUT_WEIGHT = 1, 2

_COL = {name: index for index, name in enumerate(STEP_COLUMNS)}


# ---- per-request latencies ----------------------------------------------------------------------

def is_completed(request: Request) -> bool:
    return request.finish_time is not None and request.rejected_reason is None


def request_latencies_s(request: Request) -> tuple[float | None, float | None, float | None]:
    """(TTFT, TPOT, E2EL) in seconds; None where the request has no such value."""
    ttft = tpot = e2el = None
    if request.first_token_time is not None:
        ttft = request.first_token_time - request.arrival_time
    if request.finish_time is not None:
        e2el = request.finish_time - request.arrival_time
        tokens = request.num_output_tokens_per_sample
        if request.first_token_time is not None and tokens > 1:
            tpot = (request.finish_time - request.first_token_time) / (tokens - 1)
    return ttft, tpot, e2el


def latency_arrays_s(requests: list[Request]) -> dict[str, np.ndarray]:
    """TTFT, TPOT and E2EL of the completed requests, in seconds, keyed "ttft", "tpot", "e2el".
    TPOT leaves out requests whose samples have a single token (nothing to divide by). Computed
    as arrays over the requests (one pass per attribute): a big run's summary spends a good part
    of its time here otherwise; the same numbers as `request_latencies_s`, request by request."""
    completed = [request for request in requests if is_completed(request)]
    first_token_times = [request.first_token_time for request in completed]
    if None in first_token_times:   # (no run of the simulator leaves one so): request by request
        return _latency_arrays_one_by_one(completed)
    count = len(completed)
    arrival = np.fromiter(map(operator.attrgetter("arrival_time"), completed), np.float64, count)
    finish = np.fromiter(map(operator.attrgetter("finish_time"), completed), np.float64, count)
    first_token = np.asarray(first_token_times, dtype=np.float64)
    tokens = np.fromiter(map(operator.attrgetter("num_output_tokens_per_sample"), completed),
                         np.int64, count)
    has_tpot = tokens > 1
    return {"ttft": first_token - arrival,
            "tpot": (finish[has_tpot] - first_token[has_tpot]) / (tokens[has_tpot] - 1),
            "e2el": finish - arrival}


def _latency_arrays_one_by_one(completed: list[Request]) -> dict[str, np.ndarray]:
    """latency_arrays_s of completed requests, from `request_latencies_s` of each."""
    ttfts, tpots, e2els = [], [], []
    for request in completed:
        ttft, tpot, e2el = request_latencies_s(request)
        if ttft is not None:
            ttfts.append(ttft)
        if tpot is not None:
            tpots.append(tpot)
        e2els.append(e2el)
    return {"ttft": np.asarray(ttfts, dtype=np.float64),
            "tpot": np.asarray(tpots, dtype=np.float64),
            "e2el": np.asarray(e2els, dtype=np.float64)}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def request_rows(requests: list[Request]) -> list[tuple]:
    """One tuple per request, in REQUEST_COLUMNS order; None (an empty CSV cell) where a value
    does not exist, e.g. the TTFT of a rejected request."""
    rows = []
    for request in requests:
        ttft, tpot, e2el = request_latencies_s(request)
        rows.append((
            request.request_id, request.replica_id, request.arrival_time, request.prompt_len,
            request.output_len, request.n, request.num_output_tokens,
            request.first_scheduled_time, request.first_token_time, request.finish_time,
            _ms(ttft), _ms(tpot), _ms(e2el), request.num_preemptions, request.rejected_reason,
            request.priority, request.tenant, request.slo_ttft_ms, request.slo_tpot_ms,
            request.predicted_output_len, request.prefill_replica_id, request.kv_handoff_time,
            request.kv_transfer_start_time, request.kv_transfer_end_time,
            request.kv_transfer_bytes,
        ))
    return rows


# ---- statistics ---------------------------------------------------------------------------------

def _stats_ms(values_s: np.ndarray, name: str) -> dict[str, float]:
    """mean/median/p90/p99 of `values_s` (seconds) in ms, keyed like vllm ("mean_ttft_ms")."""
    if values_s.size == 0:
        return {f"{stat}_{name}_ms": 0.0 for stat in ("mean", *(label for label, _ in PERCENTILES))}
    values_ms = values_s * 1000.0
    stats = {f"mean_{name}_ms": float(values_ms.mean())}
    for label, pct in PERCENTILES:
        stats[f"{label}_{name}_ms"] = float(np.percentile(values_ms, pct))
    return stats


def weighted_percentiles(values: np.ndarray, counts: np.ndarray,
                         percentiles: list[float] | np.ndarray) -> np.ndarray:
    """Percentiles of the multiset where values[i] occurs counts[i] times, equal to
    np.percentile(np.repeat(values, counts), percentiles) (linear interpolation) without
    materialising the repeat, which can be billions of tokens long."""
    values = np.asarray(values, dtype=np.float64)
    counts = np.asarray(counts, dtype=np.int64)
    keep = counts > 0
    values, counts = values[keep], counts[keep]
    order = np.argsort(values, kind="stable")
    values, counts = values[order], counts[order]
    # ends[i] is one past the last position of values[i] in the sorted, expanded list.
    if counts.size == 0:
        raise ValueError("weighted_percentiles of an empty multiset")
    ends = np.cumsum(counts)
    total = int(ends[-1])
    # numpy's "linear" method: virtual index h = (N - 1) * q, interpolate between floor and ceil.
    positions = (total - 1) * (np.asarray(percentiles, dtype=np.float64) / 100.0)
    below = np.floor(positions)
    fraction = positions - below
    below = below.astype(np.int64)
    above = np.minimum(below + 1, total - 1)
    value_below = values[np.searchsorted(ends, below, side="right")]
    value_above = values[np.searchsorted(ends, above, side="right")]
    # The same two-sided lerp as numpy's, so results match it to the last bit.
    difference = value_above - value_below
    return np.where(fraction >= 0.5, value_above - difference * (1.0 - fraction),
                    value_below + difference * fraction)


def _histogram_stats_ms(itl_counts: dict[float, int], name: str) -> dict[str, float]:
    total = sum(itl_counts.values())
    if total == 0:
        return _stats_ms(np.empty(0), name)
    values_ms = np.fromiter(itl_counts.keys(), dtype=np.float64, count=len(itl_counts)) * 1000.0
    counts = np.fromiter(itl_counts.values(), dtype=np.int64, count=len(itl_counts))
    stats = {f"mean_{name}_ms": float(np.dot(values_ms, counts) / total)}
    results = weighted_percentiles(values_ms, counts, [pct for _, pct in PERCENTILES])
    for (label, _), value in zip(PERCENTILES, results):
        stats[f"{label}_{name}_ms"] = float(value)
    return stats


def _per_second(amount: float, duration_s: float) -> float:
    return amount / duration_s if duration_s > 0 else 0.0


def rejection_summary(requests: list[Request]) -> dict:
    """For a run that rejected requests, why: the most common kind of rejection (reasons alike
    but for their numbers), the first such request's reason and how many requests it covers;
    and `rejected_by_reason`, every kind (its numbers written #) with its count, most first."""
    kinds: dict[str, list] = {}
    for request in requests:
        if request.rejected_reason is not None:
            kind = re.sub(r"\d+", "#", request.rejected_reason)
            kinds.setdefault(kind, [request.rejected_reason, 0])[1] += 1
    if not kinds:
        return {}
    reason, count = max(kinds.values(), key=lambda example_count: example_count[1])
    by_reason = sorted(kinds.items(), key=lambda kind_count: (-kind_count[1][1], kind_count[0]))
    return {"rejected_reason": reason, "rejected_reason_count": count,
            "rejected_by_reason": {kind: kind_count for kind, (_, kind_count) in by_reason}}


def request_slos_ms(request: Request, slos_ms: dict[str, float] | None) -> dict[str, float]:
    """The limits (ms) `request` is held to: the run's, with its own TTFT / TPOT SLOs in place."""
    limits = dict(slos_ms or {})
    if request.slo_ttft_ms is not None:
        limits["ttft"] = request.slo_ttft_ms
    if request.slo_tpot_ms is not None:
        limits["tpot"] = request.slo_tpot_ms
    return limits


def meets_slos(request: Request, slos_ms: dict[str, float] | None) -> bool:
    """Whether a completed request met every limit it is held to."""
    ttft, tpot, e2el = map(_ms, request_latencies_s(request))
    latencies_ms = {"ttft": ttft, "tpot": tpot, "e2el": e2el}
    # A request without a TPOT (single-token samples) cannot miss a TPOT SLO.
    return all(latencies_ms[name] is None or latencies_ms[name] <= limit
               for name, limit in request_slos_ms(request, slos_ms).items())


def service_tokens(request: Request) -> int:
    """The service a completed request got, in VTC's weighted tokens; 0 for any other."""
    if not is_completed(request):
        return 0
    return (SERVICE_INPUT_WEIGHT * request.prompt_len
            + SERVICE_OUTPUT_WEIGHT * request.num_output_tokens)


def jain_fairness(values: list[float]) -> float:
    """Jain's index (sum x)^2 / (n * sum x^2): 1.0 when all are equal, 1/n when one has it all;
    0.0 when nobody got anything (no data, the module's convention)."""
    squares = math.fsum(value * value for value in values)
    return math.fsum(values) ** 2 / (len(values) * squares) if squares else 0.0


def _group_summary(requests: list[Request], duration_s: float,
                   slos_ms: dict[str, float] | None, has_slos: bool) -> dict:
    """One group's numbers; throughputs over the whole run's duration, so that the groups'
    throughputs add up to the run's."""
    completed = [request for request in requests if is_completed(request)]
    result: dict = {
        "completed": len(completed),
        "request_throughput": _per_second(len(completed), duration_s),
        "output_throughput": _per_second(sum(request.num_output_tokens for request in completed),
                                         duration_s),
    }
    latencies = latency_arrays_s(completed)
    stats = {}
    for name in ("ttft", "tpot", "e2el"):
        stats.update(_stats_ms(latencies[name], name))
    result.update({key: stats[key] for key in GROUP_LATENCY_KEYS})
    if has_slos:
        num_good = sum(1 for request in completed if meets_slos(request, slos_ms))
        result["slo_attainment"] = num_good / len(completed) if completed else 0.0
    return result


def group_summaries(requests: list[Request], duration_s: float,
                    slos_ms: dict[str, float] | None, has_slos: bool) -> dict:
    """`per_tenant` with more than one tenant (and `jain_fairness` over them), `per_priority`
    with more than one priority; nothing for a run of one of each."""
    by_tenant: dict[str, list[Request]] = defaultdict(list)
    by_priority: dict[int, list[Request]] = defaultdict(list)
    for request in requests:
        by_tenant[request.tenant].append(request)
        by_priority[request.priority].append(request)
    result: dict = {}
    if len(by_tenant) > 1:
        result["per_tenant"] = {str(tenant): _group_summary(by_tenant[tenant], duration_s,
                                                            slos_ms, has_slos)
                                for tenant in sorted(by_tenant, key=str)}
    if len(by_priority) > 1:
        result["per_priority"] = {str(priority): _group_summary(by_priority[priority],
                                                                duration_s, slos_ms, has_slos)
                                  for priority in sorted(by_priority)}
    if len(by_tenant) > 1:
        result["jain_fairness"] = jain_fairness(
            [float(sum(map(service_tokens, group))) for group in by_tenant.values()])
    return result


# ---- the collector ------------------------------------------------------------------------------

class MetricsCollector:
    """Collects step rows and ITL histograms from every replica of a run, and turns them plus the
    run's requests into a summary, CSV files and plots."""

    def __init__(self, kv_bytes_per_block: int = 0):
        self.kv_bytes_per_block = kv_bytes_per_block
        # replica_id -> its name in the plots' legends (a cluster of pools names its pool).
        self.replica_labels: dict[int, str] = {}
        self.step_rows: list[tuple] = []
        self.itl_counts: dict[float, int] = {}

    def record_step(self, replica_id: int, start_time: float, plan: StepPlan, duration: float, *,
                    kv_blocks_used: int, kv_slots_allocated: int, kv_tokens_stored: int,
                    num_waiting: int, num_running: int, num_swapped: int,
                    num_accepted_tokens: int = 0) -> None:
        """Append one row, in STEP_COLUMNS order. Called every step of every replica, so it only
        appends a tuple: all per-step analysis happens once, in summary().
        `num_accepted_tokens`: the step's accepted drafts (speculative decoding)."""
        self.step_rows.append((
            replica_id, start_time, duration,
            len(plan.seqs), plan.num_prefill_seqs, plan.num_prefill_tokens, plan.num_decode_seqs,
            plan.num_prefill_tokens + plan.num_decode_seqs + plan.num_draft_tokens,
            kv_blocks_used, kv_slots_allocated, kv_tokens_stored,
            num_waiting, num_running, num_swapped,
            len(plan.preempted_recompute), len(plan.preempted_swap),
            len(plan.blocks_to_swap_out), len(plan.blocks_to_swap_in), len(plan.blocks_to_copy),
            plan.num_draft_tokens, num_accepted_tokens,
            len(plan.blocks_to_offload), len(plan.blocks_to_load),
        ))

    def add_itl_counts(self, itl_counts: dict[float, int]) -> None:
        """Merge one scheduler's ITL histogram {seconds: number of tokens}."""
        merged = self.itl_counts
        if not merged:
            merged.update(itl_counts)   # the first (or only) replica's: in one C call
            return
        for itl, count in itl_counts.items():
            merged[itl] = merged.get(itl, 0) + count

    def step_totals(self) -> dict[str, int]:
        """Each STEP_COLUMNS count summed over every recorded step."""
        totals = self.step_array().sum(axis=0)
        return {name: int(totals[index]) for name, index in _COL.items()}

    def order_steps_by_start(self) -> None:
        """Put the step rows in order of their start time (a replica records a run of repeated
        steps at once, ahead of other replicas' steps in between; ties keep their order)."""
        self.step_rows.sort(key=operator.itemgetter(1))

    def step_array(self) -> np.ndarray:
        """The step rows as a (num_steps, len(STEP_COLUMNS)) float array."""
        if not self.step_rows:
            return np.empty((0, len(STEP_COLUMNS)), dtype=np.float64)
        return np.asarray(self.step_rows, dtype=np.float64)

    def step_column(self, name: str) -> np.ndarray:
        """One of STEP_COLUMNS over the steps, as a float array (the values of step_array's
        column, without building the whole array)."""
        index = _COL[name]
        return np.fromiter(map(operator.itemgetter(index), self.step_rows), dtype=np.float64,
                           count=len(self.step_rows))

    def step_column_total(self, name: str) -> int:
        """The sum of one of STEP_COLUMNS' counts over the steps (an integer: no float array
        is built for it)."""
        return int(sum(map(operator.itemgetter(_COL[name]), self.step_rows)))

    def summary(self, requests: list[Request], wall_time_s: float,
                slos_ms: dict[str, float] | None = None) -> dict:
        """The run's headline numbers; see the module docstring for the empty-run convention.

        `slos_ms` (optional), e.g. {"ttft": 200, "tpot": 50, "e2el": 10_000}: adds `goodput`
        (req/s of completed requests meeting every given SLO, as vllm defines it) and
        `slo_attainment` (their fraction of completed requests); so do requests' own SLOs, which
        replace the run's limits for their request."""
        # (Sums over the requests in C passes: a big run's summary is a share of its time.)
        attribute = operator.attrgetter
        completed = [request for request in requests if is_completed(request)]
        num_rejected = len(requests) - list(map(attribute("rejected_reason"), requests)).count(None)
        if completed:
            first_arrival = min(map(attribute("arrival_time"), requests))
            last_finish = max(map(attribute("finish_time"), completed))
            duration_s = last_finish - first_arrival
        else:
            duration_s = 0.0
        total_input = sum(map(attribute("prompt_len"), completed))
        total_output = sum(map(attribute("num_output_tokens"), completed))

        result: dict = {
            "completed": len(completed),
            "rejected": num_rejected,
            "num_requests": len(requests),
            "duration_s": float(duration_s),
            "total_input_tokens": total_input,
            "total_output_tokens": total_output,
            "request_throughput": _per_second(len(completed), duration_s),
            "output_throughput": _per_second(total_output, duration_s),
            "total_token_throughput": _per_second(total_input + total_output, duration_s),
        }
        latencies = latency_arrays_s(completed)
        for name in LATENCY_METRICS:
            if name == "itl":
                result.update(_histogram_stats_ms(self.itl_counts, name))
            else:
                result.update(_stats_ms(latencies[name], name))
        has_slos = slos_ms is not None or any(
            request.slo_ttft_ms is not None or request.slo_tpot_ms is not None
            for request in requests)
        if has_slos:
            result.update(self._goodput(completed, slos_ms or {}, duration_s))

        column, total = self.step_column, self.step_column_total
        allocated = column("kv_slots_allocated")
        stored = column("kv_tokens_stored")
        has_slots = allocated > 0
        waste = 1.0 - stored[has_slots] / allocated[has_slots]
        blocks_swapped = total("num_blocks_swapped_out") + total("num_blocks_swapped_in")
        num_drafts = total("num_draft_tokens")
        num_accepted = total("num_accepted_tokens")
        num_decodes = total("num_decode_seqs")
        result.update({
            "num_preemptions": sum(map(attribute("num_preemptions"), requests)),
            "peak_kv_blocks": (int(max(map(operator.itemgetter(_COL["kv_blocks_used"]),
                                           self.step_rows))) if self.step_rows else 0),
            # fsum: the same whatever order the replicas' steps were recorded in.
            "kv_waste_fraction": math.fsum(waste) / waste.size if waste.size else 0.0,
            "swap_bytes": int(blocks_swapped) * self.kv_bytes_per_block,
            "num_steps": len(self.step_rows),
            "wall_time_s": float(wall_time_s),
            # Simulated seconds per wall second: how much faster than real time the run went.
            "sim_speedup": _per_second(duration_s, wall_time_s),
            # Speculative decoding: drafts proposed and accepted, their ratio, and the tokens a
            # decoding sequence gains per step (1 + accepted drafts per decode; 1.0 without).
            "num_draft_tokens": num_drafts,
            "num_accepted_tokens": num_accepted,
            "spec_acceptance_rate": num_accepted / num_drafts if num_drafts else 0.0,
            "mean_tokens_per_decode_step": ((num_decodes + num_accepted) / num_decodes
                                            if num_decodes else 0.0),
        })
        if any(request.prompt_token_ids is not None for request in requests):
            # Prefix caching needs token ids: the share of completed prompts' tokens it served,
            # and of those the device's cache and the host tier's.
            prompt_tokens = sum(request.prompt_len for request in completed)
            cached = sum(request.num_cached_tokens for request in completed)
            host_cached = sum(request.num_host_cached_tokens for request in completed)
            result["prefix_cache_hit_rate"] = cached / prompt_tokens if prompt_tokens else 0.0
            result["prefix_cache_device_hit_rate"] = (
                (cached - host_cached) / prompt_tokens if prompt_tokens else 0.0)
            result["prefix_cache_host_hit_rate"] = (
                host_cached / prompt_tokens if prompt_tokens else 0.0)
        blocks_offloaded = total("num_blocks_offloaded")
        blocks_loaded = total("num_blocks_loaded")
        if blocks_offloaded or blocks_loaded:
            # The prefix cache's host tier: K/V bytes stored there and loaded back.
            result["offload_bytes"] = blocks_offloaded * self.kv_bytes_per_block
            result["reload_bytes"] = blocks_loaded * self.kv_bytes_per_block
        result.update(group_summaries(requests, duration_s, slos_ms, has_slos))
        return result

    @staticmethod
    def _goodput(completed: list[Request], slos_ms: dict[str, float],
                 duration_s: float) -> dict[str, float]:
        unknown = set(slos_ms) - {"ttft", "tpot", "e2el"}
        if unknown:
            raise ValueError(f"unknown SLO metrics {sorted(unknown)}; use ttft, tpot, e2el")
        num_good = sum(1 for request in completed if meets_slos(request, slos_ms))
        return {"goodput": _per_second(num_good, duration_s),
                "slo_attainment": num_good / len(completed) if completed else 0.0}

    def write_outputs(self, out_dir: Path, requests: list[Request], summary: dict,
                      plots: bool = True) -> list[Path]:
        """Write summary.json, requests.csv, steps.csv and (unless plots=False) the PNG plots
        into out_dir. Returns the paths written."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        summary_path = out_dir / "summary.json"
        # allow_nan=False: fail loudly here rather than write JSON other tools cannot parse.
        summary_path.write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
        requests_path = _write_csv(out_dir / "requests.csv", REQUEST_COLUMNS,
                                   request_rows(requests))
        steps_path = _write_csv(out_dir / "steps.csv", STEP_COLUMNS, self.step_rows)
        written = [summary_path, requests_path, steps_path]
        if plots:
            # Imported here so that runs that never plot never import matplotlib.
            from sim.tools.plots import kv_block_capacities, write_plots
            written += write_plots(out_dir, requests, self.step_rows, STEP_COLUMNS,
                                   self.replica_labels, kv_block_capacities(summary))
        return written


class StepRecorder:
    """What one replica's steps leave in a run's metrics, recorded by the step loop
    (sim/core/step.py) on both backends: a row per step in the MetricsCollector, and the replica's
    inter-token latencies as a histogram {seconds: tokens} (a float per token is too much memory
    for a 100k-request run, and most tokens of a step share one value).

    The latencies are logged as they arise, (seconds, tokens) pairs side by side in two arrays,
    and counted into the histogram when it is read (`itl_counts`) or the log grows long: a dict
    update for every step of a run of repeated steps cost more than the rest of its row."""

    MAX_LOGGED_ITLS = 1 << 22   # pairs logged before they are counted (16 bytes each)

    def __init__(self, metrics: MetricsCollector, replica_id: int = 0):
        self.metrics = metrics
        self.replica_id = replica_id
        self._itl_counts: dict[float, int] = {}
        self._logged_itls = array.array("d")
        self._logged_tokens = array.array("q")

    @property
    def itl_counts(self) -> dict[float, int]:
        """{seconds: tokens} of every inter-token latency recorded so far, the latencies in the
        order they first arose."""
        if self._logged_itls:
            self._count_logged_itls()
        return self._itl_counts

    def _count_logged_itls(self) -> None:
        """Add the logged pairs to the histogram as one dict update per pair, in order, would."""
        latencies = np.frombuffer(self._logged_itls, dtype=np.float64)
        tokens = np.frombuffer(self._logged_tokens, dtype=np.int64)
        values, first_index, inverse = np.unique(latencies, return_index=True,
                                                 return_inverse=True)
        totals = np.zeros(values.size, dtype=np.int64)
        np.add.at(totals, inverse, tokens)
        order = np.argsort(first_index)   # the order a dict would have inserted them in
        new_counts = zip(values[order].tolist(), totals[order].tolist())
        if self._itl_counts:
            counts = self._itl_counts
            for latency, total in new_counts:
                counts[latency] = counts.get(latency, 0) + total
        else:
            self._itl_counts = dict(new_counts)
        self._logged_itls, self._logged_tokens = array.array("d"), array.array("q")

    def record_step(self, start_time: float, plan: StepPlan, result: StepResult,
                    scheduler: Scheduler) -> None:
        """The step's row: its plan, and memory and queues as they stand during the step
        (before its finished requests leave)."""
        self._record_row(start_time, plan, result.duration, scheduler,
                         sum(result.num_accepted.values()) if result.num_accepted else 0)

    def _record_row(self, start_time: float, plan: StepPlan, duration: float,
                    scheduler: Scheduler, num_accepted_tokens: int = 0) -> None:
        kv_cache = scheduler.kv_cache
        waiting, running, swapped = scheduler.queue_lengths()
        self.metrics.record_step(
            self.replica_id, start_time, plan, duration,
            kv_blocks_used=kv_cache.num_used_blocks(),
            kv_slots_allocated=kv_cache.num_slots_allocated(),
            kv_tokens_stored=kv_cache.num_tokens_stored(),
            num_waiting=waiting, num_running=running, num_swapped=swapped,
            num_accepted_tokens=num_accepted_tokens)

    def record_repeated_steps(self, start_time: float, plan: StepPlan, durations: list[float],
                              scheduler: Scheduler) -> None:
        """The rows of a decode batch run len(durations) times in a row, each as its own step's
        row would be: only the start, the duration and the memory columns (one more token
        stored per decode each step, and the blocks they grow into) move, so the first row is
        recorded as any step's and the others are copies of it with those changed. A plan
        whose sequences ran `num_steps_before` steps already (a run's later segment) holds the
        slots of where they stood before those: its first row adds what they grew into since."""
        kv_cache = scheduler.kv_cache
        self._record_row(start_time, plan, durations[0], scheduler)
        rows = self.metrics.step_rows
        row = list(rows[-1])
        start_column, duration_column = _COL["start_time"], _COL["duration"]
        blocks_column = _COL["kv_blocks_used"]
        slots_column, tokens_column = _COL["kv_slots_allocated"], _COL["kv_tokens_stored"]
        block_size, num_decodes = kv_cache.block_size, plan.num_decode_seqs
        first_step = plan.num_steps_before
        # The batch's growth, made once per run (a later segment's scheduler keeps it).
        growth = plan.decode_growth
        if growth is None and hasattr(kv_cache, "decode_growth"):
            growth = plan.decode_growth = kv_cache.decode_growth(plan.seqs)
        new_blocks = (kv_cache.new_blocks_per_step(plan.seqs, len(durations), first_step)
                      if growth is None else growth.new_blocks_per_step(len(durations), first_step))
        if first_step:
            row[tokens_column] += num_decodes * first_step
            row[blocks_column] += new_blocks[0]
            row[slots_column] += new_blocks[0] * block_size
            rows[-1] = tuple(row)
        for step in range(1, len(durations)):
            start_time += durations[step - 1]
            row[start_column], row[duration_column] = start_time, durations[step]
            row[tokens_column] += num_decodes
            if new_blocks[step]:
                row[blocks_column] += new_blocks[step]
                row[slots_column] += new_blocks[step] * block_size
            rows.append(tuple(row))

    def count_arrivals(self, first_row: int, num_rows: int, arrival_times: list[float]) -> None:
        """Requests that joined the waiting queue during repeated steps (at `arrival_times`, in
        time order): each step row from `first_row` on that started after one counts it waiting,
        as the row of a separate step would."""
        rows, column = self.metrics.step_rows, _COL["num_waiting"]
        for index in range(first_row, first_row + num_rows):
            row = rows[index]
            num_arrived = bisect.bisect_left(arrival_times, row[1])   # they are in time order
            if num_arrived:
                rows[index] = row[:column] + (row[column] + num_arrived,) + row[column + 1:]

    def record_repeated_itls(self, times_before: list[float], step_end_times: list[float]) -> None:
        """Inter-token latencies of a decode batch's repeated steps: in the first, each
        sequence's since its last token; in each later one, the step itself for every sequence."""
        self._add_one_token_each(times_before, step_end_times[0])
        self._logged_itls.extend(map(operator.sub, step_end_times[1:], step_end_times[:-1]))
        self._logged_tokens.extend(itertools.repeat(len(times_before), len(step_end_times) - 1))
        if len(self._logged_itls) > self.MAX_LOGGED_ITLS:
            self._count_logged_itls()

    def _add_one_token_each(self, times_before: list[float], end: float) -> None:
        """One token for each of the (non-empty) sequences that last sampled at `times_before`,
        `end - that time` later. Those that last sampled in one step sit side by side in the batch:
        one run per earlier step (hashing each sequence's time would cost more than its step)."""
        log_itl, log_tokens = self._logged_itls.append, self._logged_tokens.append
        if times_before.count(times_before[0]) == len(times_before):
            log_itl(end - times_before[0])
            log_tokens(len(times_before))
            return
        for last_time, same_time in itertools.groupby(times_before):
            log_itl(end - last_time)
            log_tokens(len(list(same_time)))

    def record_itls(self, seqs: list[Sequence], outputs_before: list[int],
                    times_before: list[float], now: float) -> None:
        """Inter-token latencies of a step that ended at `now`: each sequence that gained tokens
        after its first gained them `now - its last token's time` later (the tokens of one step
        share one time). `outputs_before` and `times_before` are the sequences'
        `num_output_tokens` and `last_token_time` before the step's update."""
        gained = list(map(operator.sub, [seq.num_output_tokens for seq in seqs], outputs_before))
        num_seqs = len(gained)
        if num_seqs and gained.count(1) == num_seqs and 0 not in outputs_before:
            self._add_one_token_each(times_before, now)   # most steps: one token each
        else:
            for before, num_gained, last_time in zip(outputs_before, gained, times_before):
                if before and num_gained:
                    self._logged_itls.append(now - last_time)
                    self._logged_tokens.append(num_gained)
        if len(self._logged_itls) > self.MAX_LOGGED_ITLS:
            self._count_logged_itls()


def _write_csv(path: Path, columns: tuple[str, ...], rows: list[tuple]) -> Path:
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(columns)
        writer.writerows(rows)
    return path


# ---- console output -----------------------------------------------------------------------------

def _fmt(value: float, digits: int = 2) -> str:
    return f"{value:,.{digits}f}" if math.isfinite(value) else str(value)


def format_summary_table(summary: dict) -> Table:
    """Two tables side by side: run totals on the left, latencies (ms) on the right."""
    totals = Table(show_header=False, box=None, pad_edge=False)
    totals.add_column(style="bold")
    totals.add_column(justify="right")
    totals.add_row("completed / rejected", f"{summary['completed']:,} / {summary['rejected']:,}")
    totals.add_row("duration (sim)", f"{_fmt(summary['duration_s'])} s")
    totals.add_row("requests/s", _fmt(summary["request_throughput"]))
    totals.add_row("output tok/s", _fmt(summary["output_throughput"], 1))
    totals.add_row("total tok/s", _fmt(summary["total_token_throughput"], 1))
    if "goodput" in summary:
        totals.add_row("goodput req/s", _fmt(summary["goodput"]))
        totals.add_row("SLO attainment", f"{summary['slo_attainment']:.1%}")
    totals.add_row("preemptions", f"{summary['num_preemptions']:,}")
    totals.add_row("peak KV blocks", f"{summary['peak_kv_blocks']:,}")
    totals.add_row("KV waste", f"{summary['kv_waste_fraction']:.1%}")
    if "prefix_cache_hit_rate" in summary:
        totals.add_row("prefix cache hit rate", f"{summary['prefix_cache_hit_rate']:.1%}")
    if summary.get("swap_bytes"):
        totals.add_row("swapped", f"{summary['swap_bytes'] / 2**20:,.1f} MiB")
    if summary.get("num_draft_tokens"):
        totals.add_row("draft acceptance", f"{summary['spec_acceptance_rate']:.1%}")
        totals.add_row("tokens / decode step", _fmt(summary["mean_tokens_per_decode_step"]))
    if summary.get("num_kv_transfers"):
        totals.add_row("KV transfers", f"{summary['num_kv_transfers']:,} "
                                       f"({summary['kv_transfer_bytes'] / 2**30:,.1f} GiB)")
        totals.add_row("KV transfer ms (p99)", f"{_fmt(summary['mean_kv_transfer_ms'])} "
                                               f"({_fmt(summary['p99_kv_transfer_ms'])})")
    if "jain_fairness" in summary:
        totals.add_row("Jain fairness (tenants)", _fmt(summary["jain_fairness"], 3))
    totals.add_row("steps", f"{summary['num_steps']:,}")
    if "kernel_time_expected_error_pct" in summary:   # (sim/gpu/transfer_errors.py)
        totals.add_row("kernel time expected error",
                       f"±{summary['kernel_time_expected_error_pct']:.1f} %")
    totals.add_row("wall time", f"{_fmt(summary['wall_time_s'])} s")

    latencies = Table(box=None, pad_edge=False)
    latencies.add_column("ms", style="bold")
    for heading in ("mean", "median", "p99"):
        latencies.add_column(heading, justify="right")
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E")):
        latencies.add_row(label, *(_fmt(summary[f"{stat}_{name}_ms"])
                                   for stat in ("mean", "median", "p99")))

    grid = Table.grid(padding=(0, 4))
    grid.add_row(totals, latencies)
    # Below the two tables, not in their columns, which a long line would squeeze and wrap.
    below = [Text(f"rejected because: {summary['rejected_reason']} "
                  f"({summary['rejected_reason_count']:,} like it)")
             ] if summary.get("rejected_reason") else []
    groups = _format_groups(summary)
    below += [groups] if groups is not None else []
    if not below:
        return grid
    stacked = Table.grid(padding=(1, 0))
    stacked.add_row(grid)
    for part in below:
        stacked.add_row(part)
    return stacked


def _format_groups(summary: dict) -> Table | None:
    """A row per tenant and per priority, when the summary has them; else None."""
    sections = [(label, summary[key]) for key, label in (("per_tenant", "tenant"),
                                                         ("per_priority", "priority"))
                if key in summary]
    if not sections:
        return None
    has_slos = any("slo_attainment" in group for _, groups in sections
                   for group in groups.values())
    table = Table(box=None, pad_edge=False)
    table.add_column("group", style="bold")
    for heading in ("done", "req/s", "TTFT p99", "TPOT p99", "E2E p99"):
        table.add_column(heading, justify="right")
    if has_slos:
        table.add_column("SLO", justify="right")
    for label, groups in sections:
        for name, group in groups.items():
            row = [f"{label} {name}", f"{group['completed']:,}",
                   _fmt(group["request_throughput"]), _fmt(group["p99_ttft_ms"]),
                   _fmt(group["p99_tpot_ms"]), _fmt(group["p99_e2el_ms"])]
            if has_slos:
                row.append(f"{group['slo_attainment']:.1%}")
            table.add_row(*row)
    return table


def print_summary(summary: dict, console: Console | None = None) -> None:
    (console or Console()).print(format_summary_table(summary))
