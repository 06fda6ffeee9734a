"""`twinserve-serve`: the engine behind an OpenAI-compatible HTTP server (FastAPI + uvicorn).
One thread steps the engine (engine/serving_loop.py) and the handlers wait on its events.

    twinserve-serve --model tiny-llama --port 8000 --scheduler chunked_prefill --num-gpu-blocks 512
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from engine.llm import LLM
from engine.openai_protocol import (BadRequest, CompletionRequest, CompletionStream, error_body,
                                    engine_request, sampling_param, validation_message,
                                    validation_param)
from engine.server_guard import RequestGuard, serve
from engine.server_metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from engine.serving_loop import DONE, ERROR, QUEUED, TOKENS, ServingLoop
from policies.batching import ChunkedPrefillScheduler

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
API_KEY_ENV = "TWINSERVE_API_KEY"
# A completions body is a prompt of token ids and a few fields; far larger is a mistake or abuse.
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
# Enough for a benchmark's 256 concurrent streams behind a full batch, while a flood holds a
# bounded number of prompts.
DEFAULT_MAX_WAITING_REQUESTS = 1024
# A refused client's Retry-After (s): a seat frees whenever any running request ends, which on a
# loaded engine is within a second or so, and 1 is the header's smallest non-zero value.
RETRY_AFTER_S = 1
# How long SIGTERM lets the running requests finish before it aborts the rest (Kubernetes'
# default grace period before it kills a pod).
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
# Torch's CPU threads: the CPU profiles in profiles/cpu/ were taken with one, so a replay of a CPU
# server's run prices its steps at the speed the server ran.
DEFAULT_THREADS = 1
# Hosts that only this machine reaches: serving them without an API key is not worth a warning.
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
# The engine's options on the command line: flag -> (LLM keyword, type).
ENGINE_OPTIONS = {
    "--block-size": ("block_size", int),
    "--num-gpu-blocks": ("num_gpu_blocks", int),
    "--max-num-seqs": ("max_num_seqs", int),
    "--max-num-batched-tokens": ("max_num_batched_tokens", int),
    "--max-model-len": ("max_model_len", int),
    "--scheduler": ("scheduler", str),
    "--preemption": ("preemption", str),
    "--swap-space-gb": ("swap_space_gb", float),
    "--seed": ("seed", int),
    "--device": ("device", str),
    "--hardware": ("hardware", str),
    "--cpu-kv-cache-gb": ("cpu_kv_cache_gb", float),
}


def engine_settings(llm: LLM) -> dict:
    """The settings a simulator needs to replay a run of this engine, under vLLM's names."""
    config, scheduler = llm.config, llm.scheduler
    kv_cache = scheduler.kv_cache
    if config.hardware is not None:
        hardware = config.hardware
    elif llm.device.type == "cpu":
        hardware = "cpu"   # (conf/hardware/cpu.yaml)
    else:
        hardware = torch.cuda.get_device_name(llm.device)
    return {
        "engine": "twinserve",
        "model": config.model,
        "hardware": hardware,
        "device": str(llm.device),
        "tensor_parallel_size": 1,
        "max_num_seqs": scheduler.max_num_seqs,
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "max_model_len": llm.max_model_len,
        "block_size": kv_cache.block_size,
        "num_gpu_blocks": kv_cache.num_blocks,
        "enable_prefix_caching": config.enable_prefix_caching,
        "enable_chunked_prefill": isinstance(scheduler, ChunkedPrefillScheduler),
        "scheduler": config.scheduler if isinstance(config.scheduler, str)
        else type(scheduler).__name__,
        "preemption": config.preemption if isinstance(config.preemption, str)
        else type(config.preemption).__name__,
        "seed": config.seed,
    }


def _error(message: str, status: int, param: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status, headers=headers)


def _sse(body: dict | str) -> bytes:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n".encode()


