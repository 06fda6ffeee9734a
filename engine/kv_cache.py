"""The KV block pools the policies' block ids index: one device tensor per layer, and a host pool
for swapped-out blocks. Sized by the simulator's memory arithmetic so both backends agree."""
from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import OmegaConf

import conf
from kernels import KernelOps
from sim.specs import GIB, HardwareSpec, ModelSpec, kv_cache_num_blocks

HARDWARE_CONFIG_DIR = Path(conf.__file__).parent / "hardware"


class KVCachePool:
    def __init__(self, spec: ModelSpec, num_blocks: int, num_host_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, ops: KernelOps):
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.block_size = block_size
        self.ops = ops
        shape = (2, num_blocks, block_size, spec.num_key_value_heads, spec.head_dim)
        # Zeros, not empty: attention reads whole blocks and masks the unused slots, and a
        # masked NaN from uninitialised memory would still poison the weighted sum.
        self.device_caches = [torch.zeros(shape, dtype=dtype, device=device)
                              for _ in range(spec.num_layers)]
        host_shape = (2, num_host_blocks) + shape[2:]
        pin = device.type == "cuda"
        # Host blocks are always written (swap out) before they are read, so empty is enough.
        self.host_caches = [torch.empty(host_shape, dtype=dtype, pin_memory=pin)
                            for _ in range(spec.num_layers)] if num_host_blocks else []

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        self._move(pairs, self.device_caches, self.host_caches)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        self._move(pairs, self.host_caches, self.device_caches)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        block_pairs = torch.tensor(pairs, dtype=torch.int64,
                                   device=self.device_caches[0].device)
        for cache in self.device_caches:
            self.ops.copy_blocks(cache, block_pairs)

    def _move(self, pairs, sources, destinations) -> None:
        if not pairs:
            return
        if not self.host_caches:
            raise RuntimeError("the plan swaps blocks but the engine has no host swap pool")
        block_pairs = torch.tensor(pairs, dtype=torch.int64)
        for source, destination in zip(sources, destinations):
            self.ops.swap_blocks(source, destination, block_pairs)


def hardware_spec(name: str | None, device: torch.device) -> HardwareSpec:
    """A conf/hardware spec by name, or the device as it stands: total memory and what other
    processes already hold (the rates do not matter for sizing)."""
    if name is not None:
        return HardwareSpec.from_config(OmegaConf.load(HARDWARE_CONFIG_DIR / f"{name}.yaml"))
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        held_by_others = max(0, total - free - torch.cuda.memory_reserved(device))
        return HardwareSpec(name=torch.cuda.get_device_name(device), memory_gb=total / GIB,
                            peak_tflops=1, memory_bandwidth_gbps=1, host_to_device_gbps=1,
                            interconnect_gbps=1, reserved_memory_gb=held_by_others / GIB)
    return HardwareSpec.from_config(OmegaConf.load(HARDWARE_CONFIG_DIR / "cpu.yaml"))


def num_device_blocks(spec: ModelSpec, hardware: HardwareSpec, device: torch.device,
                      block_size: int, max_num_seqs: int, max_model_len: int,
                      max_num_batched_tokens: int, gpu_memory_utilization: float,
                      cpu_kv_cache_gb: float) -> int:
    """KV blocks for the device pool, by the simulator's arithmetic. On CPU the arithmetic would
    claim most of host RAM, so the pool is capped at what max_num_seqs full-length sequences
    need and at cpu_kv_cache_gb."""
    num_blocks = kv_cache_num_blocks(spec, hardware, block_size,
                                     gpu_memory_utilization=gpu_memory_utilization,
                                     max_num_batched_tokens=max_num_batched_tokens,
                                     max_num_seqs=max_num_seqs)
    if device.type != "cuda":
        enough = max_num_seqs * -(-max_model_len // block_size)
        budget = int(cpu_kv_cache_gb * GIB // spec.kv_bytes_per_block(block_size))
        num_blocks = max(1, min(num_blocks, enough, budget))
    return num_blocks


def num_host_blocks(spec: ModelSpec, block_size: int, swap_space_gb: float) -> int:
    return int(swap_space_gb * GIB // spec.kv_bytes_per_block(block_size))
