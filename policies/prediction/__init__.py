"""Output-length predictors: what a scheduler or router may know of a request's output length
before it is generated (`Request.predicted_output_len`), from none at all to the truth.

The predictor is built once per run (conf/predictor, or `LLM(..., predictor=...)`) and asked once
per request at its arrival, before routing: the simulator's arrivals process and the engine's
`generate` set `request.predicted_output_len = predictor.predict(request)`. Nothing in the step
loop calls `update`; it is a hook for a policy that holds the predictor and wants a refined
guess as tokens come out (`refine` calls it when the predictor has one).
"""
from __future__ import annotations

from policies.prediction.predictors import (BucketPredictor, NoisyPredictor, NoPredictor,
                                            OraclePredictor, check_predictor)
from policies.protocols import LengthPredictor
from policies.types import Request


def refine(predictor, request: Request, num_output_tokens: int) -> int | None:
    """Ask `predictor` for a refined prediction of `request` and store it; a predictor without
    `update` keeps its prediction."""
    update = getattr(predictor, "update", None)
    if update is not None:
        request.predicted_output_len = update(request, num_output_tokens)
    return request.predicted_output_len


__all__ = ["BucketPredictor", "LengthPredictor", "NoPredictor", "NoisyPredictor",
           "OraclePredictor", "check_predictor", "refine"]