def create_app(llm: LLM, served_model_name: str | None = None, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS) -> FastAPI:
    """The server's app; its lifespan starts and stops the thread that steps `llm`. Answers 401
    without `api_key` (when set), 413 over `max_body_bytes`, and 503 past `max_waiting_requests`
    or while draining."""
    served = served_model_name or llm.config.model
    serving = ServingLoop(llm)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        serving.start()
        try:
            yield
        finally:
            serving.stop()

    app = FastAPI(title="twinserve", lifespan=lifespan)
    app.state.serving = serving
    app.add_middleware(RequestGuard, api_key=api_key, max_body_bytes=max_body_bytes)
    _add_error_handlers(app)
    _add_info_routes(app, llm, serving, served)
    _add_completions_route(app, llm, serving, served, max_waiting_requests)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, error: RequestValidationError) -> JSONResponse:
        errors = error.errors()
        return _error(validation_message(errors), 400, validation_param(errors))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        # Unknown routes (404) and methods (405) in OpenAI's shape, not FastAPI's {"detail"}.
        message = (f"{request.method} {request.url.path}: {error.detail}"
                   if error.status_code in (404, 405) else str(error.detail))
        return JSONResponse(error_body(message, error.status_code), status_code=error.status_code,
                            headers=error.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> JSONResponse:
        return _error(f"internal error: {type(error).__name__}: {error}", 500)


def _add_info_routes(app: FastAPI, llm: LLM, serving: ServingLoop, served: str) -> None:
    """GET /metrics, /health, /v1/models and /v1/engine_settings."""
    settings = engine_settings(llm)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(serving.stats.render(served), media_type=METRICS_CONTENT_TYPE)

    @app.get("/health")
    async def health():
        if not serving.is_alive:
            return _error(serving.failure or "the engine is not running", 503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": served, "object": "model", "created": int(time.time()),
            "owned_by": "twinserve", "max_model_len": llm.max_model_len,
            "engine_settings": settings}]}

    @app.get("/v1/engine_settings")
    async def get_engine_settings():
        return settings


def _add_completions_route(app: FastAPI, llm: LLM, serving: ServingLoop, served: str,
                           max_waiting_requests: int) -> None:
    decode = llm.tokenizer.decode if llm.tokenizer is not None else None

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        if body.model is not None and body.model != served:
            return _error(f"model: {body.model!r} is not served here; this server serves "
                          f"{served!r}", 404, "model")
        try:
            prompt, params = engine_request(body)
        except BadRequest as error:
            return _error(str(error), 400, error.param)
        if serving.draining:
            return _error("the server is shutting down: it takes no new requests", 503)
        if max_waiting_requests and serving.num_waiting >= max_waiting_requests:
            return _error(f"the server is busy: {serving.num_waiting} requests are waiting "
                          f"(--max-waiting-requests {max_waiting_requests}); retry later", 503,
                          headers={"Retry-After": str(RETRY_AFTER_S)})
        events, submission = serving.submit(prompt, params, body.timeout_s)
        response = None
        try:
            response = await _unless_disconnected(
                request, _respond(serving, served, decode, body, events, submission))
            return response
        finally:
            if not isinstance(response, StreamingResponse):   # (a stream aborts when it ends)
                serving.abort(submission)


async def _respond(serving: ServingLoop, served: str, decode, body: CompletionRequest,
                   events, submission):
    """The completion's response: a stream, the whole completion, or the error it met."""
    first = await events.get()
    if first.kind == ERROR:
        status = 400 if serving.is_alive else 503
        return _error(first.value, status, sampling_param(first.value))
    assert first.kind == QUEUED, first
    stream = CompletionStream(served, decode)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(_stream_events(serving, events, submission, stream,
                                                include_usage),
                                 media_type="text/event-stream")
    while True:
        event = await events.get()
        if event.kind == ERROR:
            return _error(event.value, 503)
        if event.kind == DONE:
            output = event.value
            if output.abandoned:   # its timeout_s passed
                return _error(output.error, 408, "timeout_s")
            if output.error is not None:   # rejected by the scheduler while it waited
                return _error(f"rejected by the scheduler: {output.error}", 503)
            return stream.completion(output)


async def _unless_disconnected(request: Request, work: Awaitable):
    """`work`'s result, or None once the client disconnected (`work` is then cancelled)."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((work_task, watch_task), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
        if not work_task.done():
            work_task.cancel()
    return work_task.result() if not work_task.cancelled() else None


async def _disconnect(request: Request) -> None:
    """Returns when the client goes away (the body was read: receive waits for that alone)."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:   # (a server that cannot tell: never report a disconnect)
        await asyncio.Future()


async def _stream_events(serving: ServingLoop, events, submission, stream: CompletionStream,
                         include_usage: bool) -> AsyncIterator[bytes]:
    """A request's events as SSE chunks, then the finish reasons, the usage and [DONE]; closed
    early (its client went away), it aborts the request."""
    try:
        async for chunk in _stream_chunks(events, stream, include_usage):
            yield chunk
    finally:
        serving.abort(submission)


