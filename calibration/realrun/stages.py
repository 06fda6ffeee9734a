"""Load stages of a run: the requests that arrived at one arrival rate. A run whose file labels
each request's stage has those; otherwise binary segmentation of a piecewise-constant Poisson
rate splits a stretch of arrivals where the likelihood ratio of two rates against one (2 ΔlogL)
is largest, while it passes SPLIT_THRESHOLD (above what single-rate runs reach:
docs/validation-results.md) and leaves MIN_STAGE_REQUESTS on each side. Bursty (gamma) arrivals
are not Poisson and may split."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIN_STAGE_REQUESTS = 40
SPLIT_THRESHOLD = 25.0


@dataclass
class Stage:
    index: int                 # 0, 1, ... in arrival order
    label: str
    requests: np.ndarray       # indices into the run (arrival order)
    start_s: float             # first and last arrival of the stage's requests
    end_s: float
    arrival_rate: float        # req/s: (requests - 1) / (end_s - start_s); inf if they coincide

    @property
    def num_requests(self) -> int:
        return int(self.requests.size)

    def describe(self) -> dict:
        return {"index": self.index, "label": self.label, "num_requests": self.num_requests,
                "first_request": int(self.requests[0]), "last_request": int(self.requests[-1]),
                "start_s": self.start_s, "end_s": self.end_s,
                "arrival_rate": self.arrival_rate if np.isfinite(self.arrival_rate) else None}


def _arrival_rate(arrivals: np.ndarray) -> float:
    span = float(arrivals[-1] - arrivals[0])
    return (arrivals.size - 1) / span if span > 0 else float("inf")


def _stage(index: int, label: str, requests: np.ndarray, arrival_s: np.ndarray) -> Stage:
    arrivals = arrival_s[requests]
    return Stage(index, label, requests, float(arrivals[0]), float(arrivals[-1]),
                 _arrival_rate(arrivals))


def _poisson_loglik(count: np.ndarray, duration: np.ndarray) -> np.ndarray:
    """Maximised log-likelihood of `count` exponential gaps summing to `duration` at one rate,
    count·log(count/duration) - count (0 for no gaps; coincident arrivals count as 1e-12 s)."""
    count = np.asarray(count, dtype=np.float64)
    duration = np.maximum(np.asarray(duration, dtype=np.float64), 1e-12)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(count > 0, count * np.log(np.maximum(count, 1.0) / duration) - count, 0.0)


def best_split(arrival_s: np.ndarray, first: int, stop: int,
               min_requests: int = MIN_STAGE_REQUESTS) -> tuple[int | None, float]:
    """(request index where a second rate starts, its 2 ΔlogL) within requests [first, stop),
    or (None, 0) when no split leaves min_requests on each side; a split at k gives the gap
    before k to the first side."""
    if stop - first < 2 * min_requests:
        return None, 0.0
    gaps = np.diff(arrival_s[first:stop])
    cumulative = np.concatenate([[0.0], np.cumsum(gaps)])
    splits = np.arange(min_requests, stop - first - min_requests + 1)
    total = _poisson_loglik(gaps.size, cumulative[-1])
    statistic = 2.0 * (_poisson_loglik(splits, cumulative[splits]) +
                       _poisson_loglik(gaps.size - splits, cumulative[-1] - cumulative[splits])
                       - total)
    best = int(np.argmax(statistic))
    return first + int(splits[best]), float(statistic[best])


def detect_boundaries(arrival_s: np.ndarray, min_requests: int = MIN_STAGE_REQUESTS,
                      threshold: float = SPLIT_THRESHOLD) -> list[int]:
    """The first request of every stage after the first, ascending (binary segmentation)."""
    boundaries: list[int] = []
    pending = [(0, int(arrival_s.size))]
    while pending:
        first, stop = pending.pop()
        split, statistic = best_split(arrival_s, first, stop, min_requests)
        if split is not None and statistic > threshold:
            boundaries.append(split)
            pending += [(first, split), (split, stop)]
    return sorted(boundaries)


def find_stages(arrival_s: np.ndarray, labels: list[str] | None = None) -> list[Stage]:
    """The run's stages: by its labels when it has them, else detected in its arrival times."""
    if labels is not None:
        labels_array = np.asarray(labels, dtype=object)
        first_seen: dict[str, int] = {}
        for index, label in enumerate(labels):
            first_seen.setdefault(label, index)
        ordered = sorted(first_seen, key=first_seen.get)
        return [_stage(i, label, np.flatnonzero(labels_array == label), arrival_s)
                for i, label in enumerate(ordered)]
    edges = [0, *detect_boundaries(arrival_s), int(arrival_s.size)]
    return [_stage(i, f"stage {i + 1}", np.arange(first, stop), arrival_s)
            for i, (first, stop) in enumerate(zip(edges, edges[1:]))]
