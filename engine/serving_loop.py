"""The engine's real-time loop for a server: one thread owns the LLM, adds what the HTTP handlers
submit and steps while requests are pending, and hands each request's events to the asyncio
queue of the handler that waits for them.

    loop = ServingLoop(llm); loop.start()
    events = loop.submit(prompt, params)     # in the event loop: an asyncio.Queue of Events
    event = await events.get()               # QUEUED first (or ERROR), then TOKENS..., DONE
    loop.stop()
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any

from engine.llm import LLM, RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Event kinds, in the order a request sees them.
QUEUED = "queued"      # value: the engine's request id
ERROR = "error"        # value: why the request did not run (its last event)
TOKENS = "tokens"      # value: per sample, the token ids one step appended
DONE = "done"          # value: the finished RequestOutput (its error set if it was rejected)

# How long the idle loop blocks on its queue before it checks whether it should stop.
IDLE_POLL_S = 0.1


@dataclass
class Event:
    kind: str
    value: Any


@dataclass
class _Submission:
    prompt: Any
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue


class ServingLoop:
    """The thread that owns `llm` (nothing else may call it once started)."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self._submissions: queue.SimpleQueue[_Submission | None] = queue.SimpleQueue()
        self._streams: dict[int, _Submission] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="twinserve-engine", daemon=True)
        # Why the engine stopped stepping, once a step raised: the server reports unhealthy.
        self.failure: str | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop after the step in flight; pending requests get an ERROR event."""
        self._stopping.set()
        self._submissions.put(None)   # wakes an idle loop
        self._thread.join(timeout_s)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.failure is None

    def submit(self, prompt, params: SamplingParams) -> asyncio.Queue:
        """Queue a request from the running event loop; returns the queue its Events arrive on."""
        events: asyncio.Queue = asyncio.Queue()
        if not self.is_alive:
            events.put_nowait(Event(ERROR, self.failure or "the engine is not running"))
            return events
        self._submissions.put(_Submission(prompt, params, asyncio.get_running_loop(), events))
        return events

    # ---- the engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        llm = self.llm
        while not self._stopping.is_set():
            # Block only while idle; with requests in flight, take what came and step at once.
            self._add_submissions(block=not llm.has_unfinished_requests())
            if self._stopping.is_set() or not llm.has_unfinished_requests():
                continue
            try:
                step_outputs = llm.step()
            except Exception as error:   # (a policy bug must not hang every client)
                logger.exception("the engine's step failed")
                self.failure = f"the engine's step failed: {error}"
                break
            for step_output in step_outputs:
                stream = self._streams.get(step_output.request_id)
                if stream is None:
                    continue
                if any(step_output.new_token_ids):
                    self._deliver(stream, Event(TOKENS, step_output.new_token_ids))
                if step_output.finished is not None:
                    del self._streams[step_output.request_id]
                    self._deliver(stream, Event(DONE, step_output.finished))
        reason = self.failure or "the server is shutting down"
        for stream in self._streams.values():
            self._deliver(stream, Event(ERROR, reason))
        self._streams.clear()
        while True:   # (submissions that came after the last look)
            try:
                submission = self._submissions.get_nowait()
            except queue.Empty:
                break
            if submission is not None:
                self._deliver(submission, Event(ERROR, reason))

    def _add_submissions(self, block: bool) -> None:
        try:
            submission = self._submissions.get(timeout=IDLE_POLL_S) if block else (
                self._submissions.get_nowait())
        except queue.Empty:
            return
        while submission is not None:
            output: RequestOutput = self.llm.add_request(submission.prompt, submission.params)
            if output.error is not None:
                self._deliver(submission, Event(ERROR, output.error))
            else:
                self._streams[output.request_id] = submission
                self._deliver(submission, Event(QUEUED, output.request_id))
            try:
                submission = self._submissions.get_nowait()
            except queue.Empty:
                return

    @staticmethod
    def _deliver(submission: _Submission, event: Event) -> None:
        try:
            submission.loop.call_soon_threadsafe(submission.events.put_nowait, event)
        except RuntimeError:   # its event loop closed: nobody is listening any more
            pass
