"""Built-in routers. A router sees the replicas only through `replica_id`, `num_outstanding` and
(to read) `kv_cache`."""
from __future__ import annotations

import math
from typing import Sequence as Seq

from policies.protocols import ReplicaView
from policies.types import Request
from policies.validators import non_negative_int, number_in


class RoundRobinRouter:
    def __init__(self):
        self._next_index = 0

    def route(self, request: Request, replicas: Seq[ReplicaView]) -> int:
        index = self._next_index % len(replicas)
        self._next_index = index + 1
        return replicas[index].replica_id


class LeastOutstandingRouter:
    """The replica with the fewest unfinished requests; ties go to the lowest id."""

    def route(self, request: Request, replicas: Seq[ReplicaView]) -> int:
        best = min(replicas, key=lambda replica: (replica.num_outstanding, replica.replica_id))
        return best.replica_id


class PrefixAffinityRouter:
    """The replica caching the longest prefix of the prompt, then the fewest unfinished requests.

    Only replicas within `load_factor` x the least load + `load_slack` are candidates, so a
    popular prefix does not pile onto one replica."""

    def __init__(self, load_factor: float = 1.5, load_slack: int = 4):
        self.load_factor = float(number_in("cluster.router.load_factor", load_factor, 1,
                                             math.inf, high_open=True))
        self.load_slack = non_negative_int("cluster.router.load_slack", load_slack)

    def route(self, request: Request, replicas: Seq[ReplicaView]) -> int:
        loads = [replica.num_outstanding for replica in replicas]
        bound = min(loads) * self.load_factor + self.load_slack
        token_ids = request.prompt_token_ids
        best = min((replica for replica, load in zip(replicas, loads) if load <= bound),
                   key=lambda replica: (-replica.kv_cache.num_cached_prefix_tokens(token_ids),
                                        replica.num_outstanding, replica.replica_id))
        return best.replica_id
