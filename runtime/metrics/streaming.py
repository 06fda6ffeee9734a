"""A long run's summary in bounded memory: finished requests folded into running totals and
quantile sketches a chunk at a time, then dropped (`RequestLedger`); sums and means stay exact,
percentiles come within RELATIVE_ACCURACY (docs/architecture.md, "Long runs in bounded memory").

`QuantileSketch` is a log-bucket histogram after DDSketch (Masson, Rim and Lee, VLDB 2019): bucket
i = ceil(log(x) / log(gamma)), gamma = (1 + a) / (1 - a), whose representative 2 gamma^i /
(gamma + 1) is within a of every value in it, so its size grows with log(max / min), not the count.
"""
from __future__ import annotations

import copy
import math
import operator
from collections import Counter, defaultdict
from collections.abc import Callable

import numpy as np

from policies.types import Request
from runtime.deadlines import abandonment_counts
from runtime.metrics.statistics import (PERCENTILES, SERVICE_INPUT_WEIGHT,
                                         SERVICE_OUTPUT_WEIGHT, count_rejections, is_completed,
                                         latency_arrays_s, meets_slos)

RELATIVE_ACCURACY = 0.001   # of a sketched percentile
FOLD_CHUNK = 4096           # finished requests held before they are folded and written


class QuantileSketch:
    """Weighted counts of values in log-spaced buckets; values <= 0 are counted apart, as 0."""

    def __init__(self, relative_accuracy: float = RELATIVE_ACCURACY):
        if not 0 < relative_accuracy < 1:
            raise ValueError(f"relative_accuracy must be in (0, 1), got {relative_accuracy!r}")
        self.relative_accuracy = relative_accuracy
        self.gamma = (1 + relative_accuracy) / (1 - relative_accuracy)
        self._log_gamma = math.log(self.gamma)
        self.bucket_counts: dict[int, int] = {}
        self.num_zeros = 0
        self.count = 0
        self.total = 0.0   # the values' weighted sum, for an exact mean

    def add(self, values: np.ndarray, weights: np.ndarray | None = None) -> None:
        values = np.asarray(values, dtype=np.float64)
        weights = (np.ones(values.size, dtype=np.int64) if weights is None
                   else np.asarray(weights, dtype=np.int64))
        if not values.size:
            return
        self.count += int(weights.sum())
        self.total += math.fsum((values * weights).tolist())
        positive = values > 0
        self.num_zeros += int(weights[~positive].sum())
        indices = np.ceil(np.log(values[positive]) / self._log_gamma).astype(np.int64)
        unique, inverse = np.unique(indices, return_inverse=True)
        sums = np.zeros(unique.size, dtype=np.int64)
        np.add.at(sums, inverse, weights[positive])
        counts = self.bucket_counts
        for index, count in zip(unique.tolist(), sums.tolist()):
            counts[index] = counts.get(index, 0) + count

    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0

    def percentiles(self, percentiles: list[float]) -> list[float]:
        """np.percentile's linear interpolation over the buckets' representatives."""
        if not self.count:
            raise ValueError("percentiles of an empty sketch")
        indices = sorted(self.bucket_counts)
        representatives = np.array([0.0] + [2 * self.gamma ** i / (self.gamma + 1)
                                            for i in indices])
        ends = np.cumsum([self.num_zeros] + [self.bucket_counts[i] for i in indices])
        positions = (self.count - 1) * (np.asarray(percentiles, dtype=np.float64) / 100.0)
        below = np.floor(positions)
        fraction = positions - below
        below = below.astype(np.int64)
        above = np.minimum(below + 1, self.count - 1)
        value_below = representatives[np.searchsorted(ends, below, side="right")]
        value_above = representatives[np.searchsorted(ends, above, side="right")]
        return (value_below + (value_above - value_below) * fraction).tolist()

    def stats_ms(self, name: str) -> dict[str, float]:
        """statistics.stats_ms's keys for the sketched values (seconds), in ms."""
        keys = ["mean", *(label for label, _ in PERCENTILES)]
        if not self.count:
            return {f"{stat}_{name}_ms": 0.0 for stat in keys}
        values = [self.mean(), *self.percentiles([pct for _, pct in PERCENTILES])]
        return {f"{stat}_{name}_ms": value * 1000.0 for stat, value in zip(keys, values)}


