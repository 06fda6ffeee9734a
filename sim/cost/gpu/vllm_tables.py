"""vLLM's own kernels timed by shape on each GPU, per vLLM version (data/gpu/aiconfigurator/,
NVIDIA's aiconfigurator measurements; data/gpu/README.md), parsed once per process into arrays.
Every latency here is in milliseconds, as the tables store it."""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sim.cost.gpu.tables import DATA_DIR

TABLES_DIR = DATA_DIR / "aiconfigurator"

# conf/hardware name -> the measured system whose kernels it runs (same chip; the note says why).
SYSTEMS = {
    "h100-80gb": ("h100_sxm", "measured"),
    "h800-80gb": ("h100_sxm", "an H100 with slower NVLink: its kernels"),
    "h200": ("h200_sxm", "measured"),
    "a100-80gb": ("a100_sxm", "measured"),
    "a100-40gb": ("a100_sxm", "the 80 GB board's kernels (same chip)"),
    "a800-80gb": ("a100_sxm", "an A100 with slower NVLink: its kernels"),
    "rtx-pro-6000": ("rtx_pro_6000_server", "the server edition's kernels (same GB202 chip)"),
}

# The version a run without `cost_model.engine_version` predicts (the nearest measured is used).
DEFAULT_ENGINE_VERSION = "0.19"

# The largest message (bytes) vLLM's custom all-reduce takes, by GPUs (vLLM's all_reduce_utils:
# on Hopper, symmetric memory takes over from it up to the second limit; elsewhere its 8 MiB).
# Larger messages go to NCCL.
CUSTOM_ALLREDUCE_MAX_BYTES = {2: 64 << 20, 4: 32 << 20, 6: 512 << 10, 8: 256 << 10}
SYMM_MEM_ALLREDUCE_MAX_BYTES = {2: 64 << 20, 4: 32 << 20, 6: 64 << 20, 8: 64 << 20}
SYMM_MEM_SYSTEMS = ("h100_sxm", "h200_sxm")
OTHER_CUSTOM_ALLREDUCE_MAX_BYTES = 8 << 20

# Systems whose vLLM FLASH_ATTN backend runs FlashAttention 2 (vLLM's fa_utils.py: FA3 on sm90,
# FA4 on sm100, FA2 elsewhere: the A100's sm80, the RTX PRO 6000's sm120).
FA2_SYSTEMS = ("a100_sxm", "rtx_pro_6000_server")
# FA2 on a paged KV cache runs its split-KV kernel, whose query tile is 64 rows for every head_dim
# (vllm-project/flash-attention, flash_fwd_launch_template.h, run_mha_fwd_splitkv_dispatch).
FA2_QUERY_TILE_ROWS = 64


class NoKernelTables(ValueError):
    """No aiconfigurator measurement covers this hardware (the caller falls back, and says so)."""


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", str(version))[:3])


def nearest_version(asked: str, versions: list[str]) -> str:
    """The version of `versions` nearest `asked` (major, then minor, then patch; the newer of
    two equally near)."""
    if not _version_key(asked):
        raise ValueError(f"cost_model.engine_version must look like 0.19 or 0.19.0, got {asked!r}")
    target = (_version_key(asked) + (0, 0, 0))[:3]

    def distance(version: str) -> tuple:
        key = (_version_key(version) + (0, 0, 0))[:3]
        return tuple(abs(a - b) for a, b in zip(key, target)) + (-key[1], -key[2])
    return min(versions, key=distance)


def runs_v1_engine(engine_version: str | None) -> bool:
    """Whether vLLM `engine_version` (None: DEFAULT_ENGINE_VERSION) runs the V1 engine by
    default (from 0.8.0)."""
    asked = DEFAULT_ENGINE_VERSION if engine_version is None else str(engine_version)
    return (_version_key(asked) + (0, 0))[:2] >= (0, 8)


def measured_versions(system: str) -> list[str]:
    """The vLLM versions whose GEMMs were measured on `system`, oldest first."""
    return sorted((p.name for p in (TABLES_DIR / system / "gemm" / "vllm").iterdir()),
                  key=_version_key)


