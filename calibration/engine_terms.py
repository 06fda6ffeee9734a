"""Fit a vLLM version's engine terms (step_overhead_s, per_sequence_overhead_s) to NVIDIA's
measured rows of that version (data/gpu/aiconfigurator/silicon_vllm.csv) into
data/gpu/engine_terms.json, which the GPU cost model reads.

    python -m calibration.engine_terms --version 0.12.0 --model Qwen/Qwen3-32B --system h100_sxm \\
        --fit-isl 1024 [--write]

The terms are what a decode step costs beyond its kernels, so they are fitted on the mostly-decode
rows (the shortest prompts, `--fit-isl`) and checked on the others; a step's overhead adds
a + b x sequences to every inter-token gap, so one replay at zero makes the fit linear."""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from calibration.silicon import compare_rows, read_silicon_rows, select_rows
from sim.cost.gpu.engine_terms import ENGINE_TERMS_FILE

TERMS = ("step_overhead_s", "per_sequence_overhead_s")


def _terms_overrides(step_s: float, per_sequence_s: float) -> list[str]:
    return [f"cost_model.step_overhead_s={step_s!r}",
            f"cost_model.per_sequence_overhead_s={per_sequence_s!r}"]


def fit_terms(rows) -> tuple[float, float]:
    """(step_overhead_s, per_sequence_overhead_s) minimising the relative TPOT error of `rows`,
    both non-negative."""
    from scipy.optimize import nnls

    replayed = compare_rows(rows, _terms_overrides(0.0, 0.0))["rows"]
    real = np.array([r["real_tpot_ms"] for r in replayed]) * 1e-3
    sim = np.array([r["sim_tpot_ms"] for r in replayed]) * 1e-3
    concurrency = np.array([r["concurrency"] for r in replayed], dtype=float)
    design = np.column_stack([1.0 / real, concurrency / real])
    (step_s, per_sequence_s), _ = nnls(design, (real - sim) / real)
    return float(step_s), float(per_sequence_s)


def _summary(report: dict) -> str:
    s = report["summary"]
    return (f"{s['num_rows']} rows: |TPOT error| mean {s['mean_abs_tpot_error_pct']:.1f} %, worst "
            f"{s['worst_abs_tpot_error_pct']:.1f} %; |TTFT error| mean "
            f"{s['mean_abs_ttft_error_pct']:.1f} %")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m calibration.engine_terms",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", required=True, help="backend_version of the rows (0.12.0)")
    parser.add_argument("--model", required=True, help="the rows' model_path")
    parser.add_argument("--system", required=True, help="the rows' system (h100_sxm)")
    parser.add_argument("--fit-isl", type=int, required=True,
                        help="fit on the rows of this input length; the rest are held out")
    parser.add_argument("--write", action="store_true",
                        help="store the fit in data/gpu/engine_terms.json under the version")
    args = parser.parse_args(argv)
    rows = [row for row in select_rows(read_silicon_rows(), system=args.system, model=args.model,
                                       precision="bf16")
            if row.backend_version == args.version]
    fit_rows = [row for row in rows if row.isl == args.fit_isl]
    held_out = [row for row in rows if row.isl != args.fit_isl]
    if not fit_rows or not held_out:
        print(f"calibration.engine_terms: --fit-isl {args.fit_isl} leaves {len(fit_rows)} rows to "
              f"fit and {len(held_out)} to check among {len(rows)} rows of {args.model} on "
              f"{args.system}, vLLM {args.version}; both must be non-empty", file=sys.stderr)
        return 2
    step_s, per_sequence_s = fit_terms(fit_rows)
    print(f"vLLM {args.version}: step_overhead_s={step_s:.3g}, per_sequence_overhead_s="
          f"{per_sequence_s:.3g} (fitted on {len(fit_rows)} rows of isl {args.fit_isl})")
    overrides = _terms_overrides(step_s, per_sequence_s)
    print("  fit rows:  ", _summary(compare_rows(fit_rows, overrides)))
    print("  held out:  ", _summary(compare_rows(held_out, overrides)))
    if args.write:
        stored = json.loads(ENGINE_TERMS_FILE.read_text())
        key = ".".join(args.version.split(".")[:2])
        stored["versions"][key] = {
            "step_overhead_s": step_s, "per_sequence_overhead_s": per_sequence_s,
            "fitted_on": (f"silicon_vllm.csv: {len(fit_rows)} rows of {args.model} on "
                          f"{args.system}, vLLM {args.version}, isl {args.fit_isl} (TPOT); "
                          f"{len(held_out)} rows of other isl held out"),
            "command": " ".join(["python -m calibration.engine_terms", *sys.argv[1:]])}
        ENGINE_TERMS_FILE.write_text(json.dumps(stored, indent=2) + "\n")
        print(f"  written to {ENGINE_TERMS_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
