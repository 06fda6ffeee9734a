"""The random draws every workload kind is made of (arrivals, lengths, durations, token ids), each
parsed from its config mapping and sampled vectorised."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from policies import validators
from sim.core.workload.fields import Fields

ARRIVAL_PROCESSES = ("poisson", "gamma", "constant")
LENGTH_DISTRIBUTIONS = ("fixed", "uniform", "lognormal", "zipf")
# A length mapping may keep another distribution's parameters after a `dist=` override.
LENGTH_FIELDS = ("dist", "value", "low", "high", "mean", "sigma", "a", "min", "max")
TIME_DISTRIBUTIONS = ("fixed", "uniform", "exponential", "lognormal")
TIME_FIELDS = ("dist", "value", "low", "high", "mean", "sigma")
# The truncated zipf sampler builds a table over every length in [min, max].
MAX_ZIPF_SUPPORT = 10_000_000


def sample_arrival_times(arrival: str, rate: float, burstiness: float, num_requests: int,
                          rng: np.random.Generator) -> np.ndarray:
    """Arrival times (s) of `num_requests` requests; the first arrives one gap after t=0."""
    if math.isinf(rate):
        return np.zeros(num_requests)
    if arrival == "constant":
        return np.arange(1, num_requests + 1) / rate
    if arrival == "poisson":
        gaps = rng.exponential(1.0 / rate, num_requests)
    else:
        # Gamma gaps with mean 1/rate: shape k = burstiness, scale = 1/(rate*k). The coefficient
        # of variation is 1/sqrt(k): k=1 is Poisson, k<1 burstier, k>1 more regular.
        gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), num_requests)
    return np.cumsum(gaps)


@dataclass(frozen=True)
class LengthDistribution:
    """A parsed `prompt_len` / `output_len` mapping. Samples are int64 >= 1."""

    dist: str
    value: int = 1          # fixed
    low: int = 1            # uniform, inclusive
    high: int = 1           # uniform, inclusive
    mean: float = 1.0       # lognormal: arithmetic mean of the unclipped distribution
    sigma: float = 0.0      # lognormal: std of the underlying normal
    a: float = 2.0          # zipf exponent
    min: int = 1            # lognormal clip / zipf truncation
    max: int | None = None  # lognormal clip (None: no upper clip) / zipf truncation (required)

    def sample(self, size: int, rng: np.random.Generator) -> np.ndarray:
        if self.dist == "fixed":
            return np.full(size, self.value, dtype=np.int64)
        if self.dist == "uniform":
            return rng.integers(self.low, self.high + 1, size, dtype=np.int64)
        if self.dist == "lognormal":
            lengths = np.rint(lognormal(self.mean, self.sigma, size, rng))
            upper = self.max if self.max is not None else np.iinfo(np.int64).max // 2
            return np.clip(lengths, self.min, upper).astype(np.int64)
        # Zipf truncated to [min, max] (P(min + r - 1) ∝ r^-a), by inverse CDF: what rejecting
        # samples above `max` would give, without the loop.
        ranks = np.arange(1, self.max - self.min + 2, dtype=np.float64)
        cdf = np.cumsum(ranks ** -self.a)
        cdf /= cdf[-1]
        index = np.searchsorted(cdf, rng.random(size), side="right")
        return self.min + np.minimum(index, len(ranks) - 1).astype(np.int64)


def parse_length_distribution(fields: Fields) -> LengthDistribution:
    fields.reject_unknown(LENGTH_FIELDS)
    dist = fields.choice("dist", LENGTH_DISTRIBUTIONS)
    if dist == "fixed":
        return LengthDistribution(dist, value=fields.integer("value", minimum=1))
    if dist == "uniform":
        low = fields.integer("low", minimum=1)
        high = fields.integer("high", minimum=low)
        return LengthDistribution(dist, low=low, high=high)
    minimum = fields.integer("min", default=1, minimum=1)
    if dist == "lognormal":
        mean = fields.number("mean", greater_than=0.0)
        sigma = validators.non_negative_number(fields.name("sigma"),
                                               fields.number("sigma", greater_than=None))
        maximum = fields.integer("max", default=None, minimum=minimum)
        return LengthDistribution(dist, mean=mean, sigma=sigma, min=minimum, max=maximum)
    a = fields.number("a", greater_than=1.0)
    maximum = fields.integer("max", minimum=minimum)
    if maximum - minimum + 1 > MAX_ZIPF_SUPPORT:
        raise ValueError(f"{fields.name('max')} - {fields.name('min')} must be < "
                         f"{MAX_ZIPF_SUPPORT}, got {maximum} - {minimum}")
    return LengthDistribution(dist, a=a, min=minimum, max=maximum)


@dataclass(frozen=True)
class TimeDistribution:
    """A parsed `think_time_s` mapping. Samples are float64 seconds >= 0."""

    dist: str
    value: float = 0.0   # fixed
    low: float = 0.0     # uniform, [low, high)
    high: float = 0.0    # uniform
    mean: float = 1.0    # exponential; lognormal: arithmetic mean
    sigma: float = 0.0   # lognormal: std of the underlying normal

    def sample(self, size: int, rng: np.random.Generator) -> np.ndarray:
        if self.dist == "fixed":
            return np.full(size, self.value)
        if self.dist == "uniform":
            return rng.uniform(self.low, self.high, size)
        if self.dist == "exponential":
            return rng.exponential(self.mean, size)
        return lognormal(self.mean, self.sigma, size, rng)


def parse_time_distribution(fields: Fields) -> TimeDistribution:
    fields.reject_unknown(TIME_FIELDS)
    dist = fields.choice("dist", TIME_DISTRIBUTIONS)
    if dist == "fixed":
        value = fields.number("value")
        return TimeDistribution(dist, value=validators.non_negative_number(fields.name("value"),
                                                                            value))
    if dist == "uniform":
        low = validators.non_negative_number(fields.name("low"), fields.number("low"))
        high = fields.number("high")
        if high < low:
            raise ValueError(f"{fields.name('high')} must be >= {fields.name('low')}, got "
                             f"{high:g} < {low:g}")
        return TimeDistribution(dist, low=low, high=high)
    mean = fields.number("mean", greater_than=0.0)
    if dist == "exponential":
        return TimeDistribution(dist, mean=mean)
    sigma = validators.non_negative_number(fields.name("sigma"), fields.number("sigma"))
    return TimeDistribution(dist, mean=mean, sigma=sigma)


def lognormal(mean: float, sigma: float, size: int, rng: np.random.Generator) -> np.ndarray:
    """Lognormal draws of arithmetic mean `mean`: E[exp(N(mu, sigma^2))] = exp(mu + sigma^2/2)."""
    return rng.lognormal(math.log(mean) - sigma ** 2 / 2, sigma, size)


def sample_prompt_token_ids(prompt_lens: np.ndarray, vocab_size: int, shared_prefix_len: int,
                             rng: np.random.Generator) -> list[list[int]]:
    """Uniform random ids in [0, vocab_size), every prompt starting with the same
    `shared_prefix_len` ids."""
    prefix = rng.integers(0, vocab_size, shared_prefix_len).tolist()
    unique_lens = np.maximum(prompt_lens - shared_prefix_len, 0)
    unique_ids = rng.integers(0, vocab_size, int(unique_lens.sum())).tolist()
    token_ids = []
    start = 0
    for prompt_len, unique_len in zip(prompt_lens.tolist(), unique_lens.tolist()):
        token_ids.append(prefix[:prompt_len] + unique_ids[start:start + unique_len])
        start += unique_len
    return token_ids
