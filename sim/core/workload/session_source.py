"""The closed loop of the session workload kinds: every turn is built before the run, since
prompts do not depend on it, and only arrival times are left to the run, which hands back each
finished request. A rejected turn ends its session: the next prompt would hold an answer that
never came."""
from __future__ import annotations

import math

from policies.types import Request


class SessionSource:
    """The turns of a closed-loop workload, released one at a time per session; `gaps[s][k]`
    is the time from turn k's finish to the next request it causes."""

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
        self._next_session = 0   # with concurrency

    @property
    def num_planned_requests(self) -> int:
        """Every turn of every session: the requests the run sends if none is rejected."""
        return sum(map(len, self.sessions))

    def all_requests(self) -> list[Request]:
        """Every planned request, session-major (what checks of the whole workload read)."""
        return [request for turns in self.sessions for request in turns]

    def first_arrivals(self) -> list[Request]:
        """The first turns that wait for nothing, their arrival_time set."""
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
        """The requests that `request` finishing (or rejected) at `now` causes, arrival_time
        set: its next turn, or with `concurrency` the next session's first."""
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
        """The least time from `request`'s end to a request it causes (inf: none), so a run may
        look this far ahead."""
        session = request.session_id
        if (request.turn + 1 < len(self.sessions[session])
                or (self.concurrency is not None and self._next_session < len(self.sessions))):
            return self.gaps[session][request.turn]
        return math.inf
