"""What an engine run checks before it builds anything: that its device exists, and that the
model runs on this machine in reasonable time, since a 7B model on a CPU otherwise takes minutes
a step silently (`backend.allow_slow=true` runs it anyway). The estimate is a roofline at the
spec-sheet rates, so its figures are lower bounds."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

import conf
from runtime.specs import GIB, HardwareSpec, ModelSpec
from runtime.kv_sizing import step_token_budget

# A step the engine may take (the longest: a prefill of the whole token budget) that runs past
# this many seconds stops the run unless backend.allow_slow: "minutes per step".
MAX_STEP_S = 60.0
# The hardware preset of the machine the CPU engine runs on.
CPU_PRESET = "cpu"
# Share of the machine's memory the weights may take (the KV pool, activations and the
# process need the rest).
MAX_WEIGHT_SHARE = 0.8
ALLOW_KEY = "backend.allow_slow"


@dataclass(frozen=True)
class EngineRunCost:
    """What one engine replica would cost on a device: its weights and memory, and lower bounds
    on a decode step of one sequence and on a prefill step of `prefill_tokens` tokens."""

    weight_bytes: int
    memory_bytes: float
    decode_step_s: float
    prefill_step_s: float
    prefill_tokens: int

    @property
    def longest_step_s(self) -> float:
        return max(self.decode_step_s, self.prefill_step_s)

    @property
    def fits(self) -> bool:
        return self.weight_bytes <= MAX_WEIGHT_SHARE * self.memory_bytes


def engine_run_cost(model: ModelSpec, rates: HardwareSpec, memory_bytes: float,
                    prefill_tokens: int) -> EngineRunCost:
    """The cost of `model` (its dtype_bytes as the engine loads it) at `rates`' peak FLOP/s and
    bandwidth, on a device of `memory_bytes`."""
    flops_per_token = 2 * model.num_layers * model.active_linear_parameters_per_layer
    # Causal attention: QK^T and PV (2 FLOPs a multiply-add each) over half the square.
    attention_flops = (4 * model.num_layers * model.num_attention_heads * model.head_dim
                       * prefill_tokens * prefill_tokens / 2)
    prefill_flops = flops_per_token * prefill_tokens + attention_flops + 2 * model.lm_head_parameters
    decode_flops = flops_per_token + 2 * model.lm_head_parameters
    weight_bytes = model.weight_bytes

    def roofline_s(flops: float) -> float:
        return max(flops / rates.peak_flops, weight_bytes / rates.memory_bandwidth)

    return EngineRunCost(weight_bytes, memory_bytes, roofline_s(decode_flops),
                         roofline_s(prefill_flops), prefill_tokens)


def requested_device(device, key: str = "backend.device") -> torch.device:
    """`device` as a torch device (None: cuda when there is one); a ValueError naming `key` when
    it is not a device name or names CUDA on a machine without it."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{key} must be cpu, cuda, cuda:<index> or null, got "
                         f"{device!r}") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{key}={device}: CUDA is not available on this machine "
                         f"({cuda_absence()}); use {key}=cpu or leave it unset")
    return resolved


def cuda_absence() -> str:
    """Why torch sees no CUDA device, in a few words."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    return f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but finds no GPU"


def machine_memory_bytes(device: torch.device) -> float:
    """The device's total memory: the GPU's, or the host's RAM for the CPU."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[1])
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def weight_dtype_bytes(model: ModelSpec, dtype) -> int:
    """Bytes per weight as the engine loads a conf/model entry: its dtype_bytes, or `dtype`'s."""
    if dtype is None or dtype == "auto":
        return model.dtype_bytes
    if not hasattr(torch, str(dtype)) or not isinstance(getattr(torch, str(dtype)), torch.dtype):
        raise ValueError(f"backend.dtype must be null, float32, bfloat16 or float16, got "
                         f"{dtype!r}")
    return getattr(torch, str(dtype)).itemsize


