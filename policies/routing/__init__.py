"""Routers: which replica of a cluster gets a new request."""
from policies.routing.routers import LeastOutstandingRouter, PrefixAffinityRouter, RoundRobinRouter

__all__ = ["LeastOutstandingRouter", "PrefixAffinityRouter", "RoundRobinRouter"]
