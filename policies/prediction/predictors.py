"""The built-in length predictors: none, the oracle, a noisy oracle and a length-class
(bucket) classifier. Each is built from conf/predictor with the run's seed and draws from a
`random.Random` of its own, so turning a predictor on moves no other random draw of the run."""
from __future__ import annotations

import bisect
import math
import random
from collections.abc import Sequence
from statistics import NormalDist

from policies.types import Request
from policies.validators import finite_number, non_negative_int, non_negative_number, probability

# |z| of a standard normal is below this half the time: turns a median error into a sigma.
MEDIAN_ABS_NORMAL = NormalDist().inv_cdf(0.75)


def _generator(seed) -> random.Random:
    """A generator of the predictor's own: the seed tagged, so it never repeats another stream
    of the run seeded with the same number."""
    non_negative_int("predictor.seed", seed)
    return random.Random(f"twinserve length predictor {seed}")


def _increasing_positive_ints(name: str, values) -> list[int]:
    """A non-empty list of strictly increasing positive integers (a ListConfig too)."""
    items = list(values) if isinstance(values, Sequence) and not isinstance(values, str) else None
    if not items or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in items) \
            or any(a >= b for a, b in zip(items, items[1:])):
        shown = items if items is not None else values
        raise ValueError(f"{name} must be a non-empty list of increasing positive integers, "
                         f"got {shown!r}")
    return items


class NoPredictor:
    """No prediction: every request's predicted_output_len stays None (the default run)."""

    def predict(self, request: Request) -> int | None:
        return None


class OraclePredictor:
    """The true output length (on the engine: max_tokens, since where EOS stops is unknown)."""

    def predict(self, request: Request) -> int:
        return request.output_len


class NoisyPredictor:
    """The true output length times a lognormal factor: half the predictions lie within a factor
    of 1 + `relative_error` of the truth; 0 is the oracle."""

    def __init__(self, relative_error: float = 0.5, seed: int = 0):
        non_negative_number("predictor.relative_error", relative_error)
        finite_number("predictor.relative_error", relative_error)
        self.relative_error = relative_error
        self.sigma = math.log1p(relative_error) / MEDIAN_ABS_NORMAL
        self.rng = _generator(seed)

    def predict(self, request: Request) -> int:
        if self.sigma == 0:
            return request.output_len
        return max(1, round(request.output_len * self.rng.lognormvariate(0.0, self.sigma)))


class BucketPredictor:
    """A length classifier: `boundaries` split lengths into classes, the prediction is the true
    class's value (`values`, default midpoints and 2 x the top boundary), or with probability
    `confusion_rate` a neighbour's."""

    def __init__(self, boundaries: Sequence[int] = (64, 256, 1024), confusion_rate: float = 0.0,
                 values: Sequence[int] | None = None, seed: int = 0):
        self.boundaries = _increasing_positive_ints("predictor.boundaries", boundaries)
        self.confusion_rate = probability("predictor.confusion_rate", confusion_rate)
        if values is None:
            lows = [0, *self.boundaries[:-1]]
            values = [max(1, (low + 1 + high) // 2) for low, high in zip(lows, self.boundaries)]
            values.append(2 * self.boundaries[-1])
        else:
            values = _increasing_positive_ints("predictor.values", values)
            if len(values) != len(self.boundaries) + 1:
                raise ValueError(f"predictor.values must give one value per class, "
                                 f"{len(self.boundaries) + 1} for {len(self.boundaries)} "
                                 f"boundaries, got {len(values)}")
        self.values = values
        self.rng = _generator(seed)

    def bucket(self, length: int) -> int:
        """The class of an output length: 0 for <= b1, ..., k for > bk."""
        return bisect.bisect_left(self.boundaries, length)

    def predict(self, request: Request) -> int:
        index = self.bucket(request.output_len)
        if self.confusion_rate and self.rng.random() < self.confusion_rate:
            last = len(self.values) - 1
            if index == 0 or (index < last and self.rng.random() < 0.5):
                index += 1
            else:
                index -= 1
        return self.values[index]