def resolve_version(hardware_name: str, engine_version: str | None) -> tuple[str, str, str]:
    """(system, version used, one line saying why) for `hardware_name` and the version asked for
    (None: DEFAULT_ENGINE_VERSION); the nearest measured version where that one was not."""
    if hardware_name not in SYSTEMS:
        raise NoKernelTables(f"no vLLM kernel tables for hardware={hardware_name} (measured: "
                             f"{', '.join(sorted(SYSTEMS))})")
    system, note = SYSTEMS[hardware_name]
    asked = DEFAULT_ENGINE_VERSION if engine_version is None else str(engine_version)
    versions = measured_versions(system)
    used = nearest_version(asked, versions)
    exact = _version_key(used)[:len(_version_key(asked))] == _version_key(asked)
    why = (f"{system} ({note}), vLLM {used}"
           + ("" if exact else f" (nearest measured to {asked}; measured: {', '.join(versions)})")
           + ("" if engine_version is not None else " (default engine_version)"))
    return system, used, why


def _read(path: Path, columns: list[str]) -> dict[str, np.ndarray]:
    import pyarrow.parquet as pq
    table = pq.read_table(path, columns=[c for c in columns
                                         if c in pq.read_schema(path).names])
    return {name: table.column(name).to_numpy(zero_copy_only=False)
            for name in table.column_names}


def _newest(folder: Path, name: str) -> Path:
    """The newest version's `name` under `folder`/<version>/ (comm/nccl/2.29.2/...)."""
    files = sorted(folder.glob(f"*/{name}"), key=lambda p: _version_key(p.parent.name))
    if not files:
        raise NoKernelTables(f"no {name} under {folder}")
    return files[-1]


# --- GEMMs -------------------------------------------------------------------------------------

GLITCH_RATIO = 1.3


@dataclass(frozen=True)
class GemmGrid:
    """One dtype's GEMM latencies on a full (m, n, k) grid (ms); holes filled along m."""

    m: np.ndarray
    n: np.ndarray
    k: np.ndarray
    ms: np.ndarray       # [m, n, k]

    def latency_ms(self, m: np.ndarray, n: int, k: int) -> np.ndarray:
        """Latency at token counts `m` of an n-by-k GEMM: bilinear in (n, k) between measured
        widths (exact where time ~ n x k), proportional beyond them; linear in m between measured
        counts, at the last slope beyond."""
        curve = np.zeros(len(self.m))
        for n_weight, n_value, n_scale in _bracket(self.n, n):
            for k_weight, k_value, k_scale in _bracket(self.k, k):
                curve += n_weight * k_weight * n_scale * k_scale * self.ms[:, n_value, k_value]
        m = np.asarray(m, dtype=float)
        inside = np.interp(m, self.m, curve)
        slope = (curve[-1] - curve[-2]) / (self.m[-1] - self.m[-2])
        return np.where(m > self.m[-1], curve[-1] + (m - self.m[-1]) * slope, inside)


def _bracket(grid: np.ndarray, value: float) -> list[tuple[float, int, float]]:
    """(weight, index, scale) pairs interpolating `value` on `grid`: two neighbours inside it,
    the nearest end scaled in proportion outside it."""
    if value <= grid[0]:
        return [(1.0, 0, 1.0)] if value == grid[0] else [(1.0, 0, max(value / grid[0], 0.5))]
    if value >= grid[-1]:
        return [(1.0, len(grid) - 1, value / grid[-1])]
    upper = int(np.searchsorted(grid, value))
    lower = upper - 1
    weight = (value - grid[lower]) / (grid[upper] - grid[lower])
    return [(1.0 - weight, lower, 1.0), (weight, upper, 1.0)]


