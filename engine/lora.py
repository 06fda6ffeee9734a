"""Multi-LoRA serving on the engine: the run's adapters (seeded random A and B per target module
of every layer), their device slots, and `LoRALinear`, which adds a step's adapter deltas to a
target nn.Linear's output.

A step follows the plan's LoRA placement where it has one (checked), else loads the adapters its
batch needs, evicting the least recently used. The step's LoRABatch travels on one shared
`LoRAStep` object for the forward only, since HF's Llama calls its projections without the
forward's keyword arguments.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from kernels import KernelOps
from kernels.lora_batch import NO_ADAPTER, LoRABatch
from policies.lora.spec import LoRASpec, lora_config
from policies.validators import non_negative_int

# B's spread, so that an adapter moves the tiny random model's outputs as a fine-tune would and
# changes its greedy continuations (PEFT's zero B would make every adapter the base model).
LORA_B_STD = 0.1


@dataclass(frozen=True)
class LoRAAdapters:
    """The run's adapters (adapter i: rank spec.ranks[i], scaled by alpha / rank), the device
    slots and the weights' seed; from_config checks the group."""

    spec: LoRASpec
    max_loras: int
    seed: int = 0

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.spec.ranks

    @property
    def target_modules(self) -> tuple[str, ...]:
        return self.spec.target_modules

    @property
    def num_adapters(self) -> int:
        return self.spec.num_adapters

    def scaling(self, index: int) -> float:
        """PEFT's lora_alpha / r of adapter `index`."""
        return self.spec.scaling(index)

    @classmethod
    def from_config(cls, group: Mapping, seed: int = 0) -> "LoRAAdapters | None":
        """From the lora config group (read and checked by policies/lora/spec.py lora_config,
        as the simulator reads it); None when it serves no adapters."""
        config = lora_config(group)
        if config is None:
            return None
        return cls(config.spec, config.max_loras, non_negative_int("seed", seed))


def lora_group(setting) -> Mapping | None:
    """The lora config group a `lora` setting names: None (off), a mapping of the group's keys,
    or a conf/lora name."""
    from omegaconf import OmegaConf

    from runtime.policy_config import CONF_DIR, config_names

    if setting is None or isinstance(setting, Mapping):
        return setting
    path = CONF_DIR / "lora" / f"{setting}.yaml"
    if not isinstance(setting, str) or not path.is_file():
        raise ValueError(f"lora must be None, a mapping of the lora group's keys or one of "
                         f"{config_names('lora')} (conf/lora), got {setting!r}")
    return OmegaConf.load(path)


def lora_adapters(setting, seed: int = 0) -> LoRAAdapters | None:
    """The adapters of a `lora` setting (lora_group's), or None when it serves none."""
    group = lora_group(setting)
    return None if group is None else LoRAAdapters.from_config(group, seed)


def target_linears(model: torch.nn.Module, target_modules) -> list[tuple[str, torch.nn.Linear]]:
    """(qualified name, module) of every nn.Linear whose last name part is a target, in the
    model's order."""
    found = [(name, module) for name, module in model.named_modules()
             if name.rsplit(".", 1)[-1] in target_modules
             and isinstance(module, torch.nn.Linear)]
    missing = sorted(set(target_modules) - {name.rsplit(".", 1)[-1] for name, _ in found})
    if missing:
        raise ValueError(f"lora.target_modules: the model has no {', '.join(missing)} linear "
                         f"layers")
    return found


def target_shapes(model: torch.nn.Module, target_modules) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every target module, by qualified name, in model order."""
    return {name: (linear.in_features, linear.out_features)
            for name, linear in target_linears(model, target_modules)}


def adapter_weights(adapters: LoRAAdapters, index: int, shapes: dict[str, tuple[int, int]]
                    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Adapter `index`'s (A [rank, in], B [out, rank]) per target module of `shapes`
    (target_shapes), fp32 on the CPU, drawn from a generator seeded by (adapters.seed, index)."""
    seed = int(np.random.SeedSequence([adapters.seed, index]).generate_state(1)[0])
    gen = torch.Generator().manual_seed(seed)
    rank = adapters.ranks[index]
    weights = {}
    for name, (in_features, out_features) in shapes.items():
        lora_a = torch.randn(rank, in_features, generator=gen) / in_features ** 0.5
        lora_b = torch.randn(out_features, rank, generator=gen) * LORA_B_STD
        weights[name] = (lora_a, lora_b)
    return weights


