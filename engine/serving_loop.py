"""The engine's real-time loop for a server: one thread owns the LLM, adds what the HTTP handlers
submit, steps while requests are pending, and hands each request's events to its handler's
asyncio queue (QUEUED or ERROR first, then TOKENS..., DONE).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from engine.llm import LLM, RequestOutput
from engine.sampling_params import SamplingParams
from engine.server_metrics import ServingStats

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
    submitted_at: float = field(default_factory=time.perf_counter)
    request_id: int | None = None      # set once the engine added it
    first_token_at: float | None = None
    cancelled: bool = False            # its client went away (abort)
    timeout_s: float | None = None     # when the engine abandons it (None: never)


class ServingLoop:
    """The thread that owns `llm` (nothing else may call it once started)."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self._submissions: queue.SimpleQueue[_Submission | None] = queue.SimpleQueue()
        self._streams: dict[int, _Submission] = {}
        self._aborts: queue.SimpleQueue[_Submission] = queue.SimpleQueue()
        self.num_steps = 0       # engine steps run (a request that is aborted stops adding to it)
        self.num_aborted = 0     # requests stopped because their client went away
        # Submitted and not yet released by their handler's `abort` (read and written only on
        # the event loop's thread, so the bound on waiting requests needs no lock).
        self.num_in_flight = 0
        self.draining = False    # `drain` was called: the handlers take no new request
        self._drain_deadline: float | None = None
        self._stop_reason = "the server is shutting down"
        self.stats = ServingStats()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="twinserve-engine", daemon=True)
        # Why the engine stopped stepping, once a step raised: the server reports unhealthy.
        self.failure: str | None = None

    def start(self) -> None:
        self._thread.start()

    def drain(self, timeout_s: float) -> None:
        """Stop once every request already submitted has finished, or after `timeout_s`, when
        those still pending get an ERROR event."""
        self.draining = True
        self._drain_deadline = time.monotonic() + timeout_s
        self._stop_reason = (f"the server is shutting down and the request did not finish "
                             f"within its shutdown timeout ({timeout_s:g} s)")
        self._submissions.put(None)   # wakes an idle loop

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop after the step in flight; pending requests get an ERROR event."""
        self._stopping.set()
        self._submissions.put(None)   # wakes an idle loop
        self._thread.join(timeout_s)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.failure is None

    @property
    def num_waiting(self) -> int:
        """Submitted requests that do not run: queued for the engine thread, or waiting or
        swapped out in its scheduler (running as the engine thread last saw it)."""
        return self.num_in_flight - self.stats.num_running

    def submit(self, prompt, params: SamplingParams,
               timeout_s: float | None = None) -> tuple[asyncio.Queue, _Submission | None]:
        """Queue a request from the event loop (abandoned if unfinished `timeout_s` after it is
        added); its events' queue and the handle `abort` takes (None when not running)."""
        events: asyncio.Queue = asyncio.Queue()
        if not self.is_alive:
            events.put_nowait(Event(ERROR, self.failure or "the engine is not running"))
            return events, None
        submission = _Submission(prompt, params, asyncio.get_running_loop(), events,
                                 timeout_s=timeout_s)
        self.num_in_flight += 1
        self._submissions.put(submission)
        return events, submission

    def abort(self, submission: _Submission | None) -> None:
        """Release a submitted request once its handler answered or its client went away: it
        leaves the engine before its next step, its blocks freed. None is ignored."""
        if submission is not None and not submission.cancelled:
            submission.cancelled = True
            self.num_in_flight -= 1
            self._aborts.put(submission)

    # ---- the engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        llm = self.llm
        while not self._stopping.is_set() and not self._drained():
            # Block only while idle; with requests in flight, take what came and step at once.
            self._add_submissions(block=not llm.has_unfinished_requests())
            self._apply_aborts()
            self.stats.observe_engine(llm.scheduler)
            if self._stopping.is_set() or not llm.has_unfinished_requests():
                continue
            try:
                step_outputs = llm.step()
                self.num_steps += 1
            except Exception as error:   # (a policy bug must not hang every client)
                logger.exception("the engine's step failed")
                self.failure = f"the engine's step failed: {error}"
                break
            for step_output in step_outputs:
                stream = self._streams.get(step_output.request_id)
                if stream is None:
                    continue
                if any(step_output.new_token_ids):
                    if stream.first_token_at is None:
                        stream.first_token_at = time.perf_counter()
                    self._deliver(stream, Event(TOKENS, step_output.new_token_ids))
                if step_output.finished is not None:
                    del self._streams[step_output.request_id]
                    self.stats.observe_finished(stream, step_output.finished)
                    self._deliver(stream, Event(DONE, step_output.finished))
        self.stats.observe_engine(llm.scheduler)
        reason = self.failure or self._stop_reason
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

    def _drained(self) -> bool:
        """Draining, and every request taken has finished (or the drain's time is up)."""
        if self._drain_deadline is None:
            return False
        return time.monotonic() >= self._drain_deadline or (not self._streams
                                                            and self._submissions.empty())

    def _add_submissions(self, block: bool) -> None:
        try:
            submission = self._submissions.get(timeout=IDLE_POLL_S) if block else (
                self._submissions.get_nowait())
        except queue.Empty:
            return
        while submission is not None:
            if submission.cancelled:   # its client left before the engine saw it
                submission = self._next_submission()
                continue
            output: RequestOutput = self.llm.add_request(submission.prompt, submission.params,
                                                         timeout_s=submission.timeout_s)
            if output.error is not None:
                self._deliver(submission, Event(ERROR, output.error))
            else:
                submission.request_id = output.request_id
                self._streams[output.request_id] = submission
                self._deliver(submission, Event(QUEUED, output.request_id))
            submission = self._next_submission()

    def _next_submission(self) -> _Submission | None:
        try:
            return self._submissions.get_nowait()
        except queue.Empty:
            return None

    def _apply_aborts(self) -> None:
        while True:
            try:
                submission = self._aborts.get_nowait()
            except queue.Empty:
                return
            if self._streams.pop(submission.request_id, None) is not None:
                self.llm.abort_request(submission.request_id)
                self.num_aborted += 1
                self.stats.observe_aborted(submission)

    @staticmethod
    def _deliver(submission: _Submission, event: Event) -> None:
        try:
            submission.loop.call_soon_threadsafe(submission.events.put_nowait, event)
        except RuntimeError:   # its event loop closed: nobody is listening any more
            pass
