"""The `lora` config group as plain Python both backends read: `LoRASpec` (the adapters) and
`LoRAConfig` (how they are served); None when `num_adapters` is 0, the default."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from policies.validators import non_negative_int, positive_int, positive_number

# HF module names an adapter may apply to; attention ones first, then a dense gated MLP's.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES
POPULARITIES = ("uniform", "zipf")
LORA_KEYS = ("num_adapters", "ranks", "alpha", "target_modules", "popularity", "zipf_exponent",
             "max_loras", "max_cpu_loras", "policy")


@dataclass(frozen=True)
class LoRASpec:
    """Adapter i applies `B @ A` of rank `ranks[i]`, scaled by alpha / rank, to every target
    module of every layer."""

    ranks: tuple[int, ...]
    target_modules: tuple[str, ...] = ATTENTION_MODULES
    alpha: float | None = None   # None: alpha = rank (scaling 1)

    @classmethod
    def of(cls, value: LoRASpec | Mapping) -> LoRASpec:
        """The spec itself, or one from a mapping of its fields (as Hydra passes a dataclass)."""
        if isinstance(value, LoRASpec):
            return value
        return cls(ranks=tuple(int(rank) for rank in value["ranks"]),
                   target_modules=tuple(str(module) for module in value["target_modules"]),
                   alpha=value.get("alpha"))

    @property
    def num_adapters(self) -> int:
        return len(self.ranks)

    @property
    def max_rank(self) -> int:
        return max(self.ranks)

    def rank(self, lora_id: int) -> int:
        return self.ranks[lora_id]

    def scaling(self, lora_id: int) -> float:
        """PEFT's scaling of adapter `lora_id`'s update: alpha / rank."""
        rank = self.ranks[lora_id]
        return 1.0 if self.alpha is None else self.alpha / rank

    def module_dims(self, module: str, *, hidden_size: int, q_size: int, kv_size: int,
                    intermediate_size: int) -> tuple[int, int]:
        """(in features, out features) of one target module of a Llama-shaped layer."""
        dims = {"q_proj": (hidden_size, q_size), "k_proj": (hidden_size, kv_size),
                "v_proj": (hidden_size, kv_size), "o_proj": (q_size, hidden_size),
                "gate_proj": (hidden_size, intermediate_size),
                "up_proj": (hidden_size, intermediate_size),
                "down_proj": (intermediate_size, hidden_size)}
        return dims[module]

    def width_per_rank(self, **dims: int) -> int:
        """One layer's adapter parameters per unit of rank: Σ over target modules of (in + out)."""
        return sum(sum(self.module_dims(module, **dims)) for module in self.target_modules)


@dataclass(frozen=True)
class LoRAConfig:
    """The `lora` group, checked: the adapters and how they are served."""

    spec: LoRASpec
    popularity: str = "uniform"
    zipf_exponent: float = 1.0
    max_loras: int = 4
    max_cpu_loras: int | None = None   # None: every adapter held on the host
    policy: object = "lru"            # lru, a dotted class path or a {_target_: ...} mapping

    @property
    def num_adapters(self) -> int:
        return self.spec.num_adapters

    def popularity_weights(self) -> list[float]:
        """Each adapter's probability of being drawn by a request, in adapter order."""
        count = self.num_adapters
        if self.popularity == "uniform":
            return [1.0 / count] * count
        weights = [(index + 1) ** -self.zipf_exponent for index in range(count)]
        total = sum(weights)
        return [weight / total for weight in weights]


def lora_config(group: Mapping | None) -> LoRAConfig | None:
    """The `lora` group as a LoRAConfig, each key checked with an error naming it; None when LoRA
    is off (no group, or num_adapters 0)."""
    if group is None:
        return None
    unknown = sorted(set(group) - set(LORA_KEYS))
    if unknown:
        raise ValueError(f"lora: unknown key(s) {unknown}; allowed keys: {list(LORA_KEYS)}")
    num_adapters = non_negative_int("lora.num_adapters", group.get("num_adapters", 0))
    if num_adapters == 0:
        return None
    ranks = group.get("ranks", 16)
    if isinstance(ranks, int) and not isinstance(ranks, bool):
        ranks = [ranks] * num_adapters
    ranks = list(ranks)
    if len(ranks) != num_adapters:
        raise ValueError(f"lora.ranks must be one int or a list of lora.num_adapters="
                         f"{num_adapters} ints, got {len(ranks)}")
    for index, rank in enumerate(ranks):
        positive_int(f"lora.ranks[{index}]", rank)
    targets = group.get("target_modules", list(ATTENTION_MODULES))
    targets = [targets] if isinstance(targets, str) else list(targets)
    bad = [module for module in targets if module not in TARGET_MODULES]
    if bad or not targets or len(set(targets)) != len(targets):
        raise ValueError(f"lora.target_modules must be distinct names among {list(TARGET_MODULES)}, "
                         f"got {targets}")
    alpha = group.get("alpha")
    if alpha is not None:
        alpha = float(positive_number("lora.alpha", alpha))
    popularity = group.get("popularity", "uniform")
    if popularity not in POPULARITIES:
        raise ValueError(f"lora.popularity must be one of {list(POPULARITIES)}, got {popularity!r}")
    zipf_exponent = float(positive_number("lora.zipf_exponent", group.get("zipf_exponent", 1.0)))
    max_loras = positive_int("lora.max_loras", group.get("max_loras", 4))
    max_cpu_loras = group.get("max_cpu_loras")
    if max_cpu_loras is not None:
        positive_int("lora.max_cpu_loras", max_cpu_loras)
        if max_cpu_loras < max_loras:
            raise ValueError(f"lora.max_cpu_loras={max_cpu_loras} must be at least "
                             f"lora.max_loras={max_loras} (vLLM's rule) or null")
    spec = LoRASpec(ranks=tuple(int(rank) for rank in ranks),
                    target_modules=tuple(str(module) for module in targets), alpha=alpha)
    return LoRAConfig(spec=spec, popularity=popularity, zipf_exponent=zipf_exponent,
                      max_loras=int(max_loras),
                      max_cpu_loras=None if max_cpu_loras is None else int(max_cpu_loras),
                      policy=group.get("policy", "lru"))
