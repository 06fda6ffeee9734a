"""twinserve-serve's GET /metrics in Prometheus' text format, under vLLM's metric names so that
a dashboard made for `vllm serve` reads twinserve-serve unchanged. The engine thread records
(ServingStats.observe_*); the HTTP handler renders."""
from __future__ import annotations

import bisect
import threading
import time
from dataclasses import dataclass, field

# Histogram bucket upper bounds (s), as vLLM's v1 logger sets them.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                  5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                  7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)   # per bound, not cumulative; last: +Inf
    total: float = 0.0

    def __post_init__(self):
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def lines(self, name: str, labels: str) -> list[str]:
        lines, cumulative = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts):
            cumulative += count
            le = "+Inf" if bound == float("inf") else repr(float(bound))
            lines.append(f'{name}_bucket{{{labels},le="{le}"}} {cumulative}')
        lines.append(f"{name}_sum{{{labels}}} {self.total!r}")
        lines.append(f"{name}_count{{{labels}}} {cumulative}")
        return lines


class ServingStats:
    """What /metrics reports; written by the engine thread, read by the HTTP handlers."""

    def __init__(self):
        self._lock = threading.Lock()
        self.num_running = 0
        self.num_waiting = 0            # waiting and swapped out, as vLLM v1 counts preempted
        self.kv_cache_usage = 0.0       # used / all device blocks, 0..1
        self.num_preemptions = 0        # of the finished requests, counted when each ends
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        # Samples by vLLM's finish reason; "abort": a client that went away or a timeout_s that
        # passed (vLLM counts a request its client aborted there, and has no deadline of its own).
        self.num_finished = {"stop": 0, "length": 0, "abort": 0}
        self.ttft = Histogram(TTFT_BUCKETS_S)
        self.tpot = Histogram(TPOT_BUCKETS_S)
        self.e2e = Histogram(E2E_BUCKETS_S)

    def observe_engine(self, scheduler) -> None:
        """The scheduler's queues and pool now (between steps)."""
        num_waiting, num_running, num_swapped = scheduler.queue_lengths()
        kv_cache = scheduler.kv_cache
        with self._lock:
            self.num_running = num_running
            self.num_waiting = num_waiting + num_swapped
            self.kv_cache_usage = kv_cache.num_used_blocks() / kv_cache.num_blocks

    def observe_aborted(self, submission) -> None:
        """A request the engine stopped before its end: its client went away, or its timeout_s
        passed (its samples count as finished_reason="abort"; no latency is recorded)."""
        with self._lock:
            self.num_finished["abort"] += submission.params.n

    def observe_finished(self, submission, output) -> None:
        """A request that ran to its end (not rejected, not aborted): its latencies from when
        the server received it. One abandoned (its timeout_s passed) counts as aborted."""
        if output.abandoned:
            self.observe_aborted(submission)
            return
        if output.error is not None:
            return
        now = time.perf_counter()
        num_output_tokens = max((len(sample.token_ids) for sample in output.outputs), default=0)
        with self._lock:
            self.num_preemptions += output.num_preemptions
            self.num_prompt_tokens += len(output.prompt_token_ids or ())
            self.num_generation_tokens += sum(len(sample.token_ids) for sample in output.outputs)
            for sample in output.outputs:
                self.num_finished[sample.finish_reason] = (
                    self.num_finished.get(sample.finish_reason, 0) + 1)
            e2e = now - submission.submitted_at
            self.e2e.observe(e2e)
            if submission.first_token_at is not None:
                ttft = submission.first_token_at - submission.submitted_at
                self.ttft.observe(ttft)
                if num_output_tokens > 1:
                    self.tpot.observe((e2e - ttft) / (num_output_tokens - 1))

    def render(self, model_name: str) -> str:
        """The exposition text, every metric labelled with the served model's name."""
        labels = f'model_name="{_escape(model_name)}"'
        out: list[str] = []

        def metric(name: str, kind: str, help_text: str, lines: list[str]) -> None:
            out.extend((f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *lines))

        with self._lock:
            metric("vllm:num_requests_running", "gauge", "Number of requests in model execution "
                   "batches.", [f"vllm:num_requests_running{{{labels}}} {self.num_running}"])
            metric("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be "
                   "processed.", [f"vllm:num_requests_waiting{{{labels}}} {self.num_waiting}"])
            metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent "
                   "usage.", [f"vllm:kv_cache_usage_perc{{{labels}}} {self.kv_cache_usage!r}"])
            metric("vllm:num_preemptions_total", "counter", "Cumulative number of preemptions of "
                   "the finished requests.",
                   [f"vllm:num_preemptions_total{{{labels}}} {self.num_preemptions}"])
            metric("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
                   [f"vllm:prompt_tokens_total{{{labels}}} {self.num_prompt_tokens}"])
            metric("vllm:generation_tokens_total", "counter",
                   "Number of generation tokens processed.",
                   [f"vllm:generation_tokens_total{{{labels}}} {self.num_generation_tokens}"])
            metric("vllm:request_success_total", "counter",
                   "Count of successfully processed requests (samples), by finish reason.",
                   [f'vllm:request_success_total{{{labels},finished_reason="{reason}"}} {count}'
                    for reason, count in sorted(self.num_finished.items())])
            metric("vllm:time_to_first_token_seconds", "histogram",
                   "Histogram of time to first token in seconds.",
                   self.ttft.lines("vllm:time_to_first_token_seconds", labels))
            metric("vllm:time_per_output_token_seconds", "histogram",
                   "Histogram of time per output token in seconds.",
                   self.tpot.lines("vllm:time_per_output_token_seconds", labels))
            metric("vllm:e2e_request_latency_seconds", "histogram",
                   "Histogram of end to end request latency in seconds.",
                   self.e2e.lines("vllm:e2e_request_latency_seconds", labels))
        return "\n".join(out) + "\n"


def _escape(value: str) -> str:
    """A label value as the text format requires (backslash, quote and newline escaped)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
