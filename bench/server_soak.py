"""Soak twinserve-serve: `--streams` concurrent streaming clients for `--duration` seconds
against a server this script starts (127.0.0.1, tiny-llama, an API key, a bound on waiting
requests). Each client sends one streamed completion after another (random prompt and output
lengths, EOS ignored); a request fails unless it answers 200 with every token asked for, the
finish reason and [DONE]. The server's RSS is read after `--warmup-s` and at the end. Then, with
the streams still running (the clients send no new ones): a request without the key must get
401, an oversized body 413, and a flood of `--flood` requests at once must meet 503 with
Retry-After past the bound (the others complete); the running streams must still finish. Last, SIGTERM must drain the server
and exit 0. Prints a table; exits 1 unless every check passes.

    python bench/server_soak.py --duration 300
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
API_KEY = "soak-key"
MAX_BODY_BYTES = 64 * 1024
VOCAB_SIZE = 512                  # tiny-llama's
PROMPT_LENS = (8, 64)             # tokens, uniform
OUTPUT_LENS = (8, 64)
REQUEST_TIMEOUT_S = 300.0
STARTUP_TIMEOUT_S = 120.0
# RSS at the end over RSS after the warm-up, at most (the "within 10 %").
MAX_RSS_RATIO = 1.10


@dataclass
class Tally:
    done: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)   # the first few failures' reasons

    def fail(self, reason: str) -> None:
        self.failed += 1
        if len(self.errors) < 5:
            self.errors.append(reason)


def rss_mb(pid: int) -> float:
    """The resident set of process `pid` (Linux /proc), MB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(port: int, args: argparse.Namespace) -> subprocess.Popen:
    command = [sys.executable, "-m", "engine.server", "--model", "tiny-llama",
               "--host", "127.0.0.1", "--port", str(port), "--api-key", API_KEY,
               "--max-body-bytes", str(MAX_BODY_BYTES),
               "--max-waiting-requests", str(args.max_waiting_requests),
               "--max-num-seqs", str(args.max_num_seqs),
               "--num-gpu-blocks", str(args.num_gpu_blocks), "--seed", "0",
               "--shutdown-timeout", str(args.shutdown_timeout), "--log-level", "warning"]
    return subprocess.Popen(command, cwd=REPO)


async def wait_for_health(client: httpx.AsyncClient, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if (await client.get("/health")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.2)
    raise SystemExit(f"server_soak: the server did not start (exit status {server.poll()})")


async def one_stream(client: httpx.AsyncClient, rng: random.Random) -> str | None:
    """One streamed completion; None when it was whole, else why not."""
    prompt = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(*PROMPT_LENS))]
    max_tokens = rng.randint(*OUTPUT_LENS)
    payload = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    tokens, finish_reason, last = 0, None, None
    try:
        async with client.stream("POST", "/v1/completions", json=payload) as response:
            if response.status_code != 200:
                return f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            async for line in response.aiter_lines():
                if not line:
                    continue
                last = line
                if line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:
                    return f"error event: {line[:200]}"
                choice = chunk["choices"][0]
                tokens += len(choice["token_ids"])
                finish_reason = choice["finish_reason"] or finish_reason
    except httpx.HTTPError as error:
        return f"{type(error).__name__}: {error}"
    if last != "data: [DONE]" or tokens != max_tokens or finish_reason != "length":
        return f"incomplete: {tokens}/{max_tokens} tokens, finish {finish_reason}, last {last}"
    return None


async def streamer(client: httpx.AsyncClient, seed: int, stop: asyncio.Event,
                   tally: Tally) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        reason = await one_stream(client, rng)
        if reason is None:
            tally.done += 1
        else:
            tally.fail(reason)


async def flood(client: httpx.AsyncClient, count: int) -> dict[str, int]:
    """`count` short completions at once: how many were refused with 503 and Retry-After, how
    many completed, how many did anything else."""
    async def one() -> str:
        try:
            response = await client.post("/v1/completions",
                                         json={"prompt": [1, 2, 3], "max_tokens": 4})
        except httpx.HTTPError:
            return "other"
        if response.status_code == 503 and "retry-after" in response.headers:
            return "refused"
        return "completed" if response.status_code == 200 else "other"
    outcomes = await asyncio.gather(*(one() for _ in range(count)))
    return {outcome: outcomes.count(outcome) for outcome in ("refused", "completed", "other")}


