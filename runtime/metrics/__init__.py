"""Run metrics, named as `vllm bench serve` names them; writing files and plots is sim/tools'."""
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
