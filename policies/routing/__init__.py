"""Routers: which replica of a cluster gets a new request; and whether a request runs its prefill
and decode on separate pools (disaggregation)."""
from policies.routing.disaggregation import (AlwaysDisaggregate, LongPromptsDisaggregate,
                                             NeverDisaggregate)
from policies.routing.lora_affinity import LoRAAffinityRouter
from policies.routing.routers import LeastOutstandingRouter, PrefixAffinityRouter, RoundRobinRouter

__all__ = ["AlwaysDisaggregate", "LeastOutstandingRouter", "LoRAAffinityRouter",
           "LongPromptsDisaggregate", "NeverDisaggregate", "PrefixAffinityRouter",
           "RoundRobinRouter"]
