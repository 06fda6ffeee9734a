"""Per-stage metrics of a run, real or simulated, and their comparison: mean, median and p99 of
TTFT, TPOT and E2E in ms under `vllm bench serve`'s names, and throughput over the stage's own
window (first arrival to last completion).

A stage is **overloaded** when its TTFT grows against arrival time by at least OVERLOAD_SLOPE
(0.1 s per s: the server completes 10 % fewer requests than arrive, so the queue grows without
bound), while a stable server's TTFT fluctuates around a level; the sides disagree when one is
overloaded and the other is not."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from calibration.validate.compare import error_pct

LATENCIES = ("ttft", "tpot", "e2el")
STATS = ("mean", "median", "p99")
METRICS = (*(f"{stat}_{name}_ms" for name in LATENCIES for stat in STATS),
           "request_throughput", "output_throughput", "completed")
OVERLOAD_SLOPE = 0.1


@dataclass
class Latencies:
    """Per-request arrival (s), output length and TTFT, TPOT, E2E (s; NaN where missing: a
    one-token output's TPOT, a request the simulator did not complete), in the run's order."""
    arrival_s: np.ndarray
    output_len: np.ndarray
    ttft_s: np.ndarray
    tpot_s: np.ndarray
    e2e_s: np.ndarray

    @classmethod
    def of_run(cls, run) -> "Latencies":
        return cls(run.arrival_s, run.output_len, run.ttft_s, run.tpot_s, run.e2e_s)

    @classmethod
    def of_requests(cls, requests) -> "Latencies":
        """The simulator's requests (policies.types.Request, the run's order): TTFT = first
        token - arrival, E2E = finish - arrival, TPOT = (finish - first) / (tokens - 1)."""
        def times(name):
            return np.array([np.nan if getattr(r, name) is None or r.rejected_reason is not None
                             else getattr(r, name) for r in requests], dtype=np.float64)
        arrival = np.array([r.arrival_time for r in requests], dtype=np.float64)
        first, finish = times("first_token_time"), times("finish_time")
        tokens = np.array([r.num_output_tokens_per_sample for r in requests], dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            tpot = np.where(tokens > 1, (finish - first) / (tokens - 1), np.nan)
        return cls(arrival, np.array([r.output_len for r in requests]), first - arrival, tpot,
                   finish - arrival)


def _stats_ms(values_s: np.ndarray, name: str) -> dict[str, float | None]:
    values = values_s[np.isfinite(values_s)] * 1000.0
    if values.size == 0:
        return {f"{stat}_{name}_ms": None for stat in STATS}
    return {f"mean_{name}_ms": float(values.mean()),
            f"median_{name}_ms": float(np.median(values)),
            f"p99_{name}_ms": float(np.percentile(values, 99))}


def ttft_slope(arrival_s: np.ndarray, ttft_s: np.ndarray) -> float:
    """Least-squares slope of TTFT against arrival time (s per s); 0 for fewer than 3 requests
    or arrivals that all coincide."""
    keep = np.isfinite(ttft_s)
    x, y = arrival_s[keep], ttft_s[keep]
    if x.size < 3 or np.ptp(x) == 0:
        return 0.0
    x = x - x.mean()
    return float(np.dot(x, y - y.mean()) / np.dot(x, x))


def stage_metrics(latencies: Latencies, requests: np.ndarray) -> dict:
    """METRICS of the requests `requests` (indices) plus ttft_slope and overloaded."""
    arrival = latencies.arrival_s[requests]
    e2e = latencies.e2e_s[requests]
    done = np.isfinite(e2e)
    metrics: dict = {}
    for name, values in (("ttft", latencies.ttft_s), ("tpot", latencies.tpot_s),
                         ("e2el", latencies.e2e_s)):
        metrics.update(_stats_ms(values[requests], name))
    window = float((arrival[done] + e2e[done]).max() - arrival.min()) if done.any() else 0.0
    completed = int(done.sum())
    output_tokens = float(latencies.output_len[requests][done].sum())
    metrics["request_throughput"] = completed / window if window > 0 else 0.0
    metrics["output_throughput"] = output_tokens / window if window > 0 else 0.0
    metrics["completed"] = completed
    slope = ttft_slope(arrival, latencies.ttft_s[requests])
    metrics["ttft_slope"] = slope
    metrics["overloaded"] = bool(slope >= OVERLOAD_SLOPE)
    return metrics


def compare_stage(real: dict, sim: dict) -> dict:
    """{"real", "sim", "error_pct": {metric: signed (sim - real) / real %}, "overloaded":
    {"real", "sim", "disagree"}}; an error is None where either side has no value."""
    errors = {name: (None if real[name] is None or sim[name] is None
                     else error_pct(real[name], sim[name])) for name in METRICS}
    return {"real": real, "sim": sim, "error_pct": errors,
            "overloaded": {"real": real["overloaded"], "sim": sim["overloaded"],
                           "disagree": real["overloaded"] != sim["overloaded"]}}
