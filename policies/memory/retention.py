"""What happens to a session's KV blocks between its turns (conf/kv_retention): `Evict` (the
default), `Pin` and `Offload`; docs/policies.md (KV managers) says what each does.
"""
from __future__ import annotations

import math
from collections import OrderedDict

from policies.capabilities import OffloadingKVCache, PinningKVCache, TierRetainingKVCache
from policies.checks import check_policy
from policies.types import Request, Sequence
from policies.validators import non_negative_number, number_in


class Evict:
    """Today's behaviour: a finished turn's blocks are freed (to the prefix cache's LRU)."""

    keeps_blocks = False

    def __init__(self, kv_cache):
        self.kv_cache = kv_cache

    def turn_finished(self, seq: Sequence, now: float) -> None:
        self.kv_cache.free(seq)

    def turn_arrived(self, request: Request, now: float) -> None:
        pass

    def turn_admitted(self, request: Request, now: float) -> None:
        pass

    def expire(self, now: float) -> None:
        pass

    def next_expiry(self) -> float:
        return math.inf

    def holds_for(self, request: Request) -> bool:
        return False

    def release_oldest(self, now: float, idle_only: bool = False) -> bool:
        return False

    def held_blocks_log(self) -> list[tuple[float, int]]:
        return []


class _SessionTurns:
    """The latest turn admitted of each session: a finished turn older than it is not kept."""

    def __init__(self):
        self._latest_admitted: dict[int, int] = {}

    def admitted(self, request: Request) -> None:
        if request.session_id is not None:
            latest = self._latest_admitted.get(request.session_id, -1)
            self._latest_admitted[request.session_id] = max(latest, request.turn)

    def worth_keeping(self, request: Request) -> bool:
        """Whether a finished request's blocks may serve its session's next turn."""
        if request.session_id is None or request.n != 1 or request.final_turn:
            return False
        latest = self._latest_admitted.get(request.session_id, -1)
        return latest <= request.turn


class Pin(_SessionTurns):
    """Keeps a finished turn's cached blocks held for its session for up to `ttl_s` seconds of
    idleness: once the session's next turn has arrived, until that turn is admitted."""

    keeps_blocks = True

    def __init__(self, kv_cache, ttl_s: float = 30.0, max_pool_fraction: float = 1.0):
        super().__init__()
        check_policy(kv_cache, PinningKVCache, "kv_cache (kv_retention=pin)")
        if not kv_cache.enable_prefix_caching:
            raise ValueError("kv_retention=pin needs kv_cache.enable_prefix_caching=true: a "
                             "session's next turn finds its pinned blocks by their prefix hashes")
        self.kv_cache = kv_cache
        self.ttl_s = float(non_negative_number("kv_retention.ttl_s", ttl_s))
        # The most blocks pins may hold: past it the oldest pins go first.
        self.max_pinned_blocks = int(number_in("kv_retention.max_pool_fraction",
                                               max_pool_fraction, 0, 1, low_open=True)
                                     * kv_cache.num_blocks)
        # Idle sessions' pins (session -> deadline, in pinning and so deadline order), then those
        # whose next turn waits to be admitted, in arrival order.
        self._idle: OrderedDict[int, float] = OrderedDict()
        self._awaited: OrderedDict[int, None] = OrderedDict()
        self._log: list[tuple[float, int]] = []   # (time, change in pinned blocks)

    def turn_finished(self, seq: Sequence, now: float) -> None:
        request = seq.request
        if not self.worth_keeping(request) or self.ttl_s == 0:
            self.kv_cache.free(seq)
            return
        session = request.session_id
        if session in self._idle or session in self._awaited:   # an earlier turn's, late
            self._unpin(session, now)
        before = self.kv_cache.num_retained_blocks()
        if self.kv_cache.retain(seq, session):
            self._idle[session] = now + self.ttl_s
            self._log.append((now, self.kv_cache.num_retained_blocks() - before))
            while self.kv_cache.num_retained_blocks() > self.max_pinned_blocks:
                self.release_oldest(now)

    def turn_arrived(self, request: Request, now: float) -> None:
        session = request.session_id
        if session in self._idle:   # no longer idle: kept until the turn is admitted
            del self._idle[session]
            self._awaited[session] = None

    def turn_admitted(self, request: Request, now: float) -> None:
        self.admitted(request)
        session = request.session_id
        if session in self._awaited or session in self._idle:
            self._unpin(session, now)

    def expire(self, now: float) -> None:
        idle = self._idle
        while idle:
            session, deadline = next(iter(idle.items()))
            if deadline > now:
                return
            self._unpin(session, deadline)

    def next_expiry(self) -> float:
        return next(iter(self._idle.values())) if self._idle else math.inf

    def holds_for(self, request: Request) -> bool:
        return request.session_id in self._awaited

    def release_oldest(self, now: float, idle_only: bool = False) -> bool:
        for pins in ((self._idle,) if idle_only else (self._idle, self._awaited)):
            if pins:
                self._unpin(next(iter(pins)), now)
                return True
        return False

    def held_blocks_log(self) -> list[tuple[float, int]]:
        return self._log

    def _unpin(self, session: int, when: float) -> None:
        if self._idle.pop(session, None) is None:
            del self._awaited[session]
        before = self.kv_cache.num_retained_blocks()
        self.kv_cache.release(session)
        self._log.append((when, self.kv_cache.num_retained_blocks() - before))


class Offload(_SessionTurns, Evict):
    """Moves a finished turn's cached blocks to the prefix cache's host tier at once; it holds
    nothing on the device for idle sessions, so Evict's other hooks are its own."""

    keeps_blocks = True

    def __init__(self, kv_cache):
        super().__init__()
        check_policy(kv_cache, TierRetainingKVCache, "kv_cache (kv_retention=offload)")
        check_policy(kv_cache, OffloadingKVCache, "kv_cache (kv_retention=offload)")
        if not kv_cache.num_offload_blocks:
            raise ValueError("kv_retention=offload needs kv_cache.offload_gb > 0 (and "
                             "kv_cache.enable_prefix_caching=true): the host tier it moves a "
                             "finished turn's blocks to")
        self.kv_cache = kv_cache
        self.num_blocks_offloaded = 0

    def turn_finished(self, seq: Sequence, now: float) -> None:
        if self.worth_keeping(seq.request):
            self.num_blocks_offloaded += self.kv_cache.free_to_tier(seq)
        else:
            self.kv_cache.free(seq)

    def turn_admitted(self, request: Request, now: float) -> None:
        self.admitted(request)   # (its prefix hit loaded the blocks back)
