"""Power models: how many watts a board draws while it runs steps, and idle. `PowerModel` is the
protocol (`power._target_` replaces the default); `UtilisationPowerModel`, the default, is
docs/energy.md's formula, O(1) a step and exact summed over a run under the cap.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from policies import validators
from runtime.specs import HardwareSpec

# A board reaches its power limit at the roofline's GEMM share of peak FLOP/s, as a prefill runs
# near TDP; the memory weight is anchored on a measured H200 decode (docs/energy.md, both).
DEFAULT_COMPUTE_SATURATION = 0.55
DEFAULT_MEMORY_WEIGHT = 0.7


@runtime_checkable
class PowerModel(Protocol):
    """One board's power: what it draws idle, and the joules of a span of steps."""

    @property
    def idle_power_w(self) -> float:
        """Watts the board draws between steps (powered, no kernel running)."""

    def busy_energy_j(self, duration_s: float, flops: float, bytes_moved: float) -> float:
        """Joules one board draws over `duration_s` seconds of steps in which it did `flops`
        FLOPs and moved `bytes_moved` bytes of device memory, idle power included."""

    def describe(self) -> str:
        """One line: the model and its inputs, for the summary."""


@runtime_checkable
class DecodeRunPowerModel(Protocol):
    """A power model that charges a run of repeated decode steps whose work is linear
    (policies.protocols.DecodeWorkCostModel) in one call."""

    def add_decode_run_j(self, total_j: float, num_boards: int, durations_s: Sequence[float],
                         work_terms: tuple[float, float, float, float], num_decodes: int,
                         context: int) -> float:
        """`total_j` plus `num_boards` x busy_energy_j of each step of the run, added step by step
        (each decode a token further on each step)."""


class UtilisationPowerModel:
    """The default power model (module docstring): idle power plus the dynamic range scaled by
    how busy the step kept compute and memory, capped at the board's maximum."""

    def __init__(self, hardware: HardwareSpec,
                 compute_saturation: float = DEFAULT_COMPUTE_SATURATION,
                 memory_weight: float = DEFAULT_MEMORY_WEIGHT):
        self.hardware = hardware
        self.compute_saturation = float(validators.number_in(
            "power.compute_saturation", compute_saturation, 0, 1, low_open=True))
        self.memory_weight = float(validators.number_in(
            "power.memory_weight", memory_weight, 0, 1))
        self._idle_w = hardware.idle_power_w
        self._dynamic_w = hardware.max_power_w - hardware.idle_power_w
        self._s_per_flop = 1.0 / (hardware.peak_flops * self.compute_saturation)
        self._s_per_byte = self.memory_weight / hardware.memory_bandwidth

    @property
    def idle_power_w(self) -> float:
        return self._idle_w

    def busy_energy_j(self, duration_s: float, flops: float, bytes_moved: float) -> float:
        busy_s = flops * self._s_per_flop + bytes_moved * self._s_per_byte
        return (self._idle_w * duration_s
                + self._dynamic_w * (busy_s if busy_s < duration_s else duration_s))

    def add_decode_run_j(self, total_j: float, num_boards: int, durations_s: Sequence[float],
                         work_terms: tuple[float, float, float, float], num_decodes: int,
                         context: int) -> float:
        flops_per_decode, flops_per_context, weight_bytes, bytes_per_token = work_terms
        s_per_flop, s_per_byte = self._s_per_flop, self._s_per_byte
        idle_w, dynamic_w = self._idle_w, self._dynamic_w
        # As floats (exact: counts far below 2**53), sparing each step its int-to-float conversions.
        context, num_decodes, num_boards = float(context), float(num_decodes), float(num_boards)
        decode_flops = num_decodes * flops_per_decode
        for duration in durations_s:   # busy_energy_j of the protocol's sums, in their order
            busy_s = ((decode_flops + context * flops_per_context) * s_per_flop
                      + (weight_bytes + (context + num_decodes) * bytes_per_token) * s_per_byte)
            total_j += num_boards * (idle_w * duration
                                     + dynamic_w * (busy_s if busy_s < duration else duration))
            context += num_decodes
        return total_j

    def describe(self) -> str:
        hw = self.hardware
        return (f"modelled, not measured: P = {hw.idle_power_w:g} W + "
                f"({hw.max_power_w:g} - {hw.idle_power_w:g}) W x min(1, u_compute / "
                f"{self.compute_saturation:g} + {self.memory_weight:g} u_memory) per board "
                f"({hw.name}; docs/energy.md)")
