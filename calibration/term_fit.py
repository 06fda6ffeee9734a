"""Fitting a few positive cost-model terms to a loss that only a whole replay evaluates: no
gradients and few evaluations, so coordinate descent in log space (each order of magnitude alike)
with a golden-section search per term within its bounds.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping

GOLDEN = (math.sqrt(5) - 1) / 2


def _golden_section(loss_at: Callable[[float], float], low: float, high: float,
                    tolerance: float) -> tuple[float, float]:
    """(x, loss) near the minimum of a unimodal `loss_at` on [low, high]."""
    a, b = low, high
    c, d = b - GOLDEN * (b - a), a + GOLDEN * (b - a)
    loss_c, loss_d = loss_at(c), loss_at(d)
    while b - a > tolerance:
        if loss_c <= loss_d:
            b, d, loss_d = d, c, loss_c
            c = b - GOLDEN * (b - a)
            loss_c = loss_at(c)
        else:
            a, c, loss_c = c, d, loss_d
            d = a + GOLDEN * (b - a)
            loss_d = loss_at(d)
    return (c, loss_c) if loss_c <= loss_d else (d, loss_d)


def fit_terms(loss: Callable[[dict[str, float]], float], initial: Mapping[str, float],
              bounds: Mapping[str, tuple[float, float]], passes: int = 2,
              tolerance: float = 0.02) -> tuple[dict[str, float], float]:
    """The terms (a dict like `initial`) that minimise `loss(terms)`, and that loss; `bounds`
    are (low, high) > 0 per term, `tolerance` the resolution in natural-log units."""
    for name in initial:
        if name not in bounds:
            raise ValueError(f"fit_terms: no bounds for term {name!r}")
        low, high = bounds[name]
        if not 0 < low < high:
            raise ValueError(f"fit_terms: bounds for {name!r} must satisfy 0 < low < high, "
                             f"got ({low}, {high})")
    terms = dict(initial)
    best = loss(terms)
    for _ in range(passes):
        improved = False
        for name in initial:
            low, high = bounds[name]

            def loss_at(log_value: float, name=name) -> float:
                return loss({**terms, name: math.exp(log_value)})

            log_value, value_loss = _golden_section(loss_at, math.log(low), math.log(high),
                                                    tolerance)
            if value_loss < best:
                terms[name], best, improved = math.exp(log_value), value_loss, True
        if not improved:
            break
    return terms, best
