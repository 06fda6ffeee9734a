"""Built-in routers. A router sees the replicas only through `replica_id` and `num_outstanding`."""
from __future__ import annotations

from typing import Sequence as Seq

from policies.protocols import ReplicaView
from policies.types import Request


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
