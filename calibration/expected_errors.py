"""Leave-out checks end to end, by kind of prediction, into data/gpu/expected_errors.json (the
GPU cost model's stated expected error: sim/cost/gpu/expected_errors.py).

    python -m calibration.expected_errors [--write]
    python -m calibration.expected_errors --show      # the shipped file's statements and coverage

The checks predict measurements no term was fitted on: NVIDIA's measured vLLM rows that replay,
less the rows an engine term was fitted on and the deployments with a row whose latencies need
more forward-kernel time than a second per second (calibration/silicon_feasibility.py: the
Llama-3.1-8B FP8 rows on the H200), and the real vLLM runs of data/real-runs/llmservingsim/ but
the one the vLLM 0.19 terms were fitted on."""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

from sim.cost.gpu.expected_errors import (EXPECTED_ERRORS_FILE, KIND_KEYS, METRICS,
                                     expected_errors_for, kind_of, leave_one_out_coverage)

REPO = Path(__file__).resolve().parents[1]
REAL_RUNS = ("data/real-runs/llmservingsim/RTX4090/Llama-3.1-8B",
             "data/real-runs/llmservingsim/RTXPRO6000/Qwen3-32B",
             "data/real-runs/llmservingsim/RTXPRO6000/Qwen3-30B-A3B-Instruct-2507")
# Silicon rows an engine term was fitted on (model, vLLM version, isl).
FITTED = {("Qwen/Qwen3-32B", "0.12.0", 1024)}


def _kind(cost_model, closed_loop: bool) -> dict[str, str]:
    """The kind of prediction a built GPU cost model makes."""
    m = cost_model.model
    return kind_of("vllm" if cost_model.kernels is not None else "vidur",
                   "nearest measured" not in cost_model.kernel_source,
                   cost_model.tensor_parallel_size, m.is_moe, m.quantization is not None,
                   closed_loop)


def silicon_checks() -> list[dict]:
    from calibration.silicon import compare_rows, read_silicon_rows, row_config, \
        silicon_overrides, skip_reason
    from sim.core.settings import replica_settings
    from sim.cost.build import build_cost_model
    from runtime.specs import HardwareSpec, ModelSpec

    from calibration.silicon_feasibility import deployments_beyond_the_kernels

    rows = [row for row in read_silicon_rows() if skip_reason(row) is None
            and (row.model, row.backend_version, row.isl) not in FITTED]
    left_out = deployments_beyond_the_kernels(rows)
    rows = [row for row in rows if (row.model, row.system, row.backend_version) not in left_out]
    report = compare_rows(rows)
    by_id = {row.id: row for row in rows}
    checks = []
    for result in report["rows"]:
        row = by_id[result["id"]]
        config = row_config(["progress=false", *silicon_overrides(row)])
        model = ModelSpec.from_config(config.model)
        cost_model = build_cost_model(config.cost_model, replica_settings(config, model), model,
                                      HardwareSpec.from_config(config.hardware))
        real_e2e = result["real_ttft_ms"] + (row.osl - 1) * result["real_tpot_ms"]
        sim_e2e = result["sim_ttft_ms"] + (row.osl - 1) * result["sim_tpot_ms"]
        checks.append({"check": f"silicon {row.id}", "kind": _kind(cost_model, True), "error_pct": {
            "ttft": result["ttft_error_pct"], "tpot": result["tpot_error_pct"],
            "e2e": 100 * (sim_e2e - real_e2e) / real_e2e}})
    return checks


def real_run_checks() -> list[dict]:
    from calibration.realrun.readers import read_run
    from calibration.realrun.replay import compose_replay_config, replay
    from sim.core.settings import replica_settings
    from sim.cost.build import build_cost_model
    from runtime.specs import HardwareSpec, ModelSpec

    checks = []
    for path in REAL_RUNS:
        run = read_run(REPO / path)
        config = compose_replay_config(run)
        model = ModelSpec.from_config(config.model)
        cost_model = build_cost_model(config.cost_model, replica_settings(config, model), model,
                                      HardwareSpec.from_config(config.hardware))
        for stage in replay(run, config=config)["stages"]:
            error = stage["error_pct"]
            checks.append({"check": f"{path} {stage['label']}", "kind": _kind(cost_model, False),
                           "error_pct": {"ttft": error["mean_ttft_ms"],
                                         "tpot": error["mean_tpot_ms"],
                                         "e2e": error["mean_e2el_ms"]}})
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m calibration.expected_errors",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"write {EXPECTED_ERRORS_FILE}")
    parser.add_argument("--show", action="store_true",
                        help=f"only state each kind's errors from {EXPECTED_ERRORS_FILE.name}")
    args = parser.parse_args(argv)
    if args.show:
        checks = json.loads(EXPECTED_ERRORS_FILE.read_text())["checks"]
    else:
        checks = silicon_checks() + real_run_checks()
    for values in itertools.product(("vllm", "vidur"), ("open", "closed"), ("bf16", "fp8"),
                                    ("dense", "moe"), ("exact", "nearest"), ("tp1", "tp>1")):
        kind = dict(zip(KIND_KEYS, values))
        stated = expected_errors_for(kind, checks)
        if stated is not None:
            print(f"{', '.join(values):44s} {stated['checks']:4d} checks ({stated['basis']}): "
                  + "  ".join(f"{metric} ±{stated[metric]:.1f} %" for metric in METRICS))
    for arrivals in ("closed", "open"):
        same = [check for check in checks if check["kind"]["arrivals"] == arrivals]
        if same:
            coverage = leave_one_out_coverage(same)
            print(f"{arrivals} arrivals, {len(same)} checks: each within what the others state "
                  f"for its kind: " + "  ".join(f"{metric} {coverage[metric]:.0%}"
                                                for metric in METRICS))
    if args.write and not args.show:
        EXPECTED_ERRORS_FILE.write_text(json.dumps({
            "about": ("Leave-out checks end to end (python -m calibration.expected_errors "
                      "--write): each a prediction of a measurement no term was fitted on, its "
                      "kind and its signed errors in %. sim/cost/gpu/expected_errors.py states the "
                      "80th percentile of |error| of a run's kind."),
            "checks": checks}, indent=1) + "\n")
        print(f"wrote {EXPECTED_ERRORS_FILE} ({len(checks)} checks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
