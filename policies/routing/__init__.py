"""Routers: which replica of a cluster gets a new request."""
from policies.routing.routers import LeastOutstandingRouter, RoundRobinRouter

__all__ = ["LeastOutstandingRouter", "RoundRobinRouter"]
