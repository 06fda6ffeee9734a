"""`twinserve-calibrate --real RUN...`: fit a cost model's engine-overhead terms (its own config
keys, or a whole key such as `cluster.frontend_latency_s`) to measured serving runs, keep the fit
in a profile file, and report the error on held-out runs (docs/calibration.md).

The loss is the mean squared log ratio simulated/real of the fitted metrics over runs and load
stages, by default mean and median TPOT: the overheads set a decode step's duration, which TPOT
measures directly, while TTFT and E2E of a loaded run follow through the queue and are checks. A
fit that cannot move a term, or moves none of the metrics, exits 1 and writes nothing.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from omegaconf import OmegaConf
from rich.console import Console

from calibration.realrun.readers import read_run
from calibration.realrun.replay import compose_replay_config, replay
from calibration.realrun.run import RealRun, RealRunError
from calibration.term_fit import fit_terms

DEFAULT_TERMS = ("step_overhead_s", "per_sequence_overhead_s")
DEFAULT_METRICS = ("mean_tpot_ms", "median_tpot_ms")
# The profiled model's default fit (a served run of the engine it profiled): the machine's speed
# then, which TPOT measures, and the server's per-request latency, which TTFT measures.
PROFILED_TERMS = ("step_time_scale", "cluster.frontend_latency_s")
PROFILED_METRICS = ("mean_tpot_ms", "median_tpot_ms", "mean_ttft_ms", "median_ttft_ms")
REPORTED = ("mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "mean_e2el_ms",
            "median_e2el_ms", "request_throughput")
DEFAULT_PASSES = 6
# Overheads of a serving engine's step: from a tenth of a microsecond to a tenth of a second.
BOUNDS = (1e-7, 0.1)
# An achieved share of a spec-sheet rate (compute_efficiency, memory_efficiency, ...).
EFFICIENCY_BOUNDS = (1e-3, 1.0)
# A workstation board's share relative to the measured datacenter boards' (GPUCostModel): it may
# exceed them.
RELATIVE_EFFICIENCY_BOUNDS = (0.25, 4.0)
PROFILED_TARGET = "sim.cost.profiled.cost_model.ProfiledCostModel"
# A multiplier of a cost model's step times (the profiled model's step_time_scale: a machine's
# speed relative to its profile's).
SCALE_BOUNDS = (0.1, 10.0)
# A fitted term within this many natural-log units of a bound sits on it (the search resolves
# 0.02, term_fit.fit_terms).
AT_BOUND_LOG = 0.05


class FitFailed(Exception):
    """The fit could not move a term or moved none of the metrics: one line saying which."""


def term_bounds(term: str) -> tuple[float, float]:
    """The search's (low, high) for a cost-model term: a share for *_efficiency (a relative one
    for workstation_*), a multiplier for *_scale, else seconds."""
    if term.startswith("workstation_") and term.endswith("_efficiency"):
        return RELATIVE_EFFICIENCY_BOUNDS
    if term.endswith("_scale"):
        return SCALE_BOUNDS
    return EFFICIENCY_BOUNDS if term.endswith("_efficiency") else BOUNDS


def term_key(term: str) -> str:
    """The config key a term sets: a dotted term is one already, else a cost_model key."""
    return term if "." in term else f"cost_model.{term}"


def start_value(term: str, value: float) -> float:
    """`value` moved into the term's search range; an overhead a decade inside its bounds (a
    term at 0 starts at a microsecond-scale guess, not at the search's edge)."""
    low, high = term_bounds(term)
    value = 0.0 if value is None else value
    if (low, high) == BOUNDS:
        low, high = low * 10, high / 10
    return min(max(float(value), low), high)


_ABSENT = object()   # (a term set to null, the GPU model's "the version's value", is present)


class Calibration:
    """The runs to fit, their replay configs (composed once) and the loss over them."""

    def __init__(self, runs: list[RealRun], overrides: list[str], terms: tuple[str, ...],
                 metrics: tuple[str, ...]):
        self.runs, self.terms, self.metrics = runs, terms, metrics
        self.overrides = list(overrides)
        self.configs = [compose_replay_config(run, overrides) for run in runs]
        for config in self.configs:
            missing = [term for term in terms
                       if OmegaConf.select(config, term_key(term), default=_ABSENT) is _ABSENT]
            if missing:
                raise RealRunError(
                    f"--terms: cost model {config.cost_model.get('_target_')} has no "
                    f"{', '.join(missing)} (its keys: {', '.join(config.cost_model)}; a dotted "
                    f"term must be a key of the run's config)")
        self.num_replays = 0

    def initial(self) -> dict[str, float]:
        """The terms' values in the first run's config, moved into the search's bounds."""
        return {term: start_value(term, OmegaConf.select(self.configs[0], term_key(term)))
                for term in self.terms}

    def replays(self, terms: dict[str, float]) -> list[dict]:
        results = []
        for run, config in zip(self.runs, self.configs):
            for term, value in terms.items():
                OmegaConf.update(config, term_key(term), float(value))
            # (The overrides too: the replay reports the settings' provenance from them, and a
            # file's model or hardware that only the command line resolves would fail without.)
            results.append(replay(run, self.overrides, config=config))
            self.num_replays += 1
        return results

    def loss(self, terms: dict[str, float]) -> float:
        squares = []
        for result in self.replays(terms):
            for stage in result["stages"]:
                for metric in self.metrics:
                    real, sim = stage["real"][metric], stage["sim"][metric]
                    if real is None or sim is None or real <= 0 or sim <= 0:
                        squares.append(math.log(1e3) ** 2)   # an unfinished side: far off
                    else:
                        squares.append(math.log(sim / real) ** 2)
        return sum(squares) / len(squares)


