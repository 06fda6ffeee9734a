"""The compared metrics, their signed errors and the gates on them: pure functions on the
summaries of the engine's and the simulator's runs.

With engine repeats, a metric's engine value is their mean and its spread their relative
half-range, (max - min) / 2 / |mean| × 100, so that a simulator error within it is as close as
the engine's own repeats are. The verdict (VERDICTS) weighs the error against gate and spread,
but the gates alone decide pass or fail."""
from __future__ import annotations

import math

import numpy as np

LATENCIES: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")
STATS: tuple[str, ...] = ("mean", "median", "p90", "p99")
METRICS: tuple[str, ...] = (
    *(f"{stat}_{name}_ms" for name in LATENCIES for stat in STATS),
    "request_throughput", "output_throughput",
    "num_preemptions", "peak_kv_blocks", "swap_bytes",
    "spec_acceptance_rate", "mean_tokens_per_decode_step",   # 0 and 1 (or 0) without drafts
)

# The project's fidelity targets (docs/calibration.md, "Validation"), each overridable by a
# --gate-* option: percentages of the engine's value.
DEFAULT_GATES = {"mean_pct": 3.0, "p99_pct": 8.0, "p99_ttft_pct": 10.0, "preemptions_pct": 5.0}
GATED_BY: dict[str, str] = {
    **{f"{stat}_{name}_ms": "mean_pct" for name in ("ttft", "tpot", "e2el")
       for stat in ("mean", "median")},
    "request_throughput": "mean_pct", "output_throughput": "mean_pct",
    "p99_ttft_ms": "p99_ttft_pct", "p99_tpot_ms": "p99_pct", "p99_itl_ms": "p99_pct",
    "p99_e2el_ms": "p99_pct",
    "num_preemptions": "preemptions_pct",
}

UNSET = object()  # a gate not given on the command line


class ValidationInputError(ValueError):
    """Bad input: exit status 2."""


def error_pct(engine: float, sim: float) -> float | None:
    """Signed (sim - engine) / engine × 100. With engine = 0: 0 if sim is 0 too, else None (an
    infinite relative error, which fails any gate)."""
    engine, sim = float(engine), float(sim)
    if engine == 0.0:
        return 0.0 if sim == 0.0 else None
    return (sim - engine) / abs(engine) * 100.0


def compare_summaries(engine: dict, sim: dict,
                      metrics: tuple[str, ...] = METRICS) -> dict[str, dict]:
    """{name: {"engine": x, "sim": y, "error_pct": e}} for every metric of `metrics`."""
    missing = [name for name in metrics if name not in engine or name not in sim]
    if missing:
        raise ValidationInputError(f"summaries lack the metrics {missing}")
    return {name: {"engine": engine[name], "sim": sim[name],
                   "error_pct": error_pct(engine[name], sim[name])} for name in metrics}


def mean_summary(summaries: list[dict], metrics: tuple[str, ...] = METRICS) -> dict:
    """Several simulator runs of one workload as one prediction: each metric's mean over the
    runs (their expected value, where one run is one draw of the residuals and acceptances)."""
    mean = {name: float(np.mean([summary[name] for summary in summaries]))
            for name in metrics if all(name in summary for summary in summaries)}
    mean["wall_time_s"] = float(np.mean([summary["wall_time_s"] for summary in summaries]))
    mean["completed"] = summaries[0]["completed"]
    return mean


WITHIN_GATE, WITHIN_NOISE, OUTSIDE_BOTH, UNGATED = ("within gate", "within engine noise",
                                                   "outside both", "ungated")
VERDICTS: tuple[str, ...] = (WITHIN_GATE, WITHIN_NOISE, OUTSIDE_BOTH, UNGATED)


def spread_pct(values: list[float]) -> float | None:
    """The relative half-range of the engine's repeats, (max - min) / 2 / |mean| × 100: 0 when
    they are all 0, None (infinite) when their mean is 0 and they are not."""
    values = [float(value) for value in values]
    mean = float(np.mean(values))
    half_range = (max(values) - min(values)) / 2.0
    if mean == 0.0:
        return 0.0 if half_range == 0.0 else None
    return half_range / abs(mean) * 100.0


def verdict(error: float | None, gate: float | None, spread: float | None) -> str:
    """A metric's verdict: within its gate, else within the engine's noise, else outside both
    (an error of None, infinite, is outside both; a spread of None is infinite)."""
    if gate is None:
        return UNGATED
    if error is None or not math.isfinite(error):
        return OUTSIDE_BOTH
    if abs(error) <= gate:
        return WITHIN_GATE
    if spread is None or abs(error) <= spread:
        return WITHIN_NOISE
    return OUTSIDE_BOTH


def add_engine_noise(metrics: dict[str, dict], engine_summaries: list[dict],
                     gates: dict[str, float | None]) -> dict[str, dict]:
    """Each metric of `metrics` (compared against the engine's mean) with the engine's repeats'
    values ("engine_runs"), their spread ("engine_spread_pct") and the verdict ("verdict")."""
    for name, values in metrics.items():
        runs = [summary[name] for summary in engine_summaries]
        values["engine_runs"] = runs
        values["engine_spread_pct"] = spread_pct(runs)
        gate_name = GATED_BY.get(name)
        values["verdict"] = verdict(values["error_pct"],
                                    gates.get(gate_name) if gate_name else None,
                                    values["engine_spread_pct"])
    return metrics


def check_gates(metrics: dict[str, dict], gates: dict[str, float | None]) -> list[str]:
    """The gated metrics whose |error| passes their gate, as 'name: error % (gate ±g %)' lines.
    A gate of None switches that gate off; an error of None (engine 0, sim not) always fails."""
    failures = []
    for name, gate_name in GATED_BY.items():
        gate = gates.get(gate_name)
        if gate is None or name not in metrics:
            continue
        error = metrics[name]["error_pct"]
        if error is None or not math.isfinite(error) or abs(error) > gate:
            shown = "inf" if error is None else f"{error:+.3f} %"
            line = f"{name}: {shown} (gate ±{gate:g} %, {gate_name})"
            if metrics[name].get("verdict") == WITHIN_NOISE:
                spread = metrics[name]["engine_spread_pct"]
                line += (" within engine noise (spread " +
                         ("inf" if spread is None else f"±{spread:.3f} %") + ")")
            failures.append(line)
    return failures


def resolve_gates(cli: dict[str, float | None | str], config=None) -> dict[str, float | None]:
    """Each gate from the command line if given there, else from the config's `validate` node
    (`+validate.gate_mean_pct=5`), else the default. UNSET on the command line means not given."""
    config = config or {}
    gates = {}
    for name, default in DEFAULT_GATES.items():
        value = cli.get(name, UNSET)
        if value is UNSET:
            value = config.get(f"gate_{name}", default)
            if value is not None and (isinstance(value, bool) or
                                      not isinstance(value, (int, float)) or value < 0):
                raise ValidationInputError(f"validate.gate_{name} must be a percentage >= 0 or "
                                           f"null, got {value!r}")
        gates[name] = None if value is None else float(value)
    return gates


def speedup(engine_wall_s: float, sim_wall_s: float) -> float | None:
    """How many times faster the simulator ran the workload than the engine (None: 0 s)."""
    return engine_wall_s / sim_wall_s if sim_wall_s > 0 else None
