"""The closed loop of the `sessions` and `agent` workload kinds: which request a session sends
next, and when, once its previous one has finished during the run.

A `SessionSource` holds every session's turns, built before the run (their prompts do not depend
on the run: turn k+1's prompt is turn k's, ids standing for its answer, then its new tokens), and
the gap after each turn (a user's think time, a tool call's latency). Only the arrival times are
left to the run: the simulator's arrivals (sim/core/session_arrivals.py) hand it each finished or
rejected request, on either backend, and it answers with what that causes to arrive. It knows no
clock and no simpy.

Sessions start at drawn times (`rate` sessions/s) or, with `concurrency`, that many at time 0,
and when one ends the next one starts the ended one's last gap later (a closed population of
users). A rejected turn ends its session: the next turn's prompt would hold an answer that never
came.
"""
from __future__ import annotations

import math

from policies.types import Request


class SessionSource:
    """The turns of a closed-loop workload, released one at a time per session.

    `sessions[s]` is session s's requests in turn order (`session_id` s, `turn` k, request_id -1
    and arrival_time nan until they arrive); `gaps[s][k]` the seconds between turn k's finish and
    the next request it causes. `start_times` (one per session, ascending) or `concurrency`
    says how sessions start."""

    __slots__ = ("sessions", "gaps", "start_times", "concurrency", "_next_session")

    def __init__(self, sessions: list[list[Request]], gaps: list[list[float]],
                 start_times: list[float] | None = None, concurrency: int | None = None):
        if (start_times is None) == (concurrency is None):
            raise ValueError("a SessionSource takes start_times or concurrency, exactly one")
        if start_times is not None and len(start_times) != len(sessions):
            raise ValueError(f"{len(start_times)} start times for {len(sessions)} sessions")
        if concurrency is not None and concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.sessions = sessions
        self.gaps = gaps
        self.start_times = start_times
        self.concurrency = concurrency
        self._next_session = 0   # (concurrency) the first session not started yet

    @property
    def num_planned_requests(self) -> int:
        """Every turn of every session: the requests the run sends if none is rejected."""
        return sum(map(len, self.sessions))

    def all_requests(self) -> list[Request]:
        """Every planned request, session-major (what checks of the whole workload read)."""
        return [request for turns in self.sessions for request in turns]

    def first_arrivals(self) -> list[Request]:
        """The sessions' first turns that arrive without waiting for anything, their
        arrival_time set: every session's at its start time, or the first `concurrency`
        sessions' at 0."""
        if self.start_times is not None:
            firsts = [turns[0] for turns in self.sessions]
            for request, start in zip(firsts, self.start_times):
                request.arrival_time = start
            return firsts
        self._next_session = min(self.concurrency, len(self.sessions))
        firsts = [turns[0] for turns in self.sessions[:self._next_session]]
        for request in firsts:
            request.arrival_time = 0.0
        return firsts

    def on_finished(self, request: Request, now: float) -> list[Request]:
        """`request` finished (or was rejected) at `now`: the requests that causes, their
        arrival_time set. Its session's next turn a gap later; after its last turn (or a
        rejected one), with `concurrency`, the next session's first turn a gap later; else
        nothing."""
        session = request.session_id
        turns = self.sessions[session]
        turn = request.turn
        arrival_time = now + self.gaps[session][turn]
        if turn + 1 < len(turns) and request.rejected_reason is None:
            following = turns[turn + 1]
        elif self.concurrency is not None and self._next_session < len(self.sessions):
            following = self.sessions[self._next_session][0]
            self._next_session += 1
        else:
            return []
        following.arrival_time = arrival_time
        return [following]

    def gap_after(self, request: Request) -> float:
        """The least time between `request`'s end (finish or rejection) and the arrival of a
        request it causes; inf when it can cause none. A run may look this far ahead."""
        session = request.session_id
        if (request.turn + 1 < len(self.sessions[session])
                or (self.concurrency is not None and self._next_session < len(self.sessions))):
            return self.gaps[session][request.turn]
        return math.inf
