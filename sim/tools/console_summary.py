"""The console table of a run's summary (`twinserve` prints it after a run): totals on the
left, latencies on the right, and below them the rejection reason and per-group rows.
"""
from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table
from rich.text import Text


def _fmt(value: float, digits: int = 2) -> str:
    return f"{value:,.{digits}f}" if math.isfinite(value) else str(value)


def format_summary_table(summary: dict) -> Table:
    """Two tables side by side: run totals on the left, latencies (ms) on the right."""
    totals = Table(show_header=False, box=None, pad_edge=False)
    totals.add_column(style="bold")
    totals.add_column(justify="right")
    totals.add_row("completed / rejected", f"{summary['completed']:,} / {summary['rejected']:,}")
    if "abandoned" in summary:   # (requests with a timeout_s: runtime/deadlines.py)
        totals.add_row("abandoned", f"{summary['abandoned']:,} "
                                    f"({summary['abandoned_fraction']:.1%})")
    totals.add_row("duration (sim)", f"{_fmt(summary['duration_s'])} s")
    totals.add_row("requests/s", _fmt(summary["request_throughput"]))
    totals.add_row("output tok/s", _fmt(summary["output_throughput"], 1))
    totals.add_row("total tok/s", _fmt(summary["total_token_throughput"], 1))
    if "goodput" in summary:
        totals.add_row("goodput req/s", _fmt(summary["goodput"]))
        totals.add_row("SLO attainment", f"{summary['slo_attainment']:.1%}")
    if "joules_per_output_token" in summary:   # (modelled: sim/core/energy, docs/energy.md)
        totals.add_row("energy (modelled)", f"{summary['energy_j'] / 1e3:,.2f} kJ, "
                                            f"{_fmt(summary['avg_power_w'], 0)} W")
        totals.add_row("J / output token", _fmt(summary["joules_per_output_token"], 3))
    totals.add_row("preemptions", f"{summary['num_preemptions']:,}")
    totals.add_row("peak KV blocks", f"{summary['peak_kv_blocks']:,}")
    totals.add_row("KV waste", f"{summary['kv_waste_fraction']:.1%}")
    if "prefix_cache_hit_rate" in summary:
        totals.add_row("prefix cache hit rate", f"{summary['prefix_cache_hit_rate']:.1%}")
    if summary.get("swap_bytes"):
        totals.add_row("swapped", f"{summary['swap_bytes'] / 2**20:,.1f} MiB")
    if summary.get("num_draft_tokens"):
        totals.add_row("draft acceptance", f"{summary['spec_acceptance_rate']:.1%}")
        totals.add_row("tokens / decode step", _fmt(summary["mean_tokens_per_decode_step"]))
    if summary.get("num_kv_transfers"):
        totals.add_row("KV transfers", f"{summary['num_kv_transfers']:,} "
                                       f"({summary['kv_transfer_bytes'] / 2**30:,.1f} GiB)")
        totals.add_row("KV transfer ms (p99)", f"{_fmt(summary['mean_kv_transfer_ms'])} "
                                               f"({_fmt(summary['p99_kv_transfer_ms'])})")
    if "jain_fairness" in summary:
        totals.add_row("Jain fairness (tenants)", _fmt(summary["jain_fairness"], 3))
    if summary.get("fairness_windows"):
        # (Among the tenants backlogged all window long: runtime/metrics/fairness.py.)
        window = f"{summary['fairness_window_s']:g} s"
        totals.add_row(f"windowed Jain {window}",
                       f"{_fmt(summary['windowed_jain_fairness'], 3)} "
                       f"({summary['fairness_windows']:,} windows)")
        totals.add_row(f"max gap {window}", f"{summary['max_backlogged_service_diff']:,.0f} tok")
    totals.add_row("steps", f"{summary['num_steps']:,}")
    if "cost_model_kernels" in summary:
        totals.add_row("kernels", summary["cost_model_kernels"].split(" on ")[0])
    if "expected_tpot_error_pct" in summary:   # (sim/cost/gpu/expected_errors.py)
        for metric in ("ttft", "tpot", "e2e"):
            totals.add_row(f"expected {metric.upper()} error",
                           f"±{summary[f'expected_{metric}_error_pct']:.0f} %")
    totals.add_row("wall time", f"{_fmt(summary['wall_time_s'])} s")

    latencies = Table(box=None, pad_edge=False)
    latencies.add_column("ms", style="bold")
    for heading in ("mean", "median", "p99"):
        latencies.add_column(heading, justify="right")
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E")):
        latencies.add_row(label, *(_fmt(summary[f"{stat}_{name}_ms"])
                                   for stat in ("mean", "median", "p99")))

    grid = Table.grid(padding=(0, 4))
    grid.add_row(totals, latencies)
    # Below the two tables, not in their columns, which a long line would squeeze and wrap.
    below = [Text(f"rejected because: {summary['rejected_reason']} "
                  f"({summary['rejected_reason_count']:,} like it)")
             ] if summary.get("rejected_reason") else []
    groups = _format_groups(summary)
    below += [groups] if groups is not None else []
    if not below:
        return grid
    stacked = Table.grid(padding=(1, 0))
    stacked.add_row(grid)
    for part in below:
        stacked.add_row(part)
    return stacked


def _format_groups(summary: dict) -> Table | None:
    """A row per tenant and per priority, when the summary has them; else None."""
    sections = [(label, summary[key]) for key, label in (("per_tenant", "tenant"),
                                                         ("per_priority", "priority"))
                if key in summary]
    if not sections:
        return None
    has_slos = any("slo_attainment" in group for _, groups in sections
                   for group in groups.values())
    # Each tenant's mean service in the windows where it and another waited (windowed fairness).
    has_windows = bool(summary.get("fairness_windows"))
    table = Table(box=None, pad_edge=False)
    table.add_column("group", style="bold")
    for heading in ("done", "req/s", "TTFT p99", "TPOT p99", "E2E p99"):
        table.add_column(heading, justify="right")
    if has_slos:
        table.add_column("SLO", justify="right")
    if has_windows:
        table.add_column("tok/window backlogged", justify="right")
    for label, groups in sections:
        for name, group in groups.items():
            row = [f"{label} {name}", f"{group['completed']:,}",
                   _fmt(group["request_throughput"]), _fmt(group["p99_ttft_ms"]),
                   _fmt(group["p99_tpot_ms"]), _fmt(group["p99_e2el_ms"])]
            if has_slos:
                row.append(f"{group['slo_attainment']:.1%}")
            if has_windows:
                row.append(f"{group['mean_backlogged_service']:,.0f}"
                           if group.get("backlogged_windows") else "")
            table.add_row(*row)
    return table


def print_summary(summary: dict, console: Console | None = None) -> None:
    (console or Console()).print(format_summary_table(summary))