class RequestTotals:
    """What a run's (or one group's) summary needs of its finished requests, as running totals
    and a sketch per latency."""

    def __init__(self, relative_accuracy: float = RELATIVE_ACCURACY):
        self.num_requests = self.completed = self.rejected = 0
        self.first_arrival = math.inf
        self.last_finish = -math.inf
        self.total_input = self.total_output = self.num_preemptions = 0
        self.cached_tokens = self.host_cached_tokens = 0
        self.has_token_ids = self.has_request_slos = False
        self.num_good = 0
        self.abandonment: Counter = Counter()   # (runtime/deadlines.py)
        self.latencies = {name: QuantileSketch(relative_accuracy)
                          for name in ("ttft", "tpot", "e2el")}
        self.output_tokens_by_replica: dict[int, int] = defaultdict(int)
        self.rejections: dict[str, list] = {}   # kind -> [first reason, count]
        self.num_missing_first_token = 0
        self.first_missing_first_token: int | None = None

    def fold(self, requests: list[Request], slos_ms: dict[str, float] | None) -> None:
        attribute = operator.attrgetter
        self.num_requests += len(requests)
        self.first_arrival = min(self.first_arrival, *map(attribute("arrival_time"), requests))
        completed = [request for request in requests if is_completed(request)]
        self.completed += len(completed)
        self.rejected += len(requests) - list(map(attribute("rejected_reason"),
                                                  requests)).count(None)
        count_rejections(requests, self.rejections)
        if any(request.slo_ttft_ms is not None or request.slo_tpot_ms is not None
               for request in requests):
            self.has_request_slos = True
        self.num_preemptions += sum(map(attribute("num_preemptions"), requests))
        self.abandonment.update(abandonment_counts(requests))
        if not completed:
            return
        missing = [r.request_id for r in completed if r.first_token_time is None]
        if missing:
            self.num_missing_first_token += len(missing)
            if self.first_missing_first_token is None:
                self.first_missing_first_token = missing[0]
            return   # (the run stops with check_first_tokens' error)
        self.last_finish = max(self.last_finish, *map(attribute("finish_time"), completed))
        self.total_input += sum(map(attribute("prompt_len"), completed))
        outputs = list(map(attribute("num_output_tokens"), completed))
        self.total_output += sum(outputs)
        by_replica = self.output_tokens_by_replica
        for replica_id, num_tokens in zip(map(attribute("replica_id"), completed), outputs):
            by_replica[replica_id] += num_tokens
        if any(request.prompt_token_ids is not None for request in requests):
            self.has_token_ids = True
        self.cached_tokens += sum(map(attribute("num_cached_tokens"), completed))
        self.host_cached_tokens += sum(map(attribute("num_host_cached_tokens"), completed))
        for name, values in latency_arrays_s(completed).items():
            self.latencies[name].add(values)
        limits = slos_ms or {}
        self.num_good += sum(1 for request in completed
                             if not (limits or request.slo_ttft_ms is not None
                                     or request.slo_tpot_ms is not None)
                             or meets_slos(request, limits))

    @property
    def service_tokens(self) -> int:
        """The completed requests' service in VTC's weighted tokens (statistics.service_tokens)."""
        return SERVICE_INPUT_WEIGHT * self.total_input + SERVICE_OUTPUT_WEIGHT * self.total_output

    def latency_stats_ms(self, name: str) -> dict[str, float]:
        return self.latencies[name].stats_ms(name)


class RequestLedger:
    """A run's finished requests, kept (`keep`) or written out, folded into `totals` (and per
    tenant and priority) and dropped a chunk at a time."""

    def __init__(self, keep: bool, slos_ms: dict[str, float] | None = None,
                 write_rows: Callable[[list[Request]], None] | None = None,
                 relative_accuracy: float = RELATIVE_ACCURACY):
        self.keep = keep
        self.slos_ms = slos_ms
        self.write_rows = write_rows
        self.relative_accuracy = relative_accuracy
        self.kept: list[Request] = []   # with keep: every finished request
        self.pending: list[Request] = []
        self.totals = RequestTotals(relative_accuracy)
        # Groups are folded only once a second one appears, since a sole group's totals are the
        # run's and folding them again would double the cost.
        self.by_tenant: dict[str, RequestTotals] = {}
        self.by_priority: dict[int, RequestTotals] = {}
        self._sole: dict[str, object] = {}

    def add(self, requests: list[Request]) -> None:
        if self.keep:
            return   # (the run's own list holds them)
        self.pending += requests
        if len(self.pending) >= FOLD_CHUNK:
            self.fold()

    def fold(self) -> None:
        """Fold the pending requests into the totals, write them out and drop them."""
        chunk, self.pending = self.pending, []
        if not chunk:
            return
        if self.write_rows is not None:
            self.write_rows(chunk)
        members = {key: _members(chunk, key) for key in ("tenant", "priority")}
        grouped = {"tenant": self.by_tenant, "priority": self.by_priority}
        for key, groups in grouped.items():
            sole = self._sole.setdefault(key, next(iter(members[key])))
            if not groups and (len(members[key]) > 1 or sole not in members[key]):
                # A second group: the requests folded so far were all the first one's.
                groups[sole] = (copy.deepcopy(self.totals) if self.totals.num_requests
                                else RequestTotals(self.relative_accuracy))
        self.totals.fold(chunk, self.slos_ms)
        for key, groups in grouped.items():
            for value, group in (members[key].items() if groups else ()):
                if value not in groups:
                    groups[value] = RequestTotals(self.relative_accuracy)
                groups[value].fold(group, self.slos_ms)
        for request in chunk:
            # Breaking the request-sequence cycle frees them as the chunk goes, not at the next
            # full collection.
            request.sequences.clear()


def _members(requests: list[Request], key: str) -> dict:
    """The requests by their value of the attribute `key`."""
    members: dict = defaultdict(list)
    for request in requests:
        members[getattr(request, key)].append(request)
    return members