@functools.lru_cache(maxsize=None)
def gemm_grid(system: str, version: str, dtype: str) -> GemmGrid:
    data = _read(TABLES_DIR / system / "gemm" / "vllm" / version / "gemm_perf.parquet",
                 ["gemm_dtype", "m", "n", "k", "latency"])
    rows = data["gemm_dtype"] == dtype
    if not rows.any():
        raise NoKernelTables(f"{system} vLLM {version}: no {dtype} GEMMs measured")
    m, n, k, ms = (data[c][rows] for c in ("m", "n", "k", "latency"))
    grid_m, grid_n, grid_k = np.unique(m), np.unique(n), np.unique(k)
    cube = np.full((len(grid_m), len(grid_n), len(grid_k)), np.nan)
    cube[np.searchsorted(grid_m, m), np.searchsorted(grid_n, n), np.searchsorted(grid_k, k)] = ms
    for j in range(len(grid_n)):           # holes (the largest shapes): time grows with m there
        for i in range(len(grid_k)):
            column = cube[:, j, i]
            known = ~np.isnan(column)
            if known.all() or known.sum() < 2:
                continue
            last = np.flatnonzero(known)[-1]
            column[~known] = np.interp(grid_m[~known], grid_m[known], column[known])
            column[last + 1:] = column[last] * grid_m[last + 1:] / grid_m[last]
    # A GEMM over more tokens is never faster, so a point 30 % slower than a larger m's is a
    # glitch and takes that m's time (a smaller excess is noise, kept).
    above = np.minimum.accumulate(cube[::-1], axis=0)[::-1]
    cube = np.where(cube > GLITCH_RATIO * above, above, cube)
    cube = _repair_isolated_slow_points(grid_m, grid_n, grid_k, cube)
    return GemmGrid(grid_m.astype(float), grid_n.astype(float), grid_k.astype(float), cube)


def _repair_isolated_slow_points(grid_m: np.ndarray, grid_n: np.ndarray, grid_k: np.ndarray,
                                 cube: np.ndarray) -> np.ndarray:
    """`cube` with each point under 1 / GLITCH_RATIO of all four neighbours' FLOP rates along n and
    k set to their mean: a GEMM's rate is smooth in its widths, so a lone slow point is a glitch."""
    flops = 2.0 * grid_m[:, None, None] * grid_n[None, :, None] * grid_k[None, None, :]
    rate = flops / cube
    inner = rate[:, 1:-1, 1:-1]
    neighbours = np.stack([rate[:, :-2, 1:-1], rate[:, 2:, 1:-1],
                           rate[:, 1:-1, :-2], rate[:, 1:-1, 2:]])
    glitch = np.zeros(cube.shape, dtype=bool)
    glitch[:, 1:-1, 1:-1] = inner * GLITCH_RATIO < neighbours.min(axis=0)
    repaired = np.full(cube.shape, np.nan)
    repaired[:, 1:-1, 1:-1] = flops[:, 1:-1, 1:-1] / neighbours.mean(axis=0)
    return np.where(glitch, repaired, cube)


# --- attention ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class AttentionRows:
    """One (query heads, KV heads, head_dim, KV dtype) attention table's rows."""

    heads: tuple[int, int, int]     # the measured heads (may differ from the model's shard)
    batch: np.ndarray
    context: np.ndarray             # prefill: prompt tokens; decode: cached tokens a sequence
    ms: np.ndarray


@functools.lru_cache(maxsize=None)
def _attention_table(system: str, version: str, kind: str) -> dict[str, np.ndarray]:
    data = _read(TABLES_DIR / system / "attention" / "vllm" / version / f"{kind}_attention_perf.parquet",
                 ["batch_size", "isl", "step", "num_heads", "num_key_value_heads", "head_dim",
                  "kv_cache_dtype", "window_size", "latency"])
    if "window_size" in data:   # full attention only (sliding windows are not modelled)
        keep = data["window_size"] == 0
        data = {name: column[keep] for name, column in data.items()}
    return data


