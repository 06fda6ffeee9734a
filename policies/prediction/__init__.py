"""Output-length predictors: what a scheduler or router may know of a request's output length
before it is generated (`Request.predicted_output_len`), from none at all to the truth.

The predictor is built once per run (conf/predictor, or `LLM(..., predictor=...)`) and asked once
per request at its arrival, before routing: the simulator's arrivals process and the engine's
`generate` set `request.predicted_output_len = predictor.predict(request)`. A predictor with an
`update` (OnlineLengthPredictor) refines its guesses as tokens come out: the step loop asks it
after every step about each request that made progress (`refine`), and runs every step on its
own for it.
"""
from __future__ import annotations

from policies.prediction.predictors import (BucketPredictor, NoisyPredictor, NoPredictor,
                                            OraclePredictor)
from policies.protocols import LengthPredictor, OnlineLengthPredictor
from policies.types import Request


def refine(predictor: OnlineLengthPredictor, request: Request,
           num_output_tokens: int) -> int | None:
    """Ask `predictor` for a refined prediction of `request` and store it."""
    request.predicted_output_len = predictor.update(request, num_output_tokens)
    return request.predicted_output_len


__all__ = ["BucketPredictor", "LengthPredictor", "NoPredictor", "NoisyPredictor",
           "OnlineLengthPredictor", "OraclePredictor", "refine"]
