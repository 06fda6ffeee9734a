"""Mixture-of-experts routing and expert parallelism: the experts a step's tokens touch in
expectation, how the experts lie over the GPUs, and the roofline cost of a step's routed experts
(docs/mixture-of-experts.md derives each)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from policies import validators
from runtime.specs import HardwareSpec, ModelSpec
from sim.cost.token_tables import TABLE_TOKENS, per_token_table

ROUTING_KEY = "cost_model.routing"
EP_KEY = "cluster.expert_parallel_size"


def routing_shares(routing, num_experts: int, key: str = ROUTING_KEY) -> np.ndarray:
    """Each expert's share of the routed assignments (sums to 1) from the routing setting."""
    if routing == "uniform":
        return np.full(num_experts, 1.0 / num_experts)
    if routing == "skewed":
        routing = {"skewed": 1.0}
    if isinstance(routing, Mapping):
        if set(routing) != {"skewed"}:
            raise ValueError(f"{key} must be uniform, skewed, {{skewed: exponent}} or a list of "
                             f"{num_experts} per-expert shares, got {dict(routing)!r}")
        exponent = validators.positive_number(f"{key}.skewed", routing["skewed"])
        weights = np.arange(1, num_experts + 1, dtype=float) ** -float(exponent)
        return weights / weights.sum()
    if isinstance(routing, Sequence) and not isinstance(routing, str):
        if len(routing) != num_experts:
            raise ValueError(f"{key}: a histogram needs one share per expert ({num_experts}), "
                             f"got {len(routing)}")
        weights = np.array([validators.non_negative_number(f"{key}[{i}]", value)
                            for i, value in enumerate(routing)], dtype=float)
        if weights.sum() <= 0:
            raise ValueError(f"{key}: a histogram needs some positive share")
        return weights / weights.sum()
    raise ValueError(f"{key} must be uniform, skewed, {{skewed: exponent}} or a list of "
                     f"{num_experts} per-expert shares, got {routing!r}")


def inclusion_probabilities(shares: np.ndarray, k: int) -> np.ndarray:
    """π_i, the chance one token picks expert i: k × share, capped at 1 with the excess spread
    over the uncapped experts in proportion to their shares (Σπ = k, each π <= 1)."""
    shares = np.asarray(shares, dtype=float)
    if k > np.count_nonzero(shares):
        raise ValueError(f"{ROUTING_KEY}: {k} experts per token need at least {k} experts with a "
                         f"positive share, got {np.count_nonzero(shares)}")
    capped = np.zeros(len(shares), dtype=bool)
    while True:   # each round caps at least one more expert, so at most E rounds
        remaining = k - capped.sum()
        free = shares * ~capped
        if remaining <= 0 or free.sum() <= 0:   # every expert with a share is picked always
            return capped.astype(float)
        inclusion = np.where(capped, 1.0, remaining * free / free.sum())
        over = inclusion > 1.0
        if not over.any():
            return inclusion
        capped |= over


def expected_experts_touched(inclusion: np.ndarray, num_tokens) -> np.ndarray:
    """Σ_i 1 − (1 − π_i)^T for each T of `num_tokens` (an array or a number; T = 0 gives 0)."""
    tokens = np.asarray(num_tokens, dtype=float)
    untouched = np.ones(tokens.shape + (len(inclusion),))
    for i, p in enumerate(inclusion):
        untouched[..., i] = 0.0 if p >= 1.0 else np.exp(tokens * np.log1p(-p))
    touched = (1.0 - untouched).sum(axis=-1)
    return np.where(tokens > 0, touched, 0.0)


def check_expert_parallel_size(model: ModelSpec, expert_parallel_size: int,
                               tensor_parallel_size: int) -> int:
    """The setting, or a ValueError naming cluster.expert_parallel_size."""
    ep = validators.positive_int(EP_KEY, expert_parallel_size)
    if ep == 1:
        return ep
    if not model.is_moe:
        raise ValueError(f"{EP_KEY}={ep} needs a mixture-of-experts model; {model.name} has no "
                         f"experts")
    if model.num_experts % ep:
        raise ValueError(f"{EP_KEY}={ep} must divide {model.name}'s num_experts="
                         f"{model.num_experts}")
    tp = tensor_parallel_size
    if tp % ep and ep % tp:
        raise ValueError(f"{EP_KEY}={ep} must divide cluster.tensor_parallel_size={tp} or be a "
                         f"multiple of it (the expert group then spans {EP_KEY} / tp replicas)")
    return ep


