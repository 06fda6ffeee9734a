"""What stands around twinserve-serve's routes: RequestGuard, run before any of them (the API key:
401; the body's size: 413), and DrainingServer, uvicorn's server draining the engine on SIGTERM."""
from __future__ import annotations

import hmac
import json
import signal
import threading
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI

from engine.openai_protocol import error_body
from engine.serving_loop import ServingLoop

# Past the shutdown timeout, how much longer clients get to take their last bytes.
SHUTDOWN_GRACE_S = 5.0


class RequestGuard:
    """ASGI middleware run before any route: the API key (401) and the body's size (413). The
    body is read here and handed on whole, so later reads of `receive` see the disconnect."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app = app
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if (self.expected is not None and scope["path"].startswith("/v1")
                and not hmac.compare_digest(headers.get(b"authorization", b""), self.expected)):
            return await _send_error(send, "invalid or missing API key: send the header "
                                     "'Authorization: Bearer <key>'", 401)
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return await self._too_large(send)
        body = bytearray()
        while True:   # (the whole body, at most max_body_bytes, whatever Content-Length said)
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message], receive), send)
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                return await self._too_large(send)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay([{"type": "http.request", "body": bytes(body),
                                        "more_body": False}], receive), send)

    async def _too_large(self, send):
        await _send_error(send, f"the request body is larger than {self.max_body_bytes} bytes",
                          413)


def _replay(messages: list[dict], receive):
    """A `receive` that returns `messages` first, then what `receive` returns."""
    async def replayed():
        return messages.pop(0) if messages else await receive()
    return replayed


async def _send_error(send, message: str, status: int) -> None:
    body = json.dumps(error_body(message, status)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class DrainingServer(uvicorn.Server):
    """uvicorn's server, which on SIGTERM or Ctrl-C drains the engine: running requests may finish
    for `shutdown_timeout_s`, then the rest are aborted with an answer each (a second Ctrl-C
    quits at once)."""

    def __init__(self, config: uvicorn.Config, serving: ServingLoop, shutdown_timeout_s: float):
        # (a backstop for a client that never reads its last bytes)
        config.timeout_graceful_shutdown = shutdown_timeout_s + SHUTDOWN_GRACE_S
        super().__init__(config)
        self.serving = serving
        self.shutdown_timeout_s = shutdown_timeout_s

    async def shutdown(self, sockets=None) -> None:
        self.serving.drain(self.shutdown_timeout_s)
        await super().shutdown(sockets)

    @contextmanager
    def capture_signals(self):
        # uvicorn's own raises the signal again once shut down, which kills a drained server
        # with SIGTERM's status instead of 0.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve(app: FastAPI, host: str, port: int, log_level: str, shutdown_timeout_s: float) -> None:
    """Serve `app` (create_app's) until SIGTERM or Ctrl-C, then drain it."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level)
    DrainingServer(config, app.state.serving, shutdown_timeout_s).run()
