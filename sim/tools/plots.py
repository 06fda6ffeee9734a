"""PNG plots of a run: latency CDFs, KV blocks in use, batch size and queue length, and modelled
board power. Headless (Agg); step series are decimated to a few thousand points, keeping each
bucket's min and max so that peaks survive.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (must come after the backend is chosen)
from matplotlib.ticker import NullFormatter  # noqa: E402
import numpy as np  # noqa: E402

from policies.types import Request  # noqa: E402
from sim.core.energy.meter import EnergyMeter  # noqa: E402
from sim.core.energy.stages import StagesEnergyMeter  # noqa: E402
from sim.core.energy.trace import (TracedEnergyMeter, TracedMeter,  # noqa: E402
                                   TracedStagesEnergyMeter, power_over_time)
from runtime.metrics import latency_arrays_s  # noqa: E402

MAX_POINTS_PER_LINE = 5000


def downsample_indices(values: np.ndarray, max_points: int = MAX_POINTS_PER_LINE) -> np.ndarray:
    """Sorted indices of at most ~max_points elements of `values`: the first, the last, and each
    bucket's min and max, since plain striding would step over short spikes."""
    n = len(values)
    if n <= max_points:
        return np.arange(n)
    num_buckets = max(1, (max_points - 2) // 2)
    bucket_size = -(-n // num_buckets)  # ceil
    # Pad with the last value so the series reshapes into whole buckets; padding is clipped below.
    padded = np.concatenate([values, np.full(num_buckets * bucket_size - n, values[-1])])
    buckets = padded.reshape(num_buckets, bucket_size)
    starts = np.arange(num_buckets) * bucket_size
    picks = np.concatenate([[0, n - 1],
                            starts + buckets.argmin(axis=1),
                            starts + buckets.argmax(axis=1)])
    return np.unique(np.minimum(picks, n - 1))


def _no_data(ax, message: str = "no data") -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes, color="gray")


def _plot_cdf(ax, values_ms: np.ndarray, title: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0.0, 1.0)
    ax.grid(True, alpha=0.3)
    if values_ms.size == 0:
        _no_data(ax)
        return
    ordered = np.sort(values_ms)
    fractions = np.arange(1, ordered.size + 1) / ordered.size
    keep = downsample_indices(ordered)  # monotone, so this is plain thinning
    ax.step(ordered[keep], fractions[keep], where="post")
    # Latencies often span orders of magnitude (queueing tails); log x only when they do.
    if ordered[0] > 0 and ordered[-1] / ordered[0] > 20:
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # labelled minor ticks overlap


def _write_latency_cdf(path: Path, requests: list[Request]) -> None:
    latencies_s = latency_arrays_s(requests)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4), constrained_layout=True)
    panels = (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2el", "E2E latency"))
    for ax, (name, title) in zip(axes, panels):
        _plot_cdf(ax, latencies_s[name] * 1000.0, f"{title} CDF")
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_per_replica(ax, steps: np.ndarray, columns: tuple[str, ...], column: str,
                      label: str, replica_labels: dict[int, str] | None = None,
                      drawstyle: str = "default") -> None:
    """One line per replica of `column` against step start time, named by `replica_labels`
    (replica_id -> name) where given."""
    replica_col, time_col, value_col = (columns.index(name)
                                        for name in ("replica_id", "start_time", column))
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel(label)
    ax.grid(True, alpha=0.3)
    if steps.size == 0:
        _no_data(ax, "no steps")
        return
    replicas = np.unique(steps[:, replica_col])
    for replica in replicas:
        rows = steps[steps[:, replica_col] == replica]
        keep = downsample_indices(rows[:, value_col])
        ax.plot(rows[keep, time_col], rows[keep, value_col], linewidth=0.8,
                drawstyle=drawstyle,
                label=(replica_labels or {}).get(int(replica), f"replica {int(replica)}"))
    if len(replicas) > 1:
        ax.legend(loc="upper right", fontsize="small")


def kv_block_capacities(summary: dict) -> dict[str, int]:
    """A replica's KV blocks, by the name of its line in kv_blocks.png: each pool's (a run's
    `per_pool`) or the run's `num_kv_blocks`; {} when the summary has neither."""
    if summary.get("per_pool"):
        return {f"{name} pool": pool["num_kv_blocks"] for name, pool in summary["per_pool"].items()}
    return {"pool": summary["num_kv_blocks"]} if "num_kv_blocks" in summary else {}


def plot_kv_blocks(ax, steps: np.ndarray, columns: tuple[str, ...],
                   capacities: dict[str, int] | None = None,
                   replica_labels: dict[int, str] | None = None) -> None:
    """Blocks in use per replica, and a dashed line at each pool's capacity (kv_block_capacities),
    so that how close a run came to preempting shows."""
    ax.set_title("KV cache blocks in use")
    _plot_per_replica(ax, steps, columns, "kv_blocks_used", "blocks", replica_labels)
    by_size: dict[int, list[str]] = {}
    for name, blocks in (capacities or {}).items():
        by_size.setdefault(int(blocks), []).append(name)
    for blocks, names in by_size.items():
        ax.axhline(blocks, color="black", linestyle="--", linewidth=0.8,
                   label=f"{' / '.join(names)} capacity ({blocks:,} blocks)")
    if by_size:
        ax.set_ylim(bottom=0, top=max(by_size) * 1.05)
        ax.legend(loc="lower right", fontsize="small")


def joules_text(joules: float) -> str:
    """`joules` in J, kJ or MJ, three significant figures (a CPU run's fraction of a joule and
    a cluster's megajoules alike)."""
    for scale, unit in ((1e6, "MJ"), (1e3, "kJ")):
        if abs(joules) >= scale:
            return f"{joules / scale:.3g} {unit}"
    return f"{joules:.3g} J"


def power_panel_meters(
        energy_meters: Mapping[int, EnergyMeter | StagesEnergyMeter | None] | None,
        summary: dict | None) -> dict[int, TracedMeter]:
    """The replicas' meters that kept each step's joules, where the run has energy to plot ({}
    otherwise)."""
    if not (summary or {}).get("energy_j"):
        return {}
    return {replica_id: meter for replica_id, meter in (energy_meters or {}).items()
            if isinstance(meter, (TracedEnergyMeter, TracedStagesEnergyMeter))}


def plot_power(ax, steps: np.ndarray, columns: tuple[str, ...],
               meters: dict[int, TracedMeter], summary: dict,
               replica_labels: dict[int, str] | None = None) -> None:
    """Each replica's board power over time, its joules and J per output token in the legend,
    and a dashed line at each idle draw."""
    per_replica = summary.get("energy_per_replica", {})
    labels = {}
    for replica_id in meters:
        name = (replica_labels or {}).get(replica_id, f"replica {replica_id}")
        numbers = per_replica.get(str(replica_id))
        if numbers:   # (a prefill replica finishes no request: its tokens are the decode's)
            per_token = (f"{numbers['joules_per_output_token']:.3g} J/tok"
                         if numbers["joules_per_output_token"] else "no output tokens")
            name = f"{name}: {joules_text(numbers['energy_j'])}, {per_token}"
        labels[replica_id] = name
    ax.set_title(f"Board power (modelled): {joules_text(summary['energy_j'])}, "
                 f"{summary.get('joules_per_output_token', 0.0):.3g} J per output token")
    _plot_per_replica(ax, power_over_time(steps, columns, meters),
                      ("replica_id", "start_time", "power_w"), "power_w",
                      "W (the replica's boards)", labels, drawstyle="steps-post")
    idle_draws = sorted({meter.num_boards * meter.power_model.idle_power_w
                         for meter in meters.values()})
    for watts in idle_draws:
        ax.axhline(watts, color="black", linestyle="--", linewidth=0.8,
                   label=f"idle draw ({watts:,.0f} W)")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper right", fontsize="small")


def write_plots(out_dir: Path, requests: list[Request], step_rows: list[tuple],
                step_columns: tuple[str, ...],
                replica_labels: dict[int, str] | None = None,
                kv_capacities: dict[str, int] | None = None,
                energy_meters: Mapping[int, EnergyMeter | StagesEnergyMeter | None] | None = None,
                summary: dict | None = None) -> list[Path]:
    """Write latency_cdf.png, kv_blocks.png, batch_size.png and (with energy) power.png into
    out_dir and return their paths; empty inputs give figures that say "no data"."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    columns = tuple(step_columns)
    steps = (np.asarray(step_rows, dtype=np.float64) if step_rows
             else np.empty((0, len(columns)), dtype=np.float64))

    latency_path = out_dir / "latency_cdf.png"
    _write_latency_cdf(latency_path, requests)

    kv_path = out_dir / "kv_blocks.png"
    fig, ax = plt.subplots(figsize=(10, 4), constrained_layout=True)
    plot_kv_blocks(ax, steps, columns, kv_capacities, replica_labels)
    fig.savefig(kv_path, dpi=100)
    plt.close(fig)

    batch_path = out_dir / "batch_size.png"
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True, constrained_layout=True)
    top.set_title("Batch size and waiting queue")
    _plot_per_replica(top, steps, columns, "num_seqs", "sequences in the step", replica_labels)
    _plot_per_replica(bottom, steps, columns, "num_waiting", "waiting queue length",
                      replica_labels)
    top.set_xlabel("")  # shared x axis: label only the bottom panel
    fig.savefig(batch_path, dpi=100)
    plt.close(fig)

    written = [latency_path, kv_path, batch_path]
    meters = power_panel_meters(energy_meters, summary)
    if meters:
        power_path = out_dir / "power.png"
        fig, ax = plt.subplots(figsize=(10, 4), constrained_layout=True)
        plot_power(ax, steps, columns, meters, summary, replica_labels)
        fig.savefig(power_path, dpi=100)
        plt.close(fig)
        written.append(power_path)
    return written
