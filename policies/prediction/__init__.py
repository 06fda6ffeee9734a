"""Output-length predictors: what a scheduler or router may know of a request's output length
(`Request.predicted_output_len`), set once at arrival and, for an OnlineLengthPredictor, refined
after every step (`refine`)."""
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