async def guard_statuses(client: httpx.AsyncClient) -> tuple[int, int]:
    """(status without the key, status of an oversized body with it)."""
    unkeyed = await client.post("/v1/completions", json={"prompt": [1, 2, 3]},
                                headers={"Authorization": ""})
    oversized = await client.post("/v1/completions",
                                  json={"prompt": list(range(MAX_BODY_BYTES // 4))})
    return unkeyed.status_code, oversized.status_code


async def soak(args: argparse.Namespace, server: subprocess.Popen, url: str) -> dict:
    limits = httpx.Limits(max_connections=args.streams + args.flood + 8,
                          max_keepalive_connections=args.streams + 8)
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S, limits=limits,
                                 headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        await wait_for_health(client, server)
        tally, stop = Tally(), asyncio.Event()
        started = time.monotonic()
        streams = [asyncio.create_task(streamer(client, seed, stop, tally))
                   for seed in range(args.streams)]
        await asyncio.sleep(args.warmup_s)
        rss_warm, done_warm = rss_mb(server.pid), tally.done
        await asyncio.sleep(max(0.0, args.duration - args.warmup_s))
        rss_end = rss_mb(server.pid)
        soak_s = time.monotonic() - started
        done_soak = tally.done
        # The clients send no new request (the flood would refuse it), while the streams they
        # run meet the key, the body cap and the flood, and must finish.
        stop.set()
        unkeyed, oversized = await guard_statuses(client)
        flooded = await flood(client, args.flood)
        await asyncio.gather(*streams)
    return dict(tally=tally, soak_s=soak_s, rss_warm=rss_warm, rss_end=rss_end,
                done_warm=done_warm, done_soak=done_soak, unkeyed=unkeyed,
                oversized=oversized, flooded=flooded)


def drain_exit_status(server: subprocess.Popen, timeout_s: float) -> int | None:
    server.send_signal(signal.SIGTERM)
    try:
        return server.wait(timeout_s)
    except subprocess.TimeoutExpired:
        server.kill()
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=300.0, help="s of soak (default 300)")
    parser.add_argument("--warmup-s", type=float, default=30.0,
                        help="s after which the warm-up RSS is read (default 30)")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--max-waiting-requests", type=int, default=256,
                        help="the server's bound (default 256: the streams alone never pass it)")
    parser.add_argument("--flood", type=int, default=512,
                        help="requests sent at once past the bound (default 512)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--num-gpu-blocks", type=int, default=1024)
    parser.add_argument("--shutdown-timeout", type=float, default=10.0)
    args = parser.parse_args()
    if not 0 < args.warmup_s < args.duration:
        parser.error(f"--warmup-s must be within (0, --duration), got {args.warmup_s}")
    port = free_port()
    load_before = os.getloadavg()
    server = start_server(port, args)
    try:
        result = asyncio.run(soak(args, server, f"http://127.0.0.1:{port}"))
        exit_status = drain_exit_status(server, args.shutdown_timeout + 30)
    finally:
        if server.poll() is None:
            server.kill()
    load_after = os.getloadavg()
    tally, flooded = result["tally"], result["flooded"]
    rss_ratio = result["rss_end"] / result["rss_warm"]
    rate = (result["done_soak"] - result["done_warm"]) / (result["soak_s"] - args.warmup_s)
    checks = {
        "no failed request": tally.failed == 0,
        f"RSS end / warm-up <= {MAX_RSS_RATIO}": rss_ratio <= MAX_RSS_RATIO,
        "no key: 401": result["unkeyed"] == 401,
        "oversized body: 413": result["oversized"] == 413,
        "flood past the bound: 503 + Retry-After, the rest completed":
            flooded["refused"] > 0 and flooded["other"] == 0,
        "SIGTERM: drained, exit 0": exit_status == 0,
    }
    print(f"\n{args.streams} streams x {result['soak_s']:.0f} s, "
          f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")
    print("| measure | value |\n|---|---|")
    rows = [("requests done (by the end / in all)", f"{result['done_soak']} / {tally.done}"),
            ("requests per second after warm-up", f"{rate:.1f}"),
            ("failed requests", str(tally.failed)),
            (f"RSS after warm-up ({args.warmup_s:g} s)", f"{result['rss_warm']:.1f} MB"),
            ("RSS at the end", f"{result['rss_end']:.1f} MB"),
            ("RSS end / warm-up", f"{rss_ratio:.3f}"),
            ("no key / oversized body", f"{result['unkeyed']} / {result['oversized']}"),
            (f"flood of {args.flood}: 503 / completed / other",
             f"{flooded['refused']} / {flooded['completed']} / {flooded['other']}"),
            ("SIGTERM exit status", str(exit_status))]
    for name, value in rows:
        print(f"| {name} | {value} |")
    for name, passed in checks.items():
        print(f"| {name} | {'pass' if passed else 'FAIL'} |")
    for reason in tally.errors:
        print(f"failure: {reason}")
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