async def _stream_chunks(events, stream: CompletionStream,
                         include_usage: bool) -> AsyncIterator[bytes]:
    while True:
        event = await events.get()
        if event.kind == TOKENS:
            yield _sse(stream.tokens_chunk(event.value))
            continue
        if event.kind == ERROR:
            yield _sse(error_body(event.value, 503))
        elif event.value.abandoned:
            yield _sse(error_body(event.value.error, 408, "timeout_s"))
        elif event.value.error is not None:
            yield _sse(error_body(f"rejected by the scheduler: {event.value.error}", 503))
        else:
            yield _sse(stream.finish_chunk(event.value))
            if include_usage:
                yield _sse(stream.usage_chunk(event.value))
        yield _sse("[DONE]")
        return


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="twinserve-serve", description="Serve the twinserve engine over an "
        "OpenAI-compatible HTTP API (/v1/completions, /v1/models, /health).")
    parser.add_argument("--model", default="tiny-llama",
                        help="a conf/model name (seeded random weights) or a local HF checkpoint "
                             "folder (default: tiny-llama)")
    parser.add_argument("--served-model-name", default=None,
                        help="the name clients give as `model` (default: --model)")
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"default: {DEFAULT_HOST}")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"default: {DEFAULT_PORT}")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                        help=f"answer /v1 requests only with 'Authorization: Bearer KEY' "
                             f"(default: ${API_KEY_ENV}, else no key)")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help=f"a larger request body gets 413 (default: {DEFAULT_MAX_BODY_BYTES})")
    parser.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                        help=f"past this many waiting requests a new one gets 503 with "
                             f"Retry-After; 0: no bound (default: "
                             f"{DEFAULT_MAX_WAITING_REQUESTS})")
    parser.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                        help=f"s that SIGTERM or Ctrl-C lets the running requests finish before "
                             f"it aborts them (default: {DEFAULT_SHUTDOWN_TIMEOUT_S:g})")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                        help=f"torch CPU threads (default: {DEFAULT_THREADS}, as the CPU "
                             f"profiles were taken)")
    parser.add_argument("--enable-prefix-caching", action="store_true")
    parser.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"])
    for flag, (name, kind) in ENGINE_OPTIONS.items():
        parser.add_argument(flag, dest=name, type=kind, default=None,
                            help=f"the engine's {name} (default: the engine's)")
    return parser.parse_args(argv)


def build_llm(args: argparse.Namespace) -> LLM:
    """The engine the arguments describe; unset options keep the engine's defaults."""
    kwargs = {name: getattr(args, name) for name, _ in ENGINE_OPTIONS.values()
              if getattr(args, name) is not None}
    if args.enable_prefix_caching:
        kwargs["enable_prefix_caching"] = True
    return LLM(args.model, **kwargs)


def _argument_error(args: argparse.Namespace) -> str | None:
    """One line naming the first server option (not the engine's) out of its range."""
    if args.max_body_bytes <= 0:
        return f"--max-body-bytes must be positive, got {args.max_body_bytes}"
    if args.max_waiting_requests < 0:
        return (f"--max-waiting-requests must be 0 (no bound) or positive, got "
                f"{args.max_waiting_requests}")
    if not args.shutdown_timeout >= 0:
        return f"--shutdown-timeout must be 0 or more seconds, got {args.shutdown_timeout}"
    if args.threads < 1:
        return f"--threads must be at least 1, got {args.threads}"
    return None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    error = _argument_error(args)
    if error is not None:
        print(f"twinserve-serve: error: {error}", file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(args.threads)
    try:
        llm = build_llm(args)
    except (ValueError, TypeError) as error:   # a bad option: one line, no traceback
        print(f"twinserve-serve: error: {error}", file=sys.stderr)
        sys.exit(2)
    if not args.api_key and args.host not in LOCAL_HOSTS:
        print(f"twinserve-serve: warning: listening on {args.host} without an API key: anyone "
              f"who reaches it can use the engine (--api-key or ${API_KEY_ENV})", file=sys.stderr)
    app = create_app(llm, args.served_model_name, args.api_key or None, args.max_body_bytes,
                     args.max_waiting_requests)
    serve(app, args.host, args.port, args.log_level, args.shutdown_timeout)


if __name__ == "__main__":
    main()
