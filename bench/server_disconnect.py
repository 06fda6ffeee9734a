"""How long a server keeps computing for clients that went away: `--streams` streams of
`--max-tokens` tokens (EOS ignored) are cut after `--cut-after-s`, then /metrics is polled until
no request runs and the KV cache is empty (twinserve-serve, or `vllm serve`, which reports the
same metric names).

    twinserve-serve --model tiny-llama --port 8741 --num-gpu-blocks 512 &
    python bench/server_disconnect.py --url http://127.0.0.1:8741
"""
from __future__ import annotations

import argparse
import re
import threading
import time

import httpx

PROMPT = [5, 17, 99, 3]
POLL_S = 0.01


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--streams", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=2000)
    parser.add_argument("--cut-after-s", type=float, default=0.3)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    args = parser.parse_args()
    threads = [threading.Thread(target=cut_stream, args=(args.url, args.max_tokens,
                                                         args.cut_after_s))
               for _ in range(args.streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    cut_at = time.monotonic()
    while time.monotonic() - cut_at < args.timeout_s:
        text = httpx.get(f"{args.url}/metrics").text
        if gauge(text, "num_requests_running") == 0 and gauge(text, "kv_cache_usage_perc") == 0:
            print(f"idle {time.monotonic() - cut_at:.3f} s after the last cut")
            return
        time.sleep(POLL_S)
    print(f"still busy {args.timeout_s} s after the last cut")


if __name__ == "__main__":
    main()
