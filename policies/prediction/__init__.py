"""Output-length predictors: what a scheduler or router may know of a request's output length
before it is generated (`Request.predicted_output_len`), from none at all to the truth.

The predictor is built once per run (conf/predictor, or `LLM(..., predictor=...)`) and asked once
per request at its arrival, before routing: the simulator's arrivals process and the engine's
`generate` set `request.predicted_output_len = predictor.predict(request)`. A predictor with an
`update` of its own refines its guesses as tokens come out: the step loop asks it after every
step about each request that made progress (`refine`), and runs every step on its own for it.
"""
from __future__ import annotations

from policies.prediction.predictors import (BucketPredictor, KeepPrediction, NoisyPredictor,
                                            NoPredictor, OraclePredictor, check_predictor)
from policies.protocols import LengthPredictor
from policies.types import Request


def refine(predictor, request: Request, num_output_tokens: int) -> int | None:
    """Ask `predictor` for a refined prediction of `request` and store it; a predictor without
    `update` keeps its prediction."""
    update = getattr(predictor, "update", None)
    if update is not None:
        request.predicted_output_len = update(request, num_output_tokens)
    return request.predicted_output_len


__all__ = ["BucketPredictor", "KeepPrediction", "LengthPredictor", "NoPredictor", "NoisyPredictor",
           "OraclePredictor", "check_predictor", "refine"]