class LoRAStep:
    """The step the model is running, shared by every LoRALinear of one model: the step's
    batch during a forward that applies adapters, else None."""

    def __init__(self, ops: KernelOps, scalings: torch.Tensor):
        self.ops = ops
        self.scalings = scalings     # [max_loras] fp32: each slot's alpha / rank
        self.batch: LoRABatch | None = None


class LoRALinear(torch.nn.Module):
    """A target nn.Linear and its adapter slots: base_layer(x) plus, for each token whose step
    batch gives it a slot, that slot's scaled B A x (the ops' grouped kernel)."""

    def __init__(self, base_layer: torch.nn.Linear, max_loras: int, max_rank: int,
                 step: LoRAStep):
        super().__init__()
        self.base_layer = base_layer
        weight = base_layer.weight
        self.register_buffer("lora_a", torch.zeros(max_loras, max_rank, base_layer.in_features,
                                                   dtype=weight.dtype, device=weight.device))
        self.register_buffer("lora_b", torch.zeros(max_loras, base_layer.out_features, max_rank,
                                                   dtype=weight.dtype, device=weight.device))
        self.step = step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        batch = self.step.batch
        if batch is not None:
            self.step.ops.add_lora(out.view(-1, out.shape[-1]), x.reshape(-1, x.shape[-1]),
                                   self.lora_a, self.lora_b, self.step.scalings, batch)
        return out


