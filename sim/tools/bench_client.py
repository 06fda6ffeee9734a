"""`twinserve-bench --endpoint URL [workload overrides...]`: replay a twinserve workload against
an OpenAI-compatible completions server and write the run file that `twinserve-validate --real`
reads (sim/tools/bench_run_file.py).

Each request is sent at its arrival time, streamed, with max_tokens = min_tokens = its output
length and ignore_eos so that the output has the workload's length; a 408 answer to its
`timeout_s` is recorded as abandoned, not failed. `--warmup N` first sends N requests unrecorded,
since a server's first requests pay for its lazy start-up.

    twinserve-bench --endpoint http://127.0.0.1:8000 workload.num_requests=50 workload.rate=4
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import fields, replace
from datetime import datetime
from pathlib import Path

import httpx
import yaml
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from policies.types import CLIENT_SCHEDULING_FIELDS, Request
from runtime.specs import ModelSpec
from sim.core.workload import REPO_ROOT, build_workload
from sim.tools.bench_run_file import RequestRecord, build_run_file, print_summary, rate_for_json
from sim.tools.capacity import compose_config

COMPLETIONS_PATH = "/v1/completions"
# The status twinserve-serve answers a request with when its timeout_s passed (Request Timeout).
ABANDONED_STATUS = 408
MODEL_CONFIGS = REPO_ROOT / "conf" / "model"
DEFAULT_REQUEST_TIMEOUT_S = 600.0
DEFAULT_TIMEOUT_S = 3600.0
# How long the client waits for the server's /v1/models and /v1/engine_settings.
INFO_TIMEOUT_S = 30.0


def split_endpoint(endpoint: str) -> tuple[str, str]:
    """(base URL, completions URL) of `endpoint`: a server's base URL, or its completions URL."""
    endpoint = endpoint.rstrip("/")
    if not endpoint.startswith(("http://", "https://")):
        raise ValueError(f"--endpoint must be an http(s) URL, got {endpoint!r}")
    if endpoint.endswith(COMPLETIONS_PATH):
        return endpoint[:-len(COMPLETIONS_PATH)], endpoint
    return endpoint, endpoint + COMPLETIONS_PATH


def parse_engine_settings(pairs: list[str]) -> dict:
    """--engine-setting KEY=VALUE pairs as a dict, each value read as YAML (512, true, cpu)."""
    settings = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--engine-setting must be KEY=VALUE, got {pair!r}")
        settings[key] = yaml.safe_load(value)
    return settings


def server_info(base_url: str) -> tuple[str, dict]:
    """The server's first model id, and its engine settings when it reports them (twinserve's
    /v1/engine_settings, or the model entry's `engine_settings`); {} otherwise."""
    with httpx.Client(base_url=base_url, timeout=INFO_TIMEOUT_S) as client:
        response = client.get("/v1/models")
        response.raise_for_status()
        models = response.json().get("data") or []
        if not models:
            raise ValueError(f"{base_url}/v1/models lists no model; give --model")
        settings_response = client.get("/v1/engine_settings")
        settings = (settings_response.json() if settings_response.status_code == 200
                    else models[0].get("engine_settings") or {})
    return models[0]["id"], settings


def workload_requests(overrides: list[str], served_model: str | None):
    """The config `overrides` compose (model=<served_model> when that names a conf/model and no
    override sets one), its workload section, and the workload's requests with token ids."""
    overrides = list(overrides)
    sets_model = any(override.lstrip("+~").split("=", 1)[0] == "model" for override in overrides)
    if not sets_model and served_model and (MODEL_CONFIGS / f"{served_model}.yaml").is_file():
        overrides.insert(0, f"model={served_model}")
    try:
        cfg = compose_config(overrides)
    except (HydraException, OmegaConfBaseException) as error:
        raise ValueError(f"bad override: {str(error).splitlines()[0]}") from None
    workload = OmegaConf.to_container(cfg.workload, resolve=True)
    # A server without a tokenizer needs ids; the ids' stream leaves arrivals and lengths as
    # they are (sim/core/workload.py draws each quantity from its own stream).
    workload["with_token_ids"] = True
    vocab_size = ModelSpec.from_config(cfg.model).vocab_size
    return cfg, workload, build_workload(workload, seed=cfg.seed, vocab_size=vocab_size)


