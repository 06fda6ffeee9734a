"""`twinserve-capacity`: the highest request rate at which a configuration meets a latency SLO
(p99 TTFT and/or p99 TPOT), as Sarathi-Serve defines capacity, found as Vidur searches it: by
bisection on `workload.rate`, one simulation per probe.

    python -m sim.tools.capacity scheduler=chunked_prefill workload.num_requests=2000 \\
        --ttft-p99-ms 2000 --tpot-p99-ms 100 --out capacity/chunked

Past capacity the queue grows for as long as requests arrive, so use enough requests (a thousand
or more) that a run at twice the capacity clearly fails. Every probe sees the same arrivals scaled
in time (common random numbers), which keeps latency monotone in the rate.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hydra import compose, initialize_config_module
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from rich.console import Console
from rich.table import Table

from sim.core.settings import fairness_window_s
from sim.core.experiment import run_experiment

PROG = "twinserve-capacity"
# Each doubling of --high (or halving of --low) costs a probe; past this many the bracket is
# surely wrong by orders of magnitude.
MAX_EXPANSIONS = 10
# metrics.max_kept_requests of a probe: more than any workload has.
KEEP_EVERY_REQUEST = 2 ** 62


@dataclass(frozen=True)
class SLO:
    """Limits on p99 TTFT and p99 TPOT in ms; None leaves that metric unconstrained."""

    ttft_p99_ms: float | None = None
    tpot_p99_ms: float | None = None

    def __post_init__(self):
        if self.ttft_p99_ms is None and self.tpot_p99_ms is None:
            raise ValueError("give at least one SLO: --ttft-p99-ms and/or --tpot-p99-ms")
        for name, value in (("ttft_p99_ms", self.ttft_p99_ms), ("tpot_p99_ms", self.tpot_p99_ms)):
            if value is not None and not (isinstance(value, (int, float)) and value > 0
                                          and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number of ms, got {value!r}")

    def is_met(self, summary: dict) -> bool:
        # An empty run's latencies are 0.0 (the summary's convention): that meets nothing.
        if summary["completed"] == 0:
            return False
        return ((self.ttft_p99_ms is None or summary["p99_ttft_ms"] <= self.ttft_p99_ms)
                and (self.tpot_p99_ms is None or summary["p99_tpot_ms"] <= self.tpot_p99_ms))

    def as_slos_ms(self) -> dict[str, float]:
        """The per-request limits for MetricsCollector.summary's goodput."""
        return {name: limit for name, limit in (("ttft", self.ttft_p99_ms),
                                                ("tpot", self.tpot_p99_ms)) if limit is not None}

    def describe(self) -> str:
        parts = [f"p99 {label} <= {limit:g} ms" for label, limit in
                 (("TTFT", self.ttft_p99_ms), ("TPOT", self.tpot_p99_ms)) if limit is not None]
        return " and ".join(parts)


@dataclass(frozen=True)
class Probe:
    """One simulation at one rate."""

    rate: float
    meets_slo: bool
    summary: dict

    def as_dict(self) -> dict:
        return {"rate": self.rate, "meets_slo": self.meets_slo,
                "p99_ttft_ms": self.summary["p99_ttft_ms"],
                "p99_tpot_ms": self.summary["p99_tpot_ms"], "summary": self.summary}


@dataclass
class CapacityResult:
    """`capacity`: the highest rate probed that meets the SLO (None: not even the lowest did);
    `lowest_violating`: the lowest that does not; `converged`: they are within the tolerance."""

    capacity: float | None
    lowest_violating: float | None
    converged: bool
    slo: SLO
    tolerance: float
    probes: list[Probe] = field(default_factory=list)
    overrides: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"capacity": self.capacity, "lowest_violating": self.lowest_violating,
                "converged": self.converged, "tolerance": self.tolerance,
                "slo": {"ttft_p99_ms": self.slo.ttft_p99_ms, "tpot_p99_ms": self.slo.tpot_p99_ms},
                "overrides": self.overrides,
                "probes": [probe.as_dict() for probe in self.probes]}


def check_search_args(low: float, high: float, tolerance: float, max_iters: int) -> None:
    if not (math.isfinite(low) and low > 0):
        raise ValueError(f"--low must be a positive rate in req/s, got {low!r}")
    if not (math.isfinite(high) and high > low):
        raise ValueError(f"--high must be a rate above --low ({low:g}), got {high!r}")
    if not 0 < tolerance < 1:
        raise ValueError(f"--tolerance must be a fraction in (0, 1), got {tolerance!r}")
    if isinstance(max_iters, bool) or not isinstance(max_iters, int) or max_iters < 2:
        raise ValueError(f"--max-iters must be an integer >= 2 (the two ends), got {max_iters!r}")