class ServedAdapters:
    """The adapters a model serves, in max_loras device slots (module docstring)."""

    def __init__(self, model: torch.nn.Module, adapters: LoRAAdapters, ops: KernelOps):
        if ops.add_lora is None:
            raise ValueError(f"kernel_backend {ops.name!r} has no LoRA kernel (add_lora)")
        self.adapters = adapters
        weight = next(model.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        self.step = LoRAStep(ops, torch.zeros(adapters.max_loras, dtype=torch.float32,
                                              device=self.device))
        self.modules: dict[str, LoRALinear] = {}
        max_rank = max(adapters.ranks)
        for name, linear in target_linears(model, adapters.target_modules):
            parent_name, _, child = name.rpartition(".")
            wrapper = LoRALinear(linear, adapters.max_loras, max_rank, self.step)
            setattr(model.get_submodule(parent_name), child, wrapper)
            self.modules[name] = wrapper
        self.shapes = {name: (m.base_layer.in_features, m.base_layer.out_features)
                       for name, m in self.modules.items()}
        self._host: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.slot_adapters: list[int | None] = [None] * adapters.max_loras
        self._last_used = [0] * adapters.max_loras
        self._clock = 0
        self.num_loads = 0   # adapters copied into a device slot, over the run

    def host_weights(self, index: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Adapter `index`'s weights in host memory, in the model's dtype (made on first use)."""
        if index not in self._host:
            weights = adapter_weights(self.adapters, index, self.shapes)
            self._host[index] = {name: (a.to(self.dtype), b.to(self.dtype))
                                 for name, (a, b) in weights.items()}
        return self._host[index]

    def batch_for(self, token_lora_ids: np.ndarray, placement: Mapping[int, int] | None = None,
                  loads: Iterable[tuple[int, int]] = ()) -> LoRABatch | None:
        """The step's LoRABatch for tokens using adapters token_lora_ids (None when none does),
        following the plan's `placement` and `loads` where given, else loading missing ones (LRU)."""
        for lora_id, slot in loads:
            self._check_id(lora_id)
            if not 0 <= slot < self.adapters.max_loras:
                raise ValueError(f"the plan loads adapter {lora_id} into slot {slot}, outside "
                                 f"the lora.max_loras={self.adapters.max_loras} slots")
            self._load(lora_id, slot)
        needed = [int(i) for i in np.unique(token_lora_ids) if i != NO_ADAPTER]
        if not needed:
            return None
        for lora_id in needed:
            self._check_id(lora_id)
        if len(needed) > self.adapters.max_loras:
            raise ValueError(f"a step's batch uses {len(needed)} adapters, more than "
                             f"lora.max_loras={self.adapters.max_loras} device slots: the "
                             f"scheduler must keep each batch within max_loras")
        if placement is None:
            slot_of = self._place(needed)
        else:
            slot_of = {lora_id: placement.get(lora_id) for lora_id in needed}
            for lora_id, slot in slot_of.items():
                if slot is None or not 0 <= slot < self.adapters.max_loras or \
                        self.slot_adapters[slot] != lora_id:
                    raise ValueError(f"the plan runs adapter {lora_id} in slot {slot}, which "
                                     f"does not hold it (slots hold {self.slot_adapters}): "
                                     f"its LoRA manager did not load it")
        lookup = np.full(self.adapters.num_adapters + 1, NO_ADAPTER, dtype=np.int64)
        for lora_id, slot in slot_of.items():
            lookup[lora_id] = slot
        return LoRABatch.build(lookup[token_lora_ids], self.device)  # NO_ADAPTER -> last entry

    def _check_id(self, lora_id: int) -> None:
        if not 0 <= lora_id < self.adapters.num_adapters:
            raise ValueError(f"lora_id {lora_id} is not one of the run's "
                             f"{self.adapters.num_adapters} adapters (lora.num_adapters)")

    def _place(self, needed: list[int]) -> dict[int, int]:
        """Each needed adapter's slot, loading the missing ones into free slots or the least
        recently used slots no needed adapter holds."""
        self._clock += 1
        resident = {lora_id: slot for slot, lora_id in enumerate(self.slot_adapters)
                    if lora_id is not None}
        missing = [lora_id for lora_id in needed if lora_id not in resident]
        spare = sorted((slot for slot, lora_id in enumerate(self.slot_adapters)
                        if lora_id not in needed),
                       key=lambda slot: (self.slot_adapters[slot] is not None,
                                         self._last_used[slot]))
        for lora_id, slot in zip(missing, spare):
            self._load(lora_id, slot)
            resident[lora_id] = slot
        slot_of = {lora_id: resident[lora_id] for lora_id in needed}
        for slot in slot_of.values():
            self._last_used[slot] = self._clock
        return slot_of

    def _load(self, lora_id: int, slot: int) -> None:
        """Copy adapter lora_id into device slot `slot` of every target module."""
        rank = self.adapters.ranks[lora_id]
        for name, (lora_a, lora_b) in self.host_weights(lora_id).items():
            module = self.modules[name]
            module.lora_a[slot].zero_()
            module.lora_a[slot, :rank].copy_(lora_a)
            module.lora_b[slot].zero_()
            module.lora_b[slot, :, :rank].copy_(lora_b)
        self.step.scalings[slot] = self.adapters.scaling(lora_id)
        self.slot_adapters[slot] = lora_id
        self.num_loads += 1

    def warm_up(self) -> None:
        """Run the kernel once per target module shape (on CUDA: compiles Triton's now, not in
        a timed step); the slots are left as they were."""
        batch = LoRABatch.build(np.zeros(1, dtype=np.int64), self.device)
        first_of_shape = {shape: self.modules[name] for name, shape in self.shapes.items()}
        for (in_features, out_features), module in first_of_shape.items():
            x = torch.zeros(1, in_features, dtype=self.dtype, device=self.device)
            out = torch.zeros(1, out_features, dtype=self.dtype, device=self.device)
            self.step.ops.add_lora(out, x, module.lora_a, module.lora_b, self.step.scalings,
                                   batch)

    @contextlib.contextmanager
    def applying(self, batch: LoRABatch | None):
        """The model's LoRALinears add `batch`'s deltas inside this block (none: base model)."""
        self.step.batch = batch
        try:
            yield
        finally:
            self.step.batch = None
