"""The KV block pools the policies' block ids index: one device tensor per layer, and host pools
for swapped-out blocks and the prefix cache's host tier, sized by the simulator's memory
arithmetic (runtime/specs.py) so that both backends agree."""
from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import OmegaConf

import conf
from kernels import KernelOps
from runtime.specs import GIB, HardwareSpec, ModelSpec

HARDWARE_CONFIG_DIR = Path(conf.__file__).parent / "hardware"


class KVCachePool:
    """Per layer a device tensor of every block (and a host one for swapped-out blocks); a draft
    model's layers follow the target's under the same block ids, so swaps and copy-on-write move
    both models' K/V."""

    def __init__(self, spec: ModelSpec, num_blocks: int, num_host_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, ops: KernelOps,
                 draft_spec: ModelSpec | None = None, num_offload_blocks: int = 0):
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.num_offload_blocks = num_offload_blocks
        self.block_size = block_size
        self.ops = ops
        layer_shapes = [(spec.num_key_value_heads, spec.head_dim)] * spec.num_layers
        if draft_spec is not None:
            layer_shapes += [(draft_spec.num_key_value_heads, draft_spec.head_dim)] * \
                draft_spec.num_layers
        # Zeros, not empty: attention reads whole blocks and masks the unused slots, and a
        # masked NaN from uninitialised memory would still poison the weighted sum.
        self.device_caches = [torch.zeros((2, num_blocks, block_size) + shape, dtype=dtype,
                                          device=device) for shape in layer_shapes]
        pin = device.type == "cuda"
        # Host blocks are always written (swap out) before they are read, so empty is enough.
        self.host_caches = [torch.empty((2, num_host_blocks, block_size) + shape, dtype=dtype,
                                        pin_memory=pin)
                            for shape in layer_shapes] if num_host_blocks else []
        # The host tier: a slot is written (a store) before a load reads it.
        self.offload_caches = [torch.empty((2, num_offload_blocks, block_size) + shape,
                                           dtype=dtype, pin_memory=pin)
                               for shape in layer_shapes] if num_offload_blocks else []
        self.target_caches = self.device_caches[:spec.num_layers]
        self.draft_caches = self.device_caches[spec.num_layers:]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        self._move(pairs, self.device_caches, self.host_caches, "swap")

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        self._move(pairs, self.host_caches, self.device_caches, "swap")

    def offload(self, pairs: list[tuple[int, int]]) -> None:
        """Store evicted cached blocks in the host tier: (device block, tier slot) pairs."""
        self._move(pairs, self.device_caches, self.offload_caches, "offload")

    def load(self, pairs: list[tuple[int, int]]) -> None:
        """Load host-tier hits back: (tier slot, device block) pairs."""
        self._move(pairs, self.offload_caches, self.device_caches, "offload")

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        block_pairs = torch.tensor(pairs, dtype=torch.int64,
                                   device=self.device_caches[0].device)
        for cache in self.device_caches:
            self.ops.copy_blocks(cache, block_pairs)

    def _move(self, pairs, sources, destinations, pool: str) -> None:
        if not pairs:
            return
        if not (self.host_caches if pool == "swap" else self.offload_caches):
            raise RuntimeError(f"the plan moves blocks to or from the host {pool} pool, but the "
                               f"engine has none")
        block_pairs = torch.tensor(pairs, dtype=torch.int64)
        for source, destination in zip(sources, destinations):
            self.ops.swap_blocks(source, destination, block_pairs)


def hardware_spec(name: str | None, device: torch.device) -> HardwareSpec:
    """A conf/hardware spec by name, or the device as it stands: total memory and what other
    processes already hold (the rates do not matter for sizing)."""
    if name is not None:
        config_file = HARDWARE_CONFIG_DIR / f"{name}.yaml"
        if not config_file.is_file():
            known = ", ".join(sorted(path.stem for path in HARDWARE_CONFIG_DIR.glob("*.yaml")))
            raise ValueError(f"hardware must be a conf/hardware name ({known}) or None, got "
                             f"{name!r}")
        return HardwareSpec.from_config(OmegaConf.load(config_file))
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        held_by_others = max(0, total - free - torch.cuda.memory_reserved(device))
        return HardwareSpec(name=torch.cuda.get_device_name(device), memory_gb=total / GIB,
                            peak_tflops=1, memory_bandwidth_gbps=1, host_to_device_gbps=1,
                            interconnect_gbps=1, reserved_memory_gb=held_by_others / GIB)
    return HardwareSpec.from_config(OmegaConf.load(HARDWARE_CONFIG_DIR / "cpu.yaml"))
