"""The run file `twinserve-bench` writes: the keys of vLLM's `bench serve --save-result
--save-detailed` JSON (aggregates in ms over completed requests, per-request lists in s, in
request order, failures keeping vLLM's placeholders), plus twinserve's own: `start_times`,
`e2els`, `expected_output_lens`, `timeout_s`, `abandoned_times`, `abandoned`, `engine_settings`
and the replayed workload."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (99,)
# The latency metrics, each "name": (vLLM's title, what it is per request).
METRIC_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                 "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


@dataclass
class RequestRecord:
    """What the client saw of one request; times in s since the run began."""

    prompt_len: int
    expected_output_len: int
    start_time: float | None = None          # when it was sent (None: never sent)
    token_times: list[float] = field(default_factory=list)   # each chunk that carried tokens
    num_tokens: int = 0                      # tokens counted in the chunks
    counted_ids: bool = False                # the chunks carried token_ids: num_tokens is exact
    usage_output_tokens: int | None = None   # the server's count, when it sent usage
    generated_text: str = ""
    error: str = ""
    timeout_s: float | None = None           # the deadline it was sent with (None: none)
    abandoned_time: float | None = None      # when the server said its timeout_s passed

    def add_tokens(self, now: float, num_tokens: int) -> None:
        self.token_times.append(now)
        self.num_tokens += num_tokens

    @property
    def output_len(self) -> int:
        """The tokens counted from token_ids, else the server's usage, else the chunks."""
        if self.counted_ids or self.usage_output_tokens is None:
            return self.num_tokens
        return self.usage_output_tokens

    @property
    def success(self) -> bool:
        return (not self.error and self.abandoned_time is None and self.start_time is not None
                and self.output_len > 0)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start_time if self.success else 0.0

    @property
    def e2el(self) -> float:
        return self.token_times[-1] - self.start_time if self.success else 0.0

    @property
    def itls(self) -> list[float]:
        times = self.token_times
        return [b - a for a, b in zip(times, times[1:])] if self.success else []

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for a one-token output."""
        if not self.success or self.output_len < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_len - 1)


def _stats(name: str, values_s: list[float]) -> dict:
    values_ms = np.asarray(values_s, dtype=float) * 1000.0
    if not len(values_ms):
        values_ms = np.zeros(1)   # (vLLM's convention: 0 when there is nothing to measure)
    stats = {f"mean_{name}_ms": float(values_ms.mean()),
             f"median_{name}_ms": float(np.median(values_ms)),
             f"std_{name}_ms": float(values_ms.std())}
    for percentile in PERCENTILES:
        stats[f"p{percentile}_{name}_ms"] = float(np.percentile(values_ms, percentile))
    return stats


def build_run_file(records: list[RequestRecord], duration_s: float, *, info: dict) -> dict:
    """The run file's body: `info`'s keys (date, backend, model_id, request_rate,
    engine_settings, ...) then the results of `records` over a run of `duration_s`."""
    completed = [record for record in records if record.success]
    num_abandoned = sum(record.abandoned_time is not None for record in records)
    total_input = sum(record.prompt_len for record in completed)
    total_output = sum(record.output_len for record in completed)
    result = dict(info)
    result.update({
        "num_prompts": len(records),
        "duration": duration_s,
        "completed": len(completed),
        "failed": len(records) - len(completed) - num_abandoned,
        "abandoned": num_abandoned,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(completed) / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    })
    result.update(_stats("ttft", [record.ttft for record in completed]))
    result.update(_stats("tpot", [record.tpot for record in completed if record.tpot is not None]))
    result.update(_stats("itl", [itl for record in completed for itl in record.itls]))
    result.update(_stats("e2el", [record.e2el for record in completed]))
    result.update({
        "input_lens": [record.prompt_len for record in records],
        "output_lens": [record.output_len if record.success else 0 for record in records],
        "ttfts": [record.ttft for record in records],
        "itls": [record.itls for record in records],
        "generated_texts": [record.generated_text for record in records],
        "errors": [record.error for record in records],
        # twinserve's: when each request was sent, its end-to-end latency, what it asked for.
        "start_times": [record.start_time for record in records],
        "e2els": [record.e2el for record in records],
        "expected_output_lens": [record.expected_output_len for record in records],
        "timeout_s": [record.timeout_s for record in records],
        "abandoned_times": [record.abandoned_time for record in records],
    })
    return result


def print_summary(result: dict) -> None:
    """The run's results as `vllm bench serve` prints them."""
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    rows = [("Successful requests:", result["completed"]),
            ("Failed requests:", result["failed"]),
            *((("Abandoned requests (timeout_s):", result["abandoned"]),)
              if any(timeout is not None for timeout in result["timeout_s"]) else ()),
            ("Benchmark duration (s):", result["duration"]),
            ("Total input tokens:", result["total_input_tokens"]),
            ("Total generated tokens:", result["total_output_tokens"]),
            ("Request throughput (req/s):", result["request_throughput"]),
            ("Output token throughput (tok/s):", result["output_throughput"]),
            ("Total Token throughput (tok/s):", result["total_token_throughput"])]
    for label, value in rows:
        print(f"{label:<40} {value:<10.2f}" if isinstance(value, float) else
              f"{label:<40} {value:<10}")
    for name, title in METRIC_TITLES.items():
        print("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        for stat in ("mean", "median", *(f"p{p}" for p in PERCENTILES)):
            label = f"{stat.capitalize()} {name.upper()} (ms):"
            print(f"{label:<40} {result[f'{stat}_{name}_ms']:<10.2f}")
    print("=" * 50)


def rate_for_json(rate: float | None):
    """A request rate as JSON can hold it: "inf" for infinity (vLLM writes `Infinity`, which
    strict JSON readers refuse)."""
    if rate is None:
        return None
    return "inf" if math.isinf(rate) else float(rate)
