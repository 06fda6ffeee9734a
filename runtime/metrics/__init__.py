"""Run metrics, named as `vllm bench serve` names them where it has a name (TTFT, TPOT, ITL, E2EL
in ms; throughputs per second of simulated time).

`recorder`: what a run records on the hot path (StepRecorder, MetricsCollector, STEP_COLUMNS);
`summary`: the run's headline numbers from it; `statistics`: the per-request arithmetic both use;
`streaming`: a long run's running totals and quantile sketches, its requests dropped as they go.
Writing the files and plots and printing the table are sim/tools' (run_outputs, plots,
console_summary): nothing here imports sim/tools.
"""
from runtime.metrics.recorder import STEP_COLUMNS, MetricsCollector, StepRecorder
from runtime.metrics.statistics import (
    GROUP_LATENCY_KEYS, LATENCY_METRICS, PERCENTILES, group_summaries, is_completed, jain_fairness,
    latency_arrays_s, meets_slos, rejection_summary, request_latencies_s, request_slos_ms,
    service_tokens, weighted_percentiles)
from runtime.metrics.summary import run_summary

__all__ = ["GROUP_LATENCY_KEYS", "LATENCY_METRICS", "PERCENTILES", "STEP_COLUMNS",
           "MetricsCollector", "StepRecorder", "group_summaries", "is_completed", "jain_fairness",
           "latency_arrays_s", "meets_slos", "rejection_summary", "request_latencies_s",
           "request_slos_ms", "run_summary", "service_tokens", "weighted_percentiles"]
