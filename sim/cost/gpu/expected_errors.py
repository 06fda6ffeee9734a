"""The error a GPU run's TTFT, TPOT and E2E are expected to have, by the kind of prediction it
makes, from leave-out checks (data/gpu/expected_errors.json, `python -m
calibration.expected_errors`); docs/gpu-cost-model.md says how a run's kind picks its checks."""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path

KIND_KEYS = ("kernels", "arrivals", "precision", "model", "version", "tp")
ALWAYS_KEPT = 2   # the leading keys a run is judged by while any check shares them
METRICS = ("ttft", "tpot", "e2e")
MIN_CHECKS = 5
EXPECTED_ERRORS_FILE = Path(__file__).resolve().parents[3] / "data" / "gpu" / "expected_errors.json"


def kind_of(kernels: str, version_exact: bool, tensor_parallel_size: int, is_moe: bool,
            quantized: bool, closed_loop: bool = False) -> dict[str, str]:
    return {"kernels": kernels, "arrivals": "closed" if closed_loop else "open",
            "version": "exact" if version_exact else "nearest",
            "tp": "tp1" if tensor_parallel_size == 1 else "tp>1",
            "model": "moe" if is_moe else "dense", "precision": "fp8" if quantized else "bf16"}


def percentile_abs(errors: list[float], share: float = 0.8) -> float:
    """The ceil(share x (n + 1))-th smallest of the n |errors| (the largest where that passes n,
    or of fewer than five): a new run's error is within it at least `share` of the time, where
    the plain quantile of the n would cover a little less (split-conformal prediction)."""
    values = sorted(abs(e) for e in errors)
    if len(values) < MIN_CHECKS:
        return values[-1]
    # (an epsilon: a product an ulp above an integer is that integer)
    rank = math.ceil(share * (len(values) + 1) - 1e-9)
    return values[min(rank, len(values)) - 1]


@functools.lru_cache(maxsize=None)
def _checks() -> tuple[dict, ...]:
    if not EXPECTED_ERRORS_FILE.is_file():
        return ()
    return tuple(json.loads(EXPECTED_ERRORS_FILE.read_text())["checks"])


def expected_errors_for(kind: dict[str, str], checks=None) -> dict | None:
    """{ttft, tpot, e2e: percentile_abs of the |errors| in %, checks: how many, basis: the kind
    they share} for a run of `kind`; None where no check shares even its kernels."""
    checks = _checks() if checks is None else checks
    for depth in range(len(KIND_KEYS), 0, -1):
        keys = KIND_KEYS[:depth]
        same = [c for c in checks if all(c["kind"][k] == kind[k] for k in keys)]
        if len(same) >= MIN_CHECKS or (depth <= ALWAYS_KEPT and same):
            result = {metric: percentile_abs([c["error_pct"][metric] for c in same])
                      for metric in METRICS}
            result["checks"] = len(same)
            result["basis"] = ", ".join(kind[k] for k in keys)
            return result
    return None


def leave_one_out_coverage(checks) -> dict[str, float]:
    """{metric: the share of checks whose |error| is within what the others state for their
    kind}: how often the stated expected error held on a measurement it was not taken from (the
    promise is 0.8); a check no other shares a kind with counts as not covered."""
    covered = dict.fromkeys(METRICS, 0)
    for index, check in enumerate(checks):
        stated = expected_errors_for(check["kind"], checks[:index] + checks[index + 1:])
        for metric in METRICS:
            covered[metric] += (stated is not None
                                and abs(check["error_pct"][metric]) <= stated[metric])
    return {metric: covered[metric] / len(checks) for metric in METRICS}