def search_capacity(measure: Callable[[float], dict], slo: SLO, *, low: float, high: float,
                    tolerance: float = 0.02, max_iters: int = 20,
                    on_probe: Callable[[Probe], None] | None = None) -> CapacityResult:
    """Bisection on the rate given `measure(rate) -> summary`. Doubles `high` while it still
    meets the SLO and halves `low` while it does not; `max_iters` bounds the probes in all."""
    check_search_args(low, high, tolerance, max_iters)
    probes: list[Probe] = []

    def probe(rate: float) -> bool:
        summary = measure(rate)
        probes.append(Probe(rate, slo.is_met(summary), summary))
        if on_probe is not None:
            on_probe(probes[-1])
        return probes[-1].meets_slo

    def budget_left() -> bool:
        return len(probes) < max_iters

    # The bracket: the highest rate known to meet the SLO, the lowest known to miss it.
    passing, failing = None, None
    if probe(low):
        passing = low
    else:
        failing = low
        for _ in range(MAX_EXPANSIONS):
            if not budget_left():
                break
            rate = failing / 2
            if probe(rate):
                passing = rate
                break
            failing = rate
    if passing is not None and failing is None and budget_left():
        rate = high
        for _ in range(MAX_EXPANSIONS + 1):
            if not probe(rate):
                failing = rate
                break
            passing = rate
            if not budget_left():
                break
            rate *= 2
    if passing is not None and failing is not None:
        while failing > passing * (1 + tolerance) and budget_left():
            rate = (passing + failing) / 2
            if probe(rate):
                passing = rate
            else:
                failing = rate
    converged = (passing is not None and failing is not None
                 and failing <= passing * (1 + tolerance))
    return CapacityResult(capacity=passing, lowest_violating=failing, converged=converged,
                          slo=slo, tolerance=tolerance, probes=probes)


# ---- the simulator as the measurement --------------------------------------------------------

def compose_config(overrides: Sequence[str]) -> DictConfig:
    """The app's config with `overrides`, as `twinserve` would compose it."""
    with initialize_config_module(config_module="conf", version_base=None):
        return compose("config", overrides=["progress=false", *overrides])


def find_capacity(cfg_overrides: Sequence[str], slo: SLO, *, low: float = 1.0,
                  high: float = 16.0, tolerance: float = 0.02, max_iters: int = 20,
                  on_probe: Callable[[Probe], None] | None = None) -> CapacityResult:
    """The capacity of the configuration `cfg_overrides` under `slo`, each probe one
    `run_experiment` at a `workload.rate`."""
    check_search_args(low, high, tolerance, max_iters)
    overrides = list(cfg_overrides)
    for override in overrides:
        if override.lstrip("+~").split("=", 1)[0] == "workload.rate":
            raise ValueError("workload.rate is what the search varies; set --low/--high instead "
                             f"of {override!r}")
    try:
        cfg = compose_config(overrides)
    except (HydraException, OmegaConfBaseException) as error:
        raise ValueError(f"bad override: {str(error).splitlines()[0]}") from None
    if "rate" not in cfg.workload:
        raise ValueError(f"workload={cfg.workload.get('kind', '?')} has no rate to search; "
                         "use a synthetic workload (workload=synthetic or sharegpt_like)")

    def measure(rate: float) -> dict:
        # (Every request kept, however many: the summary below is made again from them.)
        probe_cfg = OmegaConf.merge(cfg, {"workload": {"rate": float(rate)},
                                          "metrics": {"max_kept_requests": KEEP_EVERY_REQUEST}})
        wall_start = time.perf_counter()
        result = run_experiment(probe_cfg)
        # The same summary with the SLO as per-request goodput: how many requests met it.
        return result.metrics.summary(result.requests, time.perf_counter() - wall_start,
                                      slos_ms=slo.as_slos_ms(),
                                      fairness_window_s=fairness_window_s(probe_cfg))

    result = search_capacity(measure, slo, low=low, high=high, tolerance=tolerance,
                             max_iters=max_iters, on_probe=on_probe)
    result.overrides = overrides
    return result


# ---- outputs ---------------------------------------------------------------------------------

def probes_table(result: CapacityResult) -> Table:
    table = Table(title=f"capacity search: {result.slo.describe()}",
                  caption="rates in req/s, latencies in ms; in SLO: the requests that met it")
    for heading in ("probe", "rate", "p99 TTFT", "p99 TPOT", "throughput", "in SLO", "meets"):
        table.add_column(heading, justify="right")
    order = sorted(range(len(result.probes)), key=lambda index: result.probes[index].rate)
    for index in order:
        probe = result.probes[index]
        summary = probe.summary
        style = "bold" if probe.rate == result.capacity else None
        table.add_row(str(index + 1), f"{probe.rate:.3f}", f"{summary['p99_ttft_ms']:,.1f}",
                      f"{summary['p99_tpot_ms']:,.1f}", f"{summary['request_throughput']:.3f}",
                      f"{summary.get('slo_attainment', float('nan')):.1%}",
                      "[green]yes[/]" if probe.meets_slo else "[red]no[/]", style=style)
    return table