# What a Request field holds when nobody set it: only set ones go in vLLM's `vllm_xargs`; servers
# that know none of them ignore the field, as OpenAI's do.
_UNSET = {field.name: field.default for field in fields(Request)}


def request_metadata(request: Request) -> dict:
    """The request's CLIENT_SCHEDULING_FIELDS that differ from the dataclass's defaults."""
    return {key: getattr(request, key) for key in CLIENT_SCHEDULING_FIELDS
            if getattr(request, key) != _UNSET[key]}


def completion_payload(request: Request, model: str) -> dict:
    payload = {"model": model, "prompt": list(request.prompt_token_ids),
               "max_tokens": request.output_len, "min_tokens": request.output_len,
               "ignore_eos": True, "temperature": 0.0, "n": request.n, "stream": True,
               "stream_options": {"include_usage": True},
               "return_token_ids": True}   # (vLLM's switch for token_ids in its chunks)
    if request.timeout_s is not None:   # (twinserve-serve's deadline; sent only when set)
        payload["timeout_s"] = request.timeout_s
    metadata = request_metadata(request)
    if metadata:
        payload["vllm_xargs"] = metadata
    if request.priority != 0:   # (vLLM's own field, which its --scheduling-policy priority reads)
        payload["priority"] = request.priority
    return payload


def _abandoned(record: RequestRecord, status: int, run_start: float) -> bool:
    """Whether `status` is the server's answer to a request whose timeout_s passed (408), which
    `record` then notes as abandoned."""
    if status != ABANDONED_STATUS:
        return False
    record.abandoned_time = time.perf_counter() - run_start
    return True


async def stream_completion(client: httpx.AsyncClient, url: str, payload: dict,
                            record: RequestRecord, run_start: float) -> None:
    """Send one request and record its chunks' arrival times and token counts."""
    async with client.stream("POST", url, json=payload) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode(errors="replace")
            if _abandoned(record, response.status_code, run_start):
                return
            try:
                message = json.loads(body)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = body[:200]
            record.error = f"HTTP {response.status_code}: {message}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                return
            now = time.perf_counter() - run_start
            chunk = json.loads(data)
            if chunk.get("error"):
                error = chunk["error"]
                if isinstance(error, dict) and _abandoned(record, error.get("code"), run_start):
                    return
                record.error = error.get("message", str(error)) if isinstance(error, dict) else (
                    str(error))
                return
            num_tokens = 0
            for choice in chunk.get("choices") or ():
                text = choice.get("text") or ""
                record.generated_text += text
                token_ids = choice.get("token_ids")
                if token_ids is not None:
                    record.counted_ids = True
                    num_tokens += len(token_ids)
                else:   # a server that sends no ids: a token per chunk with text, as vLLM counts
                    num_tokens += int(bool(text))
            if num_tokens:
                record.add_tokens(now, num_tokens)
            usage = chunk.get("usage")
            if usage and usage.get("completion_tokens") is not None:
                record.usage_output_tokens = usage["completion_tokens"]
        record.error = record.error or "the stream ended without [DONE]"


async def send_at_arrival(client: httpx.AsyncClient, url: str, model: str, request: Request,
                          run_start: float, deadline: float,
                          request_timeout_s: float) -> RequestRecord:
    record = RequestRecord(prompt_len=request.prompt_len, expected_output_len=request.output_len,
                           timeout_s=request.timeout_s)
    await asyncio.sleep(max(0.0, run_start + request.arrival_time - time.perf_counter()))
    now = time.perf_counter()
    if now >= deadline:
        record.error = "not sent: the run's --timeout passed first"
        return record
    record.start_time = now - run_start
    timeout_s = min(request_timeout_s, deadline - now)
    try:
        async with asyncio.timeout(timeout_s):
            await stream_completion(client, url, completion_payload(request, model), record,
                                    run_start)
    except TimeoutError:
        record.error = f"timed out after {timeout_s:.1f} s"
    except (httpx.HTTPError, ValueError) as error:   # (ValueError: a chunk that is not JSON)
        record.error = f"{type(error).__name__}: {error}"
    return record