@dataclass(frozen=True, eq=False)
class ExpertLayout:
    """How one GPU sees a step's routed experts (docs/mixture-of-experts.md)."""

    model: ModelSpec
    tensor_parallel_size: int
    expert_parallel_size: int
    inclusion: np.ndarray          # π_i per expert

    @classmethod
    def of(cls, model: ModelSpec, routing, tensor_parallel_size: int = 1,
           expert_parallel_size: int = 1) -> ExpertLayout:
        ep = check_expert_parallel_size(model, expert_parallel_size, tensor_parallel_size)
        inclusion = inclusion_probabilities(routing_shares(routing, model.num_experts),
                                            model.num_experts_per_tok)
        return cls(model, tensor_parallel_size, ep, inclusion)

    @property
    def expert_split(self) -> int:
        """GPUs one expert's weights are spread over, counted as whole experts: max(tp, ep)."""
        return max(self.tensor_parallel_size, self.expert_parallel_size)

    @property
    def group_tokens_per_token(self) -> float:
        """Tokens the expert group routes per token of this replica: ep/tp when the group spans
        several (equally loaded) replicas, else 1."""
        return max(1.0, self.expert_parallel_size / self.tensor_parallel_size)

    @property
    def local_expert_width(self) -> int:
        """The intermediate width of one expert's slice on a GPU."""
        m = self.model
        return m.moe_intermediate_size * self.expert_parallel_size // self.expert_split

    def experts_touched(self, num_tokens) -> np.ndarray:
        """Experts (of all E) the group's routing touches at `num_tokens` tokens of this replica."""
        return expected_experts_touched(self.inclusion,
                                        np.asarray(num_tokens) * self.group_tokens_per_token)

    def expert_weight_bytes_read(self, num_tokens) -> np.ndarray:
        """Bytes of routed-expert weights one GPU reads per layer at `num_tokens` tokens."""
        m = self.model
        return (self.experts_touched(num_tokens) * m.expert_parameters * m.dtype_bytes
                / self.expert_split)

    def expert_flops(self, num_tokens) -> np.ndarray:
        """FLOPs of the routed experts on one GPU per layer: T·k tokens through an expert, /tp."""
        m = self.model
        return (2 * np.asarray(num_tokens, dtype=float) * m.num_experts_per_tok
                * m.expert_parameters / self.tensor_parallel_size)

    def all_to_all_bytes(self, num_tokens) -> np.ndarray:
        """Bytes one GPU sends in one dispatch (or combine) of a layer: its share of the group's
        routed tokens, G·k/ep × hidden × dtype, less the share its own experts keep (1/ep); 0
        without expert parallelism."""
        m, ep = self.model, self.expert_parallel_size
        if ep == 1:
            return np.zeros_like(np.asarray(num_tokens, dtype=float))
        routed = np.asarray(num_tokens, dtype=float) * self.group_tokens_per_token \
            * m.num_experts_per_tok / ep
        return routed * m.hidden_size * m.dtype_bytes * (ep - 1) / ep

    def describe(self, routing) -> str:
        return (f"{self.model.num_experts} experts, {self.model.num_experts_per_tok} per token, "
                f"routing {routing!r}; expert_parallel_size {self.expert_parallel_size}, "
                f"tensor_parallel_size {self.tensor_parallel_size}")


class RooflineExperts:
    """The routed experts' seconds per step on the roofline, all layers and all-to-alls,
    precomputed per token count so `seconds(T)` is a list lookup."""

    def __init__(self, layout: ExpertLayout, hardware: HardwareSpec, compute_efficiency: float,
                 memory_efficiency: float, transfer_efficiency: float, latency_s: float):
        self.layout = layout
        m = layout.model
        tokens = np.arange(1, TABLE_TOKENS + 1, dtype=float)
        compute_s = layout.expert_flops(tokens) / (hardware.peak_flops * compute_efficiency)
        memory_s = layout.expert_weight_bytes_read(tokens) / (
            hardware.memory_bandwidth * memory_efficiency)
        per_layer = np.maximum(compute_s, memory_s)
        if layout.expert_parallel_size > 1:
            link_rate = hardware.interconnect_bandwidth * transfer_efficiency
            per_layer += 2 * (latency_s + layout.all_to_all_bytes(tokens) / link_rate)
        self._seconds, self._slope = per_token_table(m.num_layers * per_layer)

    def seconds(self, num_tokens: int) -> float:
        if num_tokens <= TABLE_TOKENS:
            return self._seconds[num_tokens]
        return self._seconds[TABLE_TOKENS] + (num_tokens - TABLE_TOKENS) * self._slope