def fit(runs: list[RealRun], overrides: list[str], terms=DEFAULT_TERMS, metrics=DEFAULT_METRICS,
        passes: int = DEFAULT_PASSES, *, check: bool = False) -> tuple[dict[str, float], float, int]:
    """(fitted terms, loss, number of replays) over `runs`. With `check`, FitFailed where the
    fit could not move a term or moved none of the metrics."""
    calibration = Calibration(runs, overrides, tuple(terms), tuple(metrics))
    initial = calibration.initial()
    fitted, loss = fit_terms(calibration.loss, initial,
                             {term: term_bounds(term) for term in terms}, passes=passes)
    num_replays = calibration.num_replays
    if check:
        check_fit(calibration, initial, fitted)
    return fitted, loss, num_replays


def check_fit(calibration: Calibration, initial: dict[str, float],
              fitted: dict[str, float]) -> None:
    """FitFailed, in one line, naming each term the fit left at its start or put on a bound of
    its search, and saying so where the fitted terms move none of the metrics."""
    problems = []
    for term, value in fitted.items():
        low, high = term_bounds(term)
        if value == initial[term]:
            problems.append(f"{term} stayed at its start value {value:.4g}")
        elif math.log(value / low) <= AT_BOUND_LOG or math.log(high / value) <= AT_BOUND_LOG:
            bound = low if math.log(value / low) <= AT_BOUND_LOG else high
            problems.append(f"{term}={value:.4g} ended on its search's bound {bound:g} (range "
                            f"[{low:g}, {high:g}]): the runs want a value beyond it")
    start, end = calibration.replays(initial), calibration.replays(fitted)
    def sim_metrics(results):
        return [{metric: stage["sim"][metric] for metric in calibration.metrics}
                for result in results for stage in result["stages"]]
    if sim_metrics(start) == sim_metrics(end):
        cost_models = sorted({result["cost_model"] for result in start})
        problems.append(
            f"the fitted terms move none of the metrics {', '.join(calibration.metrics)} (the "
            f"replays at the start and fitted values are the same; does {', '.join(cost_models)}, "
            f"the cost model that ran, read {', '.join(map(term_key, fitted))}, and do they set "
            f"those metrics?)")
    if problems:
        raise FitFailed(f"the fit failed: {'; '.join(problems)}")


def fitted_cost_model(runs: list[RealRun], overrides: list[str]) -> str:
    """The conf/cost_model name the runs replayed on (the roofline where the GPU model fell back
    to it); RealRunError where they replayed on different ones, whose terms would fit none."""
    groups = sorted({replay(run, overrides)["cost_model_group"] for run in runs})
    if len(groups) != 1:
        raise RealRunError(f"--real: the runs replay on different cost models ({', '.join(groups)}"
                           f"): give cost_model= on the command line")
    return groups[0]


def errors_with(run: RealRun, overrides: list[str], terms: dict[str, float]) -> list[dict]:
    """Per stage, the reported metrics' real, sim and signed error % with `terms` set."""
    result = replay(run, [*overrides, *(f"{term_key(k)}={v!r}" for k, v in terms.items())])
    return [{"stage": index, "real": {m: stage["real"][m] for m in REPORTED},
             "sim": {m: stage["sim"][m] for m in REPORTED},
             "error_pct": {m: stage["error_pct"][m] for m in REPORTED},
             "overloaded": stage["overloaded"]}
            for index, stage in enumerate(result["stages"])]


def _print_errors(console: Console, title: str, run: RealRun, stages: list[dict]) -> None:
    console.print(f"[bold]{title}[/bold] {run.name}")
    for stage in stages:
        cells = "  ".join(f"{m.replace('_ms', '')} {stage['error_pct'][m]:+.1f}%"
                          if stage["error_pct"][m] is not None else f"{m} -"
                          for m in REPORTED)
        console.print(f"  stage {stage['stage']}: {cells}")