async def warm_up(client: httpx.AsyncClient, url: str, model: str, requests: list[Request],
                  request_timeout_s: float) -> None:
    """Send `requests` all at once, without deadlines, and wait for them; raises ValueError
    naming the first that failed (a server that cannot answer the warm-up would spoil the run)."""
    now = time.perf_counter()
    undated = [replace(request, arrival_time=0.0, timeout_s=None) for request in requests]
    records = await asyncio.gather(*(
        send_at_arrival(client, url, model, request, now, now + request_timeout_s,
                        request_timeout_s)
        for request in undated))
    for index, record in enumerate(records):
        if not record.success:
            raise ValueError(f"--warmup: warm-up request {index} failed: "
                             f"{record.error or 'no tokens came back'}")


async def run_benchmark(url: str, model: str, requests: list[Request], *,
                        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                        timeout_s: float = DEFAULT_TIMEOUT_S,
                        warmup: list[Request] = ()) -> tuple[list[RequestRecord], float]:
    """Send `warmup` at once and wait for it (unrecorded), then every request at its arrival
    time; returns their records in request order and the run's duration (s)."""
    # No cap on connections: a capped pool would queue requests in the client, not the server.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(request_timeout_s)) as client:
        if warmup:
            await warm_up(client, url, model, list(warmup), request_timeout_s)
        run_start = time.perf_counter()
        deadline = run_start + timeout_s
        records = await asyncio.gather(*(
            send_at_arrival(client, url, model, request, run_start, deadline, request_timeout_s)
            for request in requests))
        return list(records), time.perf_counter() - run_start


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="twinserve-bench", description="Replay a twinserve workload against an "
        "OpenAI-compatible completions server and write a vLLM-style run file.")
    parser.add_argument("--endpoint", required=True,
                        help="the server's base URL (http://127.0.0.1:8000) or its "
                             "/v1/completions URL")
    parser.add_argument("--out", default=None, help="the run file (default: "
                        "twinserve-bench-<model>-<date>.json here)")
    parser.add_argument("--model", default=None,
                        help="the model name to send (default: the server's first /v1/models)")
    parser.add_argument("--engine-setting", action="append", default=[], metavar="KEY=VALUE",
                        help="an engine setting to record (over the server's own), e.g. "
                             "hardware=h100-80gb; repeatable")
    parser.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT_S,
                        help="seconds one request may take (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help="seconds the whole run may take (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=0, metavar="N",
                        help="first send the workload's first N requests at once, unrecorded "
                             "(default: %(default)s)")
    parser.add_argument("overrides", nargs="*",
                        help="twinserve config overrides (workload.num_requests=50 ...)")
    return parser.parse_args(argv)


def bench(args: argparse.Namespace) -> dict:
    """Run the benchmark `args` describe; returns the run file's body (also written)."""
    for name in ("request_timeout", "timeout"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    warmup = getattr(args, "warmup", 0)
    if warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {warmup}")
    base_url, url = split_endpoint(args.endpoint)
    extra_settings = parse_engine_settings(args.engine_setting)
    served_model, engine_settings = server_info(base_url)
    model = args.model or served_model
    engine_settings = {**engine_settings, **extra_settings}
    cfg, workload, requests = workload_requests(args.overrides, engine_settings.get("model", served_model))
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    records, duration_s = asyncio.run(run_benchmark(
        url, model, requests, request_timeout_s=args.request_timeout, timeout_s=args.timeout,
        warmup=requests[:warmup]))
    info = {"date": date, "backend": "openai", "endpoint_type": "openai", "base_url": base_url,
            "endpoint": url[len(base_url):], "model_id": model, "tokenizer_id": None,
            "request_rate": rate_for_json(workload.get("rate")),
            "burstiness": workload.get("burstiness"), "max_concurrency": None,
            "engine_settings": engine_settings, "workload": workload, "seed": cfg.seed,
            "overrides": list(args.overrides), "warmup_requests": min(warmup, len(requests))}
    result = build_run_file(records, duration_s, info=info)
    out = Path(args.out or f"twinserve-bench-{Path(model).name}-{date}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print_summary(result)
    print(f"run file: {out}")
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        bench(args)
    except (ValueError, httpx.HTTPError) as error:   # a bad argument or no server: one line
        print(f"twinserve-bench: error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
