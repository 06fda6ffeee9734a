"""Tensor-parallel all-reduces and pipeline stage sends from the NCCL tables, interpolated over
message size and carried to another GPU's link by bandwidth (docs/gpu-cost-model.md)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from runtime.specs import HardwareSpec
from sim.cost.gpu.linear import interpolate
from sim.cost.gpu.tables import AllReduceTable, allreduce_tables, send_recv_tables


@dataclass(frozen=True)
class AllReduceCost:
    table: AllReduceTable
    num_workers: int          # the table's curve used (tp, or the nearest measured)
    size_scale: float         # target bytes x this = the reference's equivalent message
    time_scale: float         # ring traffic 2(w-1)/w of tp against the curve's worker count
    source: str

    def seconds(self, message_bytes: np.ndarray) -> np.ndarray:
        sizes, ms = self.table.curves[self.num_workers]
        return interpolate(message_bytes * self.size_scale, sizes, ms) * self.time_scale * 1e-3


def _ring_share(workers: int) -> float:
    return 2 * (workers - 1) / workers


def allreduce_cost(hardware: HardwareSpec, tensor_parallel_size: int,
                   tables: tuple[AllReduceTable, ...] | None = None) -> AllReduceCost:
    tables = allreduce_tables() if tables is None else tables

    def distance(table: AllReduceTable) -> float:
        if table.hardware.name == hardware.name:
            return 0.0
        return abs(math.log(hardware.interconnect_bandwidth / table.hardware.interconnect_bandwidth)) + 1e-3
    table = min(tables, key=distance)
    workers = min(table.curves, key=lambda w: (abs(math.log(w / tensor_parallel_size)), w))
    size_scale = table.hardware.interconnect_bandwidth / hardware.interconnect_bandwidth
    time_scale = _ring_share(tensor_parallel_size) / _ring_share(workers)
    measured = table.hardware.name == hardware.name and workers == tensor_parallel_size
    source = (f"measured: {table.name} on {workers} GPUs" if measured else
              f"predicted from {table.name} ({table.hardware.name}) on {workers} GPUs by "
              f"interconnect bandwidth ({hardware.interconnect_gbps:g} against "
              f"{table.hardware.interconnect_gbps:g} GB/s) and ring traffic")
    return AllReduceCost(table, workers, size_scale, time_scale, source)


def send_recv_cost(hardware: HardwareSpec) -> AllReduceCost:
    """One point-to-point send between two GPUs of a node (a pipeline stage's activations to the
    next): the measured send/recv curve, carried to `hardware` by interconnect bandwidth as the
    all-reduce is."""
    return allreduce_cost(hardware, 2, send_recv_tables())