def terms_and_metrics(args: argparse.Namespace,
                      runs: list[RealRun]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """--terms and --metrics, where not given the defaults of the cost model the first run's
    replay config names (the profiled model's own; the overheads and TPOT otherwise)."""
    defaults = (DEFAULT_TERMS, DEFAULT_METRICS)
    if args.terms is None:
        target = compose_replay_config(runs[0], args.overrides).cost_model.get("_target_")
        if target == PROFILED_TARGET:
            defaults = (PROFILED_TERMS, PROFILED_METRICS)
    terms = (tuple(t for t in args.terms.split(",") if t) if args.terms is not None
             else defaults[0])
    metrics = (tuple(m for m in args.metrics.split(",") if m) if args.metrics is not None
               else defaults[1])
    return terms, metrics


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="twinserve-calibrate",
        description="Fit a cost model's engine-overhead terms to measured serving runs.")
    parser.add_argument("--real", nargs="+", required=True, metavar="RUN",
                        help="runs to fit (files or folders, as twinserve-validate --real reads)")
    parser.add_argument("--held-out", nargs="*", default=[], metavar="RUN",
                        help="runs replayed with the fitted terms and reported, never fitted")
    parser.add_argument("--leave-one-out", action="store_true",
                        help="also fit on all --real runs but one, for each, and report it")
    parser.add_argument("--terms", default=None,
                        help="comma-separated cost_model keys to fit (default: "
                             f"{','.join(DEFAULT_TERMS)}; on cost_model=profiled "
                             f"{','.join(PROFILED_TERMS)}; seconds; *_efficiency "
                             "keys are shares in (0.001, 1], *_scale keys multipliers in [0.1, "
                             "10]), or whole config keys in seconds "
                             "(cluster.frontend_latency_s)")
    parser.add_argument("--metrics", default=None,
                        help="comma-separated stage metrics the loss compares (default: "
                             f"{','.join(DEFAULT_METRICS)}; with the profiled model's default "
                             f"terms {','.join(PROFILED_METRICS)})")
    parser.add_argument("--passes", type=int, default=DEFAULT_PASSES,
                        help="most coordinate passes of the search; it stops at one that "
                             "improves nothing (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=None,
                        help="the terms file to write (JSON: the cost model fitted on, terms, "
                             "runs, errors), for cost_model.terms_file=")
    parser.add_argument("overrides", nargs="*", help="simulator overrides (key=value)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console()
    try:
        if args.passes < 1:
            raise ValueError(f"--passes must be >= 1, got {args.passes}")
        runs = [read_run(path) for path in args.real]
        held_out = [read_run(path) for path in args.held_out]
        terms, metrics = terms_and_metrics(args, runs)
        fitted, loss, num_replays = fit(runs, args.overrides, terms, metrics, args.passes,
                                        check=True)
        console.print(f"fitted on {', '.join(r.name for r in runs)} ({num_replays} replays, "
                      f"rms log error {math.sqrt(loss):.3f}): "
                      + ", ".join(f"{k}={v:.4g}" for k, v in fitted.items()))
        # "terms": the cost model's (what cost_model.terms_file loads); "config": whole config
        # keys (cluster.frontend_latency_s), which go on the command line.
        report = {"cost_model": fitted_cost_model(runs, args.overrides),
                  "terms": {k: v for k, v in fitted.items() if "." not in k},
                  "config": {k: v for k, v in fitted.items() if "." in k},
                  "fitted_on": [r.source for r in runs],
                  "metrics": list(metrics), "overrides": list(args.overrides),
                  "fit": {}, "held_out": {}, "leave_one_out": {}}
        for run in runs:
            report["fit"][run.name] = errors_with(run, args.overrides, fitted)
            _print_errors(console, "fit", run, report["fit"][run.name])
        for run in held_out:
            report["held_out"][run.name] = errors_with(run, args.overrides, fitted)
            _print_errors(console, "held out", run, report["held_out"][run.name])
        if args.leave_one_out and len(runs) > 1:
            for index, run in enumerate(runs):
                others = runs[:index] + runs[index + 1:]
                others_fit, _, _ = fit(others, args.overrides, terms, metrics, args.passes)
                report["leave_one_out"][run.name] = {
                    "terms": others_fit,
                    "stages": errors_with(run, args.overrides, others_fit)}
                _print_errors(console, "left out (fitted on the others)", run,
                              report["leave_one_out"][run.name]["stages"])
    except (RealRunError, ValueError) as error:
        console.print(f"twinserve-calibrate: {error}", style="red", highlight=False)
        return 2
    except FitFailed as error:
        console.print(f"twinserve-calibrate: {error}", style="red", highlight=False,
                      soft_wrap=True)   # (one line, however wide the terminal)
        return 1
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        # The file holds the cost model's terms; a whole config key goes on the command line.
        use = [*args.overrides, f"cost_model.terms_file={args.out}",
               *(f"{term}={value:.6g}" for term, value in fitted.items() if "." in term)]
        console.print(f"wrote {args.out}; predict another run of this server with: "
                      f"twinserve-validate --real RUN {' '.join(use)}", soft_wrap=True,
                      highlight=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
