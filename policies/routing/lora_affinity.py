"""LoRA-adapter affinity across replicas (dLoRA-style): a request goes to a replica that holds its
adapter (in its running batch first, else loaded in a device slot), among the replicas not
overloaded; else, and for base-model requests, to the least loaded one."""
from __future__ import annotations

from typing import Sequence as Seq

from policies.protocols import LoRAReplicaView
from policies.routing.routers import PrefixAffinityRouter
from policies.types import Request


class LoRAAffinityRouter(PrefixAffinityRouter):
    """Prefers the replica that holds the request's adapter (in its batch, then loaded), under
    PrefixAffinityRouter's load bound so a popular adapter does not pile onto one replica."""

    def route(self, request: Request, replicas: Seq[LoRAReplicaView]) -> int:
        loads = [replica.num_outstanding for replica in replicas]
        bound = min(loads) * self.load_factor + self.load_slack
        lora_id = request.lora_id
        best = min((replica for replica, load in zip(replicas, loads) if load <= bound),
                   key=lambda replica: (_holds(replica, lora_id), replica.num_outstanding,
                                        replica.replica_id))
        return best.replica_id


def _holds(replica: LoRAReplicaView, lora_id: int | None) -> int:
    """0: the adapter is in the replica's running batch; 1: loaded on its device; 2: neither
    (or a base-model request, or a replica without LoRA)."""
    lora = replica.lora
    if lora_id is None or lora is None:
        return 2
    if lora_id in lora.batch_loras:
        return 0
    return 1 if lora.is_loaded(lora_id) else 2