def plot_capacity(result: CapacityResult, path: Path) -> Path:
    """p99 TTFT and p99 TPOT against the rate, the SLO lines and the capacity found."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    probes = sorted(result.probes, key=lambda probe: probe.rate)
    rates = [probe.rate for probe in probes]
    colors = ["tab:green" if probe.meets_slo else "tab:red" for probe in probes]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    for ax, metric, label, limit in ((axes[0], "p99_ttft_ms", "p99 TTFT", result.slo.ttft_p99_ms),
                                     (axes[1], "p99_tpot_ms", "p99 TPOT", result.slo.tpot_p99_ms)):
        values = [probe.summary[metric] for probe in probes]
        ax.plot(rates, values, color="gray", linewidth=1, zorder=1)
        ax.scatter(rates, values, c=colors, zorder=2)
        if limit is not None:
            ax.axhline(limit, color="black", linestyle="--", linewidth=1, label=f"SLO {limit:g} ms")
        if result.capacity is not None:
            ax.axvline(result.capacity, color="tab:blue", linestyle=":",
                       label=f"capacity {result.capacity:.3g} req/s")
        positive = [value for value in values if value > 0]
        # Past capacity TTFT grows with the queue, by orders of magnitude: log y when it does.
        if positive and max(positive) / min(positive) > 20:
            ax.set_yscale("log")
        ax.set_title(label)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("ms")
        ax.grid(True, alpha=0.3)
        # Marker colours: whether the whole SLO (both limits) is met at that rate.
        ax.scatter([], [], color="tab:green", label="meets the SLO")
        ax.scatter([], [], color="tab:red", label="misses it")
        ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(result: CapacityResult, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "capacity.json"
    json_path.write_text(json.dumps(result.as_dict(), indent=2, allow_nan=False) + "\n")
    return [json_path, plot_capacity(result, out_dir / "capacity.png")]


# ---- command line ----------------------------------------------------------------------------

class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse, with a usage error as one line instead of the usage block and the error."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = OneLineArgumentParser(
        prog=PROG, description="The highest workload.rate at which a configuration meets a p99 "
                               "TTFT/TPOT SLO, by bisection; one simulation per probe.")
    parser.add_argument("overrides", nargs="*",
                        help="Hydra overrides of the configuration, as for twinserve")
    parser.add_argument("--ttft-p99-ms", type=float, help="SLO on p99 time to first token (ms)")
    parser.add_argument("--tpot-p99-ms", type=float, help="SLO on p99 time per output token (ms)")
    parser.add_argument("--low", type=float, default=1.0,
                        help="lowest rate to probe, req/s (halved while it misses the SLO)")
    parser.add_argument("--high", type=float, default=16.0,
                        help="highest rate to probe, req/s (doubled while it meets the SLO)")
    parser.add_argument("--tolerance", type=float, default=0.02,
                        help="stop when the bracket is this fraction of the capacity wide")
    parser.add_argument("--max-iters", type=int, default=20, help="most probes (simulations)")
    parser.add_argument("--out", type=Path,
                        default=Path("capacity") / time.strftime("%Y-%m-%d/%H-%M-%S"),
                        help="folder for capacity.json and capacity.png")
    return parser.parse_intermixed_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # A user's own policy (scheduler._target_=my_policies.X) lives in their folder, as for the app.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    console = Console(soft_wrap=True)

    def report(probe: Probe) -> None:
        summary = probe.summary
        console.print(f"probe {probe.rate:10.3f} req/s  p99 TTFT {summary['p99_ttft_ms']:10.1f} ms"
                      f"  p99 TPOT {summary['p99_tpot_ms']:8.1f} ms  "
                      + ("[green]meets[/]" if probe.meets_slo else "[red]misses[/]"))

    try:
        slo = SLO(args.ttft_p99_ms, args.tpot_p99_ms)
        result = find_capacity(args.overrides, slo, low=args.low, high=args.high,
                               tolerance=args.tolerance, max_iters=args.max_iters,
                               on_probe=report)
    except ValueError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    console.print(probes_table(result))
    write_outputs(result, args.out)
    if result.capacity is None:
        console.print(f"[red]the SLO ({slo.describe()}) is missed even at "
                      f"{min(p.rate for p in result.probes):g} req/s[/]; results in {args.out}")
        return 1
    if result.lowest_violating is None:
        console.print(f"[yellow]still meets the SLO at {result.capacity:g} req/s after "
                      f"{len(result.probes)} probes: capacity is higher; raise --high or "
                      "--max-iters[/]")
    elif not result.converged:
        console.print(f"[yellow]ran out of probes: capacity is between {result.capacity:.4g} and "
                      f"{result.lowest_violating:.4g} req/s; raise --max-iters[/]")
    console.print(f"capacity: [bold]{result.capacity:.4g} req/s[/] ({slo.describe()}); "
                  f"results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
