"""`twinserve-serve`: the engine behind an OpenAI-compatible HTTP server (FastAPI + uvicorn).

Routes: POST /v1/completions (streamed as server-sent events when `stream` is true), GET
/v1/models, GET /v1/engine_settings (what a benchmark client records with its run), GET /health.
One thread steps the engine (engine/serving_loop.py); the handlers only wait on its events.

    twinserve-serve --model tiny-llama --port 8000 --scheduler chunked_prefill --num-gpu-blocks 512
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from engine.llm import LLM
from engine.openai_protocol import (BadRequest, CompletionRequest, CompletionStream, error_body,
                                    engine_request, validation_message)
from engine.serving_loop import DONE, ERROR, QUEUED, TOKENS, ServingLoop
from policies.batching import ChunkedPrefillScheduler

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
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


def _error(message: str, status: int) -> JSONResponse:
    return JSONResponse(error_body(message, status), status_code=status)


def _sse(body: dict | str) -> bytes:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n".encode()


def create_app(llm: LLM, served_model_name: str | None = None) -> FastAPI:
    """The server's app; its lifespan starts and stops the thread that steps `llm`."""
    served = served_model_name or llm.config.model
    settings = engine_settings(llm)
    serving = ServingLoop(llm)
    decode = llm.tokenizer.decode if llm.tokenizer is not None else None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        serving.start()
        try:
            yield
        finally:
            serving.stop()

    app = FastAPI(title="twinserve", lifespan=lifespan)
    app.state.serving = serving

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, error: RequestValidationError) -> JSONResponse:
        return _error(validation_message(error.errors()), 400)

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

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        if body.model is not None and body.model != served:
            return _error(f"model: {body.model!r} is not served here; this server serves "
                          f"{served!r}", 404)
        try:
            prompt, params = engine_request(body)
        except BadRequest as error:
            return _error(str(error), 400)
        events = serving.submit(prompt, params)
        first = await events.get()
        if first.kind == ERROR:
            status = 400 if serving.is_alive else 503
            return _error(first.value, status)
        assert first.kind == QUEUED, first
        stream = CompletionStream(served, decode)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(_stream_events(events, stream, include_usage),
                                     media_type="text/event-stream")
        while True:
            event = await events.get()
            if event.kind == ERROR:
                return _error(event.value, 503)
            if event.kind == DONE:
                output = event.value
                if output.error is not None:   # rejected by the scheduler while it waited
                    return _error(f"rejected by the scheduler: {output.error}", 503)
                return stream.completion(output)

    return app


async def _stream_events(events, stream: CompletionStream,
                         include_usage: bool) -> AsyncIterator[bytes]:
    """A request's events as SSE chunks: one per step that gave it tokens, then the finish
    reasons, the usage (when asked) and [DONE]."""
    while True:
        event = await events.get()
        if event.kind == TOKENS:
            yield _sse(stream.tokens_chunk(event.value))
            continue
        if event.kind == ERROR:
            yield _sse(error_body(event.value, 503))
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


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = parse_args(argv)
    try:
        llm = build_llm(args)
    except (ValueError, TypeError) as error:   # a bad option: one line, no traceback
        print(f"twinserve-serve: error: {error}", file=sys.stderr)
        sys.exit(2)
    uvicorn.run(create_app(llm, args.served_model_name), host=args.host, port=args.port,
                log_level=args.log_level)


if __name__ == "__main__":
    main()