def check_engine_run(model, hardware, device=None, dtype=None,
                     max_num_batched_tokens: int | None = None, allow_slow: bool = False) -> None:
    """Stop an engine run before it builds its model when `device` is not there, or, unless
    allow_slow, when the engine would run on the CPU under a GPU `hardware` preset, a step would
    take more than MAX_STEP_S, or the weights would not fit the device's memory."""
    resolved = requested_device(device)
    spec = ModelSpec.from_config(model)
    preset = HardwareSpec.from_config(hardware)
    if spec.quantization is not None or spec.kv_cache_dtype != "auto":
        key = ("model.quantization" if spec.quantization is not None
               else "model.kv_cache_dtype")
        raise ValueError(f"{key}: the engine runs the model's own dtype only; fp8 weights and "
                         f"KV cache are simulator settings (backend=sim, the default)")
    if allow_slow:
        return
    on_cpu = resolved.type == "cpu"
    rates = cpu_rates() if on_cpu else preset
    spec = dataclasses.replace(spec, dtype_bytes=weight_dtype_bytes(spec, dtype))
    budget = step_token_budget(max_num_batched_tokens, spec.max_model_len,
                               "scheduler.max_num_batched_tokens")
    cost = engine_run_cost(spec, rates, machine_memory_bytes(resolved), budget)
    gpu_preset_on_cpu = on_cpu and preset.name != CPU_PRESET
    if not (gpu_preset_on_cpu or cost.longest_step_s > MAX_STEP_S or not cost.fits):
        return
    raise ValueError(slow_run_message(spec, preset.name, rates, cost, on_cpu))


def cpu_rates() -> HardwareSpec:
    return HardwareSpec.from_config(OmegaConf.load(
        Path(conf.__file__).parent / "hardware" / f"{CPU_PRESET}.yaml"))


def slow_run_message(spec: ModelSpec, preset: str, rates: HardwareSpec, cost: EngineRunCost,
                     on_cpu: bool) -> str:
    """The one line that says what the run would cost and how to ask for it anyway."""
    if not on_cpu:
        where = "on the GPU"
    elif torch.cuda.is_available():
        where = "on the CPU (backend.device=cpu)"
    else:
        where = f"on the CPU ({cuda_absence()})"
    if on_cpu and preset != CPU_PRESET:
        where = f"under hardware={preset}, a GPU's preset, {where}"
    memory = (f"{cost.weight_bytes / GIB:,.3g} GiB of {spec.dtype_bytes}-byte weights in "
              f"{cost.memory_bytes / GIB:,.0f} GiB of {'RAM' if on_cpu else 'GPU memory'}")
    if not cost.fits:
        memory += " (they do not fit)"
    return (f"backend=engine would run model={spec.name} ({parameters(spec.num_parameters)} "
            f"parameters) {where}: {memory}; at least {duration(cost.decode_step_s)} a decode "
            f"step and {duration(cost.prefill_step_s)} a {cost.prefill_tokens:,}-token prefill "
            f"step at {rates.name}'s {rates.peak_tflops:g} TFLOP/s and "
            f"{rates.memory_bandwidth_gbps:g} GB/s. Use a model and preset for this machine "
            f"(e.g. model=tiny-llama hardware={CPU_PRESET if on_cpu else preset}), or set "
            f"{ALLOW_KEY}=true to run it anyway")


def duration(seconds: float) -> str:
    """Seconds as a person reads them: 3.2 ms, 0.68 s, 4.9 min."""
    if seconds < 1:
        return f"{seconds * 1000:.3g} ms"
    if seconds < 120:
        return f"{seconds:.3g} s"
    return f"{seconds / 60:.3g} min"


def parameters(count: int) -> str:
    """A parameter count as 6.74 B or 8.4 M."""
    return f"{count / 1e9:.3g} B" if count >= 1e9 else f"{count / 1e6:.3g} M"
