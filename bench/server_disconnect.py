"""How long a server keeps computing for clients that went away: `--streams` streams of
`--max-tokens` tokens (EOS ignored) are cut after `--cut-after-s`, then /metrics is polled until
no request runs and the KV cache is empty (twinserve-serve, or `vllm serve`, which reports the
same metric names). With `--pid` (a server on this machine, with or without /metrics), the
server process's CPU time is watched instead until it stays flat for `--quiet-s`.

    twinserve-serve --model tiny-llama --port 8741 --num-gpu-blocks 512 &
    python bench/server_disconnect.py --url http://127.0.0.1:8741 [--pid $!]
"""
from __future__ import annotations

import argparse
import os
import re
import threading
import time

import httpx

PROMPT = [5, 17, 99, 3]
POLL_S = 0.01
CPU_POLL_S = 0.2
# CPU seconds per CPU_POLL_S under which the server counts as idle (its idle loop's polling).
IDLE_CPU_S = 0.05


def cut_stream(url: str, max_tokens: int, cut_after_s: float) -> None:
    """One streamed completion, read for `cut_after_s`, then its connection closed."""
    payload = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{url}/v1/completions", json=payload) as response:
            response.raise_for_status()
            cut_at = time.monotonic() + cut_after_s
            for _ in response.iter_lines():
                if time.monotonic() > cut_at:
                    break


def gauge(text: str, name: str) -> float:
    return float(re.search(rf"^vllm:{name}(?:{{[^}}]*}})? (\S+)$", text, re.M).group(1))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_for_idle_metrics(url: str, cut_at: float, timeout_s: float) -> str:
    while time.monotonic() - cut_at < timeout_s:
        text = httpx.get(f"{url}/metrics").text
        if gauge(text, "num_requests_running") == 0 and gauge(text, "kv_cache_usage_perc") == 0:
            return f"idle {time.monotonic() - cut_at:.3f} s after the last cut"
        time.sleep(POLL_S)
    return f"still busy {timeout_s} s after the last cut"


def wait_for_idle_cpu(pid: int, cut_at: float, timeout_s: float, quiet_s: float) -> str:
    start = previous = cpu_seconds(pid)
    last_busy = cut_at
    while time.monotonic() - last_busy < quiet_s and time.monotonic() - cut_at < timeout_s:
        time.sleep(CPU_POLL_S)
        now_cpu = cpu_seconds(pid)
        if now_cpu - previous > IDLE_CPU_S:
            last_busy = time.monotonic()
        previous = now_cpu
    return (f"busy until {last_busy - cut_at:.1f} s after the last cut, "
            f"{previous - start:.1f} CPU-s used")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--streams", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=2000)
    parser.add_argument("--cut-after-s", type=float, default=0.3)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--pid", type=int, default=None,
                        help="the server's process id: watch its CPU time, not /metrics")
    parser.add_argument("--quiet-s", type=float, default=1.0)
    args = parser.parse_args()
    threads = [threading.Thread(target=cut_stream, args=(args.url, args.max_tokens,
                                                         args.cut_after_s))
               for _ in range(args.streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    cut_at = time.monotonic()
    if args.pid is None:
        print(wait_for_idle_metrics(args.url, cut_at, args.timeout_s))
    else:
        print(wait_for_idle_cpu(args.pid, cut_at, args.timeout_s, args.quiet_s))


if __name__ == "__main__":
    main()