def attention_rows(system: str, version: str, kind: str, query_heads: int, kv_heads: int,
                   head_dim: int, kv_dtype: str) -> AttentionRows:
    """The rows of `kind` ("context" or "generation") nearest the model's heads on one GPU: the
    same head_dim and KV dtype, the same query-per-KV ratio where measured, then the nearest
    query head count (the caller scales by it)."""
    data = _attention_table(system, version, kind)
    dtype_rows = data["kv_cache_dtype"] == kv_dtype
    if not dtype_rows.any():
        raise NoKernelTables(f"{system} vLLM {version}: no {kind} attention with a {kv_dtype} KV "
                             f"cache measured")
    # (As Python ints in one conversion a column, not one numpy scalar at a time.)
    combos = set(zip(*(data[column][dtype_rows].astype(np.int64).tolist()
                       for column in ("num_heads", "num_key_value_heads", "head_dim"))))

    def distance(combo):
        q, kv, d = combo
        return (abs(np.log2(d / head_dim)), abs(np.log2((q / kv) / (query_heads / kv_heads))),
                abs(np.log2(q / query_heads)))
    heads = min(combos, key=distance)
    rows = (dtype_rows & (data["num_heads"] == heads[0])
            & (data["num_key_value_heads"] == heads[1]) & (data["head_dim"] == heads[2]))
    context = data["isl"][rows] + (data["step"][rows] if kind == "generation" else 0)
    return AttentionRows(heads, data["batch_size"][rows].astype(float),
                         context.astype(float), data["latency"][rows].astype(float))


# --- collectives and experts -------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def custom_allreduce_curve(system: str, version: str, gpus: int,
                           backend: str) -> tuple[np.ndarray, np.ndarray]:
    """(message elements ascending, ms) of vLLM's custom all-reduce over `gpus` GPUs
    (`backend` vllm_graph or vllm_eager); empty where not measured."""
    folder, name = TABLES_DIR / system / "comm" / "vllm", "custom_allreduce_perf.parquet"
    path = folder / version / name
    if not path.is_file():
        try:
            path = _newest(folder, name)
        except NoKernelTables:
            return np.array([]), np.array([])
    data = _read(path, ["num_gpus", "message_size", "backend", "latency"])
    rows = (data["num_gpus"] == gpus) & (data["backend"] == backend)
    order = np.argsort(data["message_size"][rows])
    return (data["message_size"][rows][order].astype(float),
            data["latency"][rows][order].astype(float))


@functools.lru_cache(maxsize=None)
def nccl_curve(system: str, op: str, gpus: int) -> tuple[np.ndarray, np.ndarray]:
    """(message elements of fp16 ascending, ms) of NCCL `op` over `gpus` GPUs of one node (the
    newest NCCL measured); empty where not measured."""
    data = _read(_newest(TABLES_DIR / system / "comm" / "nccl", "nccl_perf.parquet"),
                 ["op_name", "nccl_dtype", "num_gpus", "message_size", "latency"])
    rows = (data["op_name"] == op) & (data["num_gpus"] == gpus) & (data["nccl_dtype"] == "half")
    sizes, ms = data["message_size"][rows].astype(float), data["latency"][rows].astype(float)
    unique = np.unique(sizes)
    return unique, np.array([ms[sizes == s].mean() for s in unique])


def curve_ms(curve: tuple[np.ndarray, np.ndarray], size: np.ndarray) -> np.ndarray:
    """A collective's latency at message `size` (the curve's units): linear between measured
    sizes, its smallest below them, proportional to size beyond the largest."""
    sizes, ms = curve
    size = np.asarray(size, dtype=float)
    return np.where(size > sizes[-1], ms[-1] * size / sizes[-1], np.interp(size, sizes, ms))


@functools.lru_cache(maxsize=None)
def moe_table(system: str, version: str) -> dict[str, np.ndarray]:
    return _read(TABLES_DIR / system / "moe" / "vllm" / version / "moe_perf.parquet",
                 ["moe_dtype", "num_tokens", "hidden_size", "inter_size", "topk", "num_experts",
                  "moe_tp_size", "moe_ep_size", "distribution", "latency"])
