"""Workload generation: turn the `workload` config group into the requests a run replays.

Three kinds of workload:

* `synthetic` — `num_requests` requests whose arrival gaps come from a Poisson, gamma or constant
  process at `rate` requests/s, and whose prompt and output lengths each come from a
  fixed / uniform / lognormal / zipf distribution. Optional `classes` mix request classes by
  `share`, each with its own priority, tenant, SLOs and, optionally, length distributions.
* `trace` — arrival times and lengths replayed from a CSV file (the Azure LLM trace format
  `TIMESTAMP,ContextTokens,GeneratedTokens`, or plain `arrival_time,prompt_len,output_len`),
  optionally with the prompts themselves (a `prompt_token_ids` column of space-separated ids) and
  each request's `priority`, `tenant`, `slo_ttft_ms`, `slo_tpot_ms` (an empty cell: the default).
* `conversation` — `num_sessions` multi-turn chats starting as a Poisson process at `rate`
  sessions/s, each of a sampled number of `turns`, a turn arriving a sampled `think_time_s` after
  the previous one arrived. Each turn's prompt is the whole conversation so far (the previous
  prompt, a stand-in for its answer, then a new `message_len`-token message), so with token ids
  later turns start with the earlier turns' exact ids and the prefix cache can serve them.

Any kind can attach random prompt token ids (`with_token_ids`), optionally all starting with
the same `shared_prefix_len` tokens, for runs that need ids (the engine, prefix caching).

Everything random is drawn from `numpy.random.default_rng(seed)`, vectorised. The generator is
split into one independent stream per quantity (arrivals, prompt lengths, output lengths, token
ids, classes), so that changing one part of the config — say the output-length distribution —
leaves the others unchanged: two runs that differ in one knob see the same arrivals (common random
numbers). Classes draw from their own stream, so tagging requests with classes that keep the
workload's lengths changes nothing but the tags. A conversation draws its session starts, message
lengths, output lengths and token ids from the streams the synthetic kind draws its arrivals,
prompt lengths, output lengths and ids from, and its turns and think times from two streams of
their own.
"""
from __future__ import annotations

import csv
import math
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import OmegaConf

from policies import validators
from policies.types import Request

KINDS = ("synthetic", "trace", "conversation")
ARRIVAL_PROCESSES = ("poisson", "gamma", "constant")
LENGTH_DISTRIBUTIONS = ("fixed", "uniform", "lognormal", "zipf")

SYNTHETIC_FIELDS = ("kind", "num_requests", "rate", "arrival", "burstiness", "prompt_len",
                    "output_len", "n", "with_token_ids", "shared_prefix_len", "classes")
CLASS_FIELDS = ("share", "priority", "tenant", "slo_ttft_ms", "slo_tpot_ms", "prompt_len",
                "output_len")
# Within this of 1, shares sum to 1: 1/3 + 1/3 + 1/3 written as decimals may not add up exactly.
SHARE_SUM_TOLERANCE = 1e-9
TRACE_FIELDS = ("kind", "trace_path", "time_scale", "max_requests", "n", "with_token_ids",
                "shared_prefix_len")
CONVERSATION_FIELDS = ("kind", "num_sessions", "rate", "turns", "think_time_s", "message_len",
                       "output_len", "max_prompt_len", "n", "with_token_ids", "shared_prefix_len")
# Distributions of a duration in seconds (think_time_s), and every parameter they take.
TIME_DISTRIBUTIONS = ("fixed", "uniform", "exponential", "lognormal")
TIME_FIELDS = ("dist", "value", "low", "high", "mean", "sigma")
# Every parameter any length distribution takes; a length mapping may carry the parameters of
# another distribution (left over after a `dist=` override) but nothing outside this list.
LENGTH_FIELDS = ("dist", "value", "low", "high", "mean", "sigma", "a", "min", "max")

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
PLAIN_COLUMNS = ("arrival_time", "prompt_len", "output_len")
TOKEN_IDS_COLUMN = "prompt_token_ids"  # optional: the prompts themselves, space-separated ids
# Optional per-request metadata columns; an empty cell (or a missing column) is Request's default.
METADATA_COLUMNS = ("priority", "tenant", "slo_ttft_ms", "slo_tpot_ms")
DEFAULT_TENANT = "default"

# A relative trace_path is looked up in the working directory, then here (the repo root), so the
# default config works whether or not Hydra changed the working directory.
REPO_ROOT = Path(__file__).resolve().parents[2]

# The truncated zipf sampler builds a table over every length in [min, max]; this caps its size.
MAX_ZIPF_SUPPORT = 10_000_000

_REQUIRED = object()


def build_workload(cfg: Mapping[str, Any], *, seed: int,
                   vocab_size: int | None = None) -> list[Request]:
    """The requests described by `cfg` (the `workload` config group: a DictConfig or a dict).

    Returns them sorted by arrival time with request_id 0..N-1. Raises ValueError, naming the
    config field, for any bad value.
    """
    fields = _Fields(_as_plain_dict(cfg), "workload")
    kind = fields.choice("kind", KINDS)
    # Child streams are numbered in spawn order (child i is the same however many are spawned),
    # so appending the class stream, then the conversation's turns and think-time streams, leaves
    # the earlier ones exactly as they were before those existed.
    arrival_rng, prompt_rng, output_rng, token_rng, class_rng, turns_rng, think_rng = (
        np.random.default_rng(seed).spawn(7))
    token_ids = None  # a trace's own prompts, when it has them
    metadata: dict[str, list] = {}  # Request field -> one value per request, when not default

    if kind == "synthetic":
        fields.reject_unknown(SYNTHETIC_FIELDS)
        num_requests = fields.integer("num_requests", minimum=1)
        rate = fields.rate("rate")
        arrival = fields.choice("arrival", ARRIVAL_PROCESSES, default="poisson")
        burstiness = fields.number("burstiness", default=1.0, greater_than=0.0)
        prompt_dist = _parse_length_distribution(fields.section("prompt_len"))
        output_dist = _parse_length_distribution(fields.section("output_len"))
        classes = _parse_classes(fields)
        n, token_spec = _parse_common(fields, vocab_size)

        arrival_times = _sample_arrival_times(arrival, rate, burstiness, num_requests, arrival_rng)
        prompt_lens = prompt_dist.sample(num_requests, prompt_rng)
        output_lens = output_dist.sample(num_requests, output_rng)
        if classes:
            metadata = _apply_classes(classes, prompt_lens, output_lens, class_rng)
    elif kind == "conversation":
        fields.reject_unknown(CONVERSATION_FIELDS)
        num_sessions = fields.integer("num_sessions", minimum=1)
        rate = fields.rate("rate")
        turns_dist = _parse_length_distribution(fields.section("turns"))
        think_dist = _parse_time_distribution(fields.section("think_time_s"))
        message_dist = _parse_length_distribution(fields.section("message_len"))
        output_dist = _parse_length_distribution(fields.section("output_len"))
        max_prompt_len = fields.integer("max_prompt_len", default=None, minimum=1)
        # Prefix caching needs ids, so a conversation has them unless told otherwise.
        n, token_spec = _parse_common(fields, vocab_size, with_token_ids_default=True)
        shared_prefix_len = fields.integer("shared_prefix_len", default=0, minimum=0)
        if max_prompt_len is not None and shared_prefix_len >= max_prompt_len:
            raise ValueError(f"{fields.name('max_prompt_len')} must be > "
                             f"{fields.name('shared_prefix_len')}, got {max_prompt_len} <= "
                             f"{shared_prefix_len}")

        turns = _sample_conversations(
            num_sessions, rate, turns_dist, think_dist, message_dist, output_dist,
            shared_prefix_len, max_prompt_len,
            arrival_rng=arrival_rng, turns_rng=turns_rng, think_rng=think_rng,
            message_rng=prompt_rng, output_rng=output_rng)
        if not len(turns.arrival_times):
            raise ValueError(f"{fields.name('max_prompt_len')}={max_prompt_len} leaves no request: "
                             f"every session's first prompt ({fields.name('shared_prefix_len')} + "
                             f"a {fields.name('message_len')}) is longer")
        arrival_times, prompt_lens, output_lens = (
            turns.arrival_times, turns.prompt_lens, turns.output_lens)
        if token_spec is not None:
            token_ids = _conversation_token_ids(turns, *token_spec, token_rng)
    else:
        fields.reject_unknown(TRACE_FIELDS)
        trace_path = resolve_trace_path(fields.string("trace_path"))
        time_scale = fields.number("time_scale", default=1.0, greater_than=0.0)
        max_requests = fields.integer("max_requests", default=None, minimum=1)
        n, token_spec = _parse_common(fields, vocab_size)

        arrival_times, prompt_lens, output_lens, trace_token_ids, trace_metadata = (
            read_trace(trace_path))
        order = np.argsort(arrival_times, kind="stable")[:max_requests]
        arrival_times = arrival_times[order] * time_scale
        prompt_lens, output_lens = prompt_lens[order], output_lens[order]
        metadata = {name: [values[i] for i in order.tolist()]
                    for name, values in trace_metadata.items()}
        if trace_token_ids is not None:
            if token_spec is not None and token_spec[1]:
                raise ValueError(f"{fields.name('shared_prefix_len')}: trace {trace_path} has "
                                 f"its own prompt_token_ids")
            _check_vocabulary(trace_token_ids, vocab_size, trace_path)
            token_ids = [trace_token_ids[i] for i in order.tolist()]

    if token_ids is None:
        token_ids = (_sample_prompt_token_ids(prompt_lens, *token_spec, token_rng)
                     if token_spec is not None else [None] * len(prompt_lens))
    # .tolist() turns the arrays into Python floats/ints in one pass (much faster than per item).
    requests = [
        Request(request_id=i, arrival_time=t, prompt_len=p, output_len=o, n=n, prompt_token_ids=ids)
        for i, (t, p, o, ids) in enumerate(zip(arrival_times.tolist(), prompt_lens.tolist(),
                                               output_lens.tolist(), token_ids))
    ]
    for name, values in metadata.items():
        for request, value in zip(requests, values):
            setattr(request, name, value)
    return requests


# ---------------------------------------------------------------------------------------------
# Config reading and validation


def _as_plain_dict(cfg: Any) -> dict:
    if OmegaConf.is_config(cfg):
        # resolve=True so interpolations such as ${oc.env:...} in trace_path become strings.
        cfg = OmegaConf.to_container(cfg, resolve=True)
    if not isinstance(cfg, Mapping):
        raise ValueError(f"workload config must be a mapping, got {type(cfg).__name__}")
    return dict(cfg)


class _Fields:
    """Typed reads from one config mapping; errors name the field by its full dotted path."""

    def __init__(self, values: Mapping[str, Any], path: str):
        self.values = values
        self.path = path

    def name(self, key: str) -> str:
        return f"{self.path}.{key}"

    def get(self, key: str, default: Any) -> Any:
        value = self.values.get(key, default)
        if value is _REQUIRED:
            raise ValueError(f"{self.name(key)} is required")
        return value

    def reject_unknown(self, known: Sequence[str]) -> None:
        # Catches typos (`num_request=1000`) that would otherwise be silently ignored.
        for key in self.values:
            if key not in known:
                raise ValueError(f"{self.name(key)} is not a known field; known fields: "
                                 f"{', '.join(known)}")

    def choice(self, key: str, options: Sequence[str], default: Any = _REQUIRED) -> str:
        value = self.get(key, default)
        if value not in options:
            raise ValueError(f"{self.name(key)} must be one of {', '.join(options)}; got {value!r}")
        return value

    def integer(self, key: str, *, default: Any = _REQUIRED, minimum: int | None) -> int | None:
        value = self.get(key, default)
        if value is None and default is None:
            return None
        # bool is an int subclass; `n: true` is a mistake, not 1. Integral floats (1e4) are fine.
        is_integral = (isinstance(value, (int, np.integer)) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer())
        if not is_integral:
            raise ValueError(f"{self.name(key)} must be an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise ValueError(f"{self.name(key)} must be >= {minimum}, got {value!r}")
        return int(value)

    def number(self, key: str, *, default: Any = _REQUIRED, greater_than: float | None = None,
               allow_inf: bool = False) -> float | None:
        value = self.get(key, default)
        if value is None and default is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise ValueError(f"{self.name(key)} must be a number, got {value!r}")
        if math.isnan(value) or (math.isinf(value) and not allow_inf):
            raise ValueError(f"{self.name(key)} must be a finite number, got {value!r}")
        # Written as `not >` so NaN fails too.
        if greater_than is not None and not value > greater_than:
            raise ValueError(f"{self.name(key)} must be > {greater_than:g}, got {value!r}")
        return float(value)

    def rate(self, key: str) -> float:
        # A YAML `inf` (without the dot) or a plain-dict "inf" arrives as a string.
        value = self.get(key, _REQUIRED)
        if isinstance(value, str) and value.strip().lower() in ("inf", ".inf", "infinity"):
            return math.inf
        return self.number(key, greater_than=0.0, allow_inf=True)

    def boolean(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"{self.name(key)} must be true or false, got {value!r}")
        return bool(value)

    def string(self, key: str) -> str:
        value = self.get(key, _REQUIRED)
        if not isinstance(value, (str, Path)) or not str(value):
            raise ValueError(f"{self.name(key)} must be a non-empty path string, got {value!r}")
        return str(value)

    def section(self, key: str) -> "_Fields":
        value = self.get(key, _REQUIRED)
        if not isinstance(value, Mapping):
            raise ValueError(f"{self.name(key)} must be a mapping such as "
                             f"{{dist: lognormal, mean: 512, sigma: 1.0}}, got {value!r}")
        return _Fields(value, self.name(key))


def _parse_common(fields: _Fields, vocab_size: int | None, *,
                  with_token_ids_default: bool = False) -> tuple[int, tuple[int, int] | None]:
    """`n` and the token-id settings every kind shares; token spec is (vocab_size, prefix_len)."""
    n = fields.integer("n", default=1, minimum=1)
    with_token_ids = fields.boolean("with_token_ids", default=with_token_ids_default)
    shared_prefix_len = fields.integer("shared_prefix_len", default=0, minimum=0)
    if not with_token_ids:
        if shared_prefix_len:
            # A shared prefix only exists in token ids; without them it would silently do nothing.
            raise ValueError(f"{fields.name('shared_prefix_len')}={shared_prefix_len} needs "
                             f"{fields.name('with_token_ids')}=true")
        return n, None
    if vocab_size is None:
        raise ValueError(f"{fields.name('with_token_ids')}=true needs a vocab_size: call "
                         f"build_workload(cfg, seed=..., vocab_size=...)")
    # A model config's numpy integer is as good as an int.
    vocab_size = validators.positive_int(
        "vocab_size", int(vocab_size) if isinstance(vocab_size, np.integer) else vocab_size)
    return n, (vocab_size, shared_prefix_len)


# ---------------------------------------------------------------------------------------------
# Synthetic sampling


def _sample_arrival_times(arrival: str, rate: float, burstiness: float, num_requests: int,
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
class _LengthDistribution:
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
            lengths = np.rint(_lognormal(self.mean, self.sigma, size, rng))
            upper = self.max if self.max is not None else np.iinfo(np.int64).max // 2
            return np.clip(lengths, self.min, upper).astype(np.int64)
        # zipf, truncated to [min, max]: P(length = min + r - 1) ∝ r^-a for rank r >= 1, so `min`
        # is the most common length. Exact inverse-CDF sampling of the truncated law, which is
        # what rejecting samples above `max` would give, without the rejection loop.
        ranks = np.arange(1, self.max - self.min + 2, dtype=np.float64)
        cdf = np.cumsum(ranks ** -self.a)
        cdf /= cdf[-1]
        index = np.searchsorted(cdf, rng.random(size), side="right")
        return self.min + np.minimum(index, len(ranks) - 1).astype(np.int64)


def _parse_length_distribution(fields: _Fields) -> _LengthDistribution:
    fields.reject_unknown(LENGTH_FIELDS)
    dist = fields.choice("dist", LENGTH_DISTRIBUTIONS)
    if dist == "fixed":
        return _LengthDistribution(dist, value=fields.integer("value", minimum=1))
    if dist == "uniform":
        low = fields.integer("low", minimum=1)
        high = fields.integer("high", minimum=low)
        return _LengthDistribution(dist, low=low, high=high)
    minimum = fields.integer("min", default=1, minimum=1)
    if dist == "lognormal":
        mean = fields.number("mean", greater_than=0.0)
        sigma = validators.non_negative_number(fields.name("sigma"),
                                               fields.number("sigma", greater_than=None))
        maximum = fields.integer("max", default=None, minimum=minimum)
        return _LengthDistribution(dist, mean=mean, sigma=sigma, min=minimum, max=maximum)
    a = fields.number("a", greater_than=1.0)
    maximum = fields.integer("max", minimum=minimum)
    if maximum - minimum + 1 > MAX_ZIPF_SUPPORT:
        raise ValueError(f"{fields.name('max')} - {fields.name('min')} must be < "
                         f"{MAX_ZIPF_SUPPORT}, got {maximum} - {minimum}")
    return _LengthDistribution(dist, a=a, min=minimum, max=maximum)


@dataclass(frozen=True)
class _RequestClass:
    """One entry of `workload.classes`; None lengths: the workload's own distributions."""

    share: float
    priority: int = 0
    tenant: str = DEFAULT_TENANT
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    prompt_len: _LengthDistribution | None = None
    output_len: _LengthDistribution | None = None


def _parse_classes(fields: _Fields) -> list[_RequestClass]:
    """`workload.classes`: null (no classes) or a list of class mappings whose shares sum to 1."""
    value = fields.get("classes", None)
    if value is None:
        return []
    name = fields.name("classes")
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise ValueError(f"{name} must be null or a non-empty list such as "
                         f"[{{share: 0.8, tenant: a}}, {{share: 0.2, tenant: b}}], got {value!r}")
    classes = []
    for index, entry in enumerate(value):
        path = f"{name}[{index}]"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{path} must be a mapping such as {{share: 0.5, tenant: a}}, "
                             f"got {entry!r}")
        item = _Fields(entry, path)
        item.reject_unknown(CLASS_FIELDS)
        share = item.number("share")
        if not 0 < share <= 1:
            raise ValueError(f"{item.name('share')} must be in (0, 1], got {entry['share']!r}")
        tenant = item.get("tenant", DEFAULT_TENANT)
        if not isinstance(tenant, str) or not tenant:
            raise ValueError(f"{item.name('tenant')} must be a non-empty string, got {tenant!r}")
        classes.append(_RequestClass(
            share=share,
            priority=item.integer("priority", default=0, minimum=None),
            tenant=tenant,
            slo_ttft_ms=item.number("slo_ttft_ms", default=None, greater_than=0.0),
            slo_tpot_ms=item.number("slo_tpot_ms", default=None, greater_than=0.0),
            prompt_len=(_parse_length_distribution(item.section("prompt_len"))
                        if item.get("prompt_len", None) is not None else None),
            output_len=(_parse_length_distribution(item.section("output_len"))
                        if item.get("output_len", None) is not None else None)))
    total = math.fsum(request_class.share for request_class in classes)
    if abs(total - 1.0) > SHARE_SUM_TOLERANCE:
        shares = " + ".join(f"{request_class.share:g}" for request_class in classes)
        raise ValueError(f"{name}: shares must sum to 1, got {shares} = {total:.12g}")
    return classes


def _apply_classes(classes: list[_RequestClass], prompt_lens: np.ndarray,
                   output_lens: np.ndarray, rng: np.random.Generator) -> dict[str, list]:
    """Draw each request's class by share; give a class's requests its own lengths (in place)
    where it has its own distributions, and return the classes' fields per request."""
    num_requests = len(prompt_lens)
    # One stream to choose classes, then a prompt and an output stream per class, so that
    # changing one class's lengths leaves every other draw as it was.
    choice_rng, *length_rngs = rng.spawn(1 + 2 * len(classes))
    # Inverse-CDF on one uniform per request: a small change of shares moves few requests.
    bounds = np.cumsum([request_class.share for request_class in classes])
    chosen = np.minimum(np.searchsorted(bounds, choice_rng.random(num_requests), side="right"),
                        len(classes) - 1)
    for index, request_class in enumerate(classes):
        members = chosen == index
        # Each class draws a full-length sample and keeps its members' entries, so its lengths
        # for a request do not depend on which other requests joined the class.
        if request_class.prompt_len is not None:
            prompt_lens[members] = request_class.prompt_len.sample(
                num_requests, length_rngs[2 * index])[members]
        if request_class.output_len is not None:
            output_lens[members] = request_class.output_len.sample(
                num_requests, length_rngs[2 * index + 1])[members]
    chosen = chosen.tolist()
    return {name: [getattr(classes[index], name) for index in chosen]
            for name in ("priority", "tenant", "slo_ttft_ms", "slo_tpot_ms")}


def _sample_prompt_token_ids(prompt_lens: np.ndarray, vocab_size: int, shared_prefix_len: int,
                             rng: np.random.Generator) -> list[list[int]]:
    """Uniform random ids in [0, vocab_size); every prompt starts with the same
    `shared_prefix_len` ids (a prompt shorter than that is a prefix of the shared prefix)."""
    prefix = rng.integers(0, vocab_size, shared_prefix_len).tolist()
    unique_lens = np.maximum(prompt_lens - shared_prefix_len, 0)
    unique_ids = rng.integers(0, vocab_size, int(unique_lens.sum())).tolist()
    token_ids = []
    start = 0
    for prompt_len, unique_len in zip(prompt_lens.tolist(), unique_lens.tolist()):
        token_ids.append(prefix[:prompt_len] + unique_ids[start:start + unique_len])
        start += unique_len
    return token_ids


# ---------------------------------------------------------------------------------------------
# Conversations


@dataclass(frozen=True)
class _TimeDistribution:
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
        return _lognormal(self.mean, self.sigma, size, rng)


def _parse_time_distribution(fields: _Fields) -> _TimeDistribution:
    fields.reject_unknown(TIME_FIELDS)
    dist = fields.choice("dist", TIME_DISTRIBUTIONS)
    if dist == "fixed":
        value = fields.number("value")
        return _TimeDistribution(dist, value=validators.non_negative_number(fields.name("value"),
                                                                            value))
    if dist == "uniform":
        low = validators.non_negative_number(fields.name("low"), fields.number("low"))
        high = fields.number("high")
        if high < low:
            raise ValueError(f"{fields.name('high')} must be >= {fields.name('low')}, got "
                             f"{high:g} < {low:g}")
        return _TimeDistribution(dist, low=low, high=high)
    mean = fields.number("mean", greater_than=0.0)
    if dist == "exponential":
        return _TimeDistribution(dist, mean=mean)
    sigma = validators.non_negative_number(fields.name("sigma"), fields.number("sigma"))
    return _TimeDistribution(dist, mean=mean, sigma=sigma)


def _lognormal(mean: float, sigma: float, size: int, rng: np.random.Generator) -> np.ndarray:
    """Lognormal draws of arithmetic mean `mean`: E[exp(N(mu, sigma^2))] = exp(mu + sigma^2/2)."""
    return rng.lognormal(math.log(mean) - sigma ** 2 / 2, sigma, size)


@dataclass(frozen=True)
class _ConversationTurns:
    """Every kept turn of a conversation workload, sorted by arrival (ties: session, then turn),
    as parallel arrays; message_lens are the new tokens of each turn's prompt."""

    arrival_times: np.ndarray
    prompt_lens: np.ndarray
    output_lens: np.ndarray
    message_lens: np.ndarray
    sessions: np.ndarray
    turn_indices: np.ndarray  # 0 for a session's first turn


def _segment_exclusive_cumsum(values: np.ndarray, starts: np.ndarray,
                              lengths: np.ndarray) -> np.ndarray:
    """For consecutive segments (session-major turns), the sum of each value's predecessors
    within its own segment."""
    inclusive = np.cumsum(values)
    before_segment = np.repeat(inclusive[starts] - values[starts], lengths)
    return inclusive - values - before_segment


def _sample_conversations(num_sessions: int, rate: float, turns_dist: _LengthDistribution,
                          think_dist: _TimeDistribution, message_dist: _LengthDistribution,
                          output_dist: _LengthDistribution, shared_prefix_len: int,
                          max_prompt_len: int | None, *, arrival_rng: np.random.Generator,
                          turns_rng: np.random.Generator, think_rng: np.random.Generator,
                          message_rng: np.random.Generator,
                          output_rng: np.random.Generator) -> _ConversationTurns:
    """Sample the sessions and lay out their turns.

    Session s starts at its Poisson arrival; its turn k+1 arrives think_time after turn k
    arrived (all arrivals are fixed before a run starts, so a turn cannot wait for the previous
    answer). prompt_len(1) = shared_prefix_len + message_len(1) and prompt_len(k+1) =
    prompt_len(k) + output_len(k) + message_len(k+1). A session ends before its first turn whose
    prompt would pass max_prompt_len (prompts grow with k, so the kept turns are a prefix)."""
    session_starts = _sample_arrival_times("poisson", rate, 1.0, num_sessions, arrival_rng)
    turns = turns_dist.sample(num_sessions, turns_rng)
    num_turns = int(turns.sum())
    # Session-major: session 0's turns, then session 1's, ...
    starts = np.cumsum(turns) - turns
    sessions = np.repeat(np.arange(num_sessions), turns)
    turn_indices = np.arange(num_turns) - np.repeat(starts, turns)
    # One think time per turn: the gap before the session's next turn (the last one's is unused).
    think_times = think_dist.sample(num_turns, think_rng)
    message_lens = message_dist.sample(num_turns, message_rng)
    output_lens = output_dist.sample(num_turns, output_rng)

    arrival_times = (session_starts[sessions]
                     + _segment_exclusive_cumsum(think_times, starts, turns))
    prompt_lens = (shared_prefix_len + message_lens
                   + _segment_exclusive_cumsum(message_lens + output_lens, starts, turns))
    kept = (np.ones(num_turns, dtype=bool) if max_prompt_len is None
            else prompt_lens <= max_prompt_len)
    # Ties (a zero think time, or rate=inf) go to the lower session, then the earlier turn.
    order = np.lexsort((turn_indices[kept], sessions[kept], arrival_times[kept]))
    return _ConversationTurns(
        arrival_times=arrival_times[kept][order], prompt_lens=prompt_lens[kept][order],
        output_lens=output_lens[kept][order], message_lens=message_lens[kept][order],
        sessions=sessions[kept][order], turn_indices=turn_indices[kept][order])


def _conversation_token_ids(turns: _ConversationTurns, vocab_size: int, shared_prefix_len: int,
                            rng: np.random.Generator) -> list[list[int]]:
    """Each turn's prompt ids: the session's previous prompt ids, then random ids standing for
    the previous turn's answer (its output_len of them), then the new message's random ids; a
    first turn is the shared prefix then its message.

    The stand-in answer is what the next turn's prompt carries, not what the run generates (the
    simulator generates no ids, the engine its own). A prefix cache keys on prompt ids, so on
    either backend turn k+1 can hit on the whole of turn k's prompt (its full blocks), which
    holds every earlier message and stand-in answer, prefilled when turn k ran; only turn k's
    answer and the new message are computed. (Turn k+1 hits less when it arrives before turn k's
    prefill, or after the cache evicted those blocks.)"""
    prefix = rng.integers(0, vocab_size, shared_prefix_len).tolist()
    # Messages and answers from streams of their own, drawn in arrival order.
    message_rng, answer_rng = rng.spawn(2)
    message_ids = message_rng.integers(0, vocab_size, int(turns.message_lens.sum())).tolist()
    answer_ids = answer_rng.integers(0, vocab_size, int(turns.output_lens.sum())).tolist()
    contexts: dict[int, list[int]] = {}  # session -> its last prompt + that turn's stand-in answer
    token_ids = []
    message_start = answer_start = 0
    for session, message_len, output_len in zip(turns.sessions.tolist(),
                                                 turns.message_lens.tolist(),
                                                 turns.output_lens.tolist()):
        # Turns of a session arrive in turn order, so its context is the previous turn's.
        prompt = contexts.get(session, prefix) + message_ids[message_start:message_start
                                                             + message_len]
        message_start += message_len
        token_ids.append(prompt)
        contexts[session] = prompt + answer_ids[answer_start:answer_start + output_len]
        answer_start += output_len
    return token_ids


# ---------------------------------------------------------------------------------------------
# Traces


def resolve_trace_path(trace_path: str | Path) -> Path:
    """An absolute path as is; a relative one against the working directory, then the repo root."""
    path = Path(trace_path).expanduser()
    candidates = [path] if path.is_absolute() else [Path.cwd() / path, REPO_ROOT / path]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    tried = " or ".join(str(candidate) for candidate in candidates)
    raise ValueError(f"workload.trace_path: no trace file at {tried}")


def read_trace(path: str | Path) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                          list[list[int]] | None, dict[str, list]]:
    """(arrival_time s, prompt_len, output_len) arrays of a CSV trace, in file order, the
    prompts' token ids when it has a `prompt_token_ids` column (else None), and a list of
    values per METADATA_COLUMNS column it has, keyed by the column (a Request field).

    Arrival times are relative to the earliest row, which is at 0. Accepts the Azure columns
    `TIMESTAMP` (a datetime, or numeric seconds), `ContextTokens`, `GeneratedTokens`, or the plain
    columns `arrival_time` (seconds), `prompt_len`, `output_len`; other columns are ignored but
    `prompt_token_ids` (space-separated ids, as many as the row's prompt length) and the metadata:
    `priority` (an integer, lower first), `tenant` (a name), `slo_ttft_ms` and `slo_tpot_ms`
    (positive numbers), each defaulting (0, "default", none) where its cell is empty.
    """
    path = Path(path)
    try:
        # utf-8-sig drops a byte-order mark that would otherwise stick to the first column name.
        with open(path, newline="", encoding="utf-8-sig") as file:
            reader = csv.reader(file)
            header = [name.strip() for name in next(reader, [])]
            rows, line_numbers = [], []
            for row in reader:
                if row:  # skip blank lines
                    rows.append(row)
                    line_numbers.append(reader.line_num)
    except OSError as error:
        raise ValueError(f"trace {path}: cannot read: {error.strerror or error}") from None

    columns = AZURE_COLUMNS if set(AZURE_COLUMNS) & set(header) else PLAIN_COLUMNS
    missing = [name for name in columns if name not in header]
    if missing:
        raise ValueError(
            f"trace {path}: missing column(s) {', '.join(missing)}; found "
            f"{', '.join(header) or 'no header'}; expected {', '.join(AZURE_COLUMNS)} (Azure) "
            f"or {', '.join(PLAIN_COLUMNS)} (plain)")
    if not rows:
        raise ValueError(f"trace {path}: no data rows")

    indices = [header.index(name) for name in columns]
    for row_number, (row, line) in enumerate(zip(rows, line_numbers), start=1):
        if len(row) <= max(indices):
            raise ValueError(f"trace {path}: row {row_number} (line {line}) has {len(row)} "
                             f"field(s), expected {len(header)}")
    time_column, prompt_column, output_column = (
        [row[index].strip() for row in rows] for index in indices)

    arrival_times = _parse_times(time_column, columns[0], line_numbers, path)
    prompt_lens = _parse_lengths(prompt_column, columns[1], line_numbers, path)
    output_lens = _parse_lengths(output_column, columns[2], line_numbers, path)
    token_ids = None
    if TOKEN_IDS_COLUMN in header:
        index = header.index(TOKEN_IDS_COLUMN)
        token_ids = [_parse_token_ids(row[index] if index < len(row) else "", prompt_len,
                                      f"row {number} (line {line})", path)
                     for number, (row, prompt_len, line) in enumerate(
                         zip(rows, prompt_lens.tolist(), line_numbers), start=1)]
    metadata = {}
    for name in METADATA_COLUMNS:
        if name in header:
            index = header.index(name)
            cells = [row[index].strip() if index < len(row) else "" for row in rows]
            metadata[name] = _parse_metadata(cells, name, line_numbers, path)
    return arrival_times, prompt_lens, output_lens, token_ids, metadata


def _parse_metadata(cells: list[str], column: str, line_numbers: list[int], path: Path) -> list:
    """One METADATA_COLUMNS column's values; an empty cell gives Request's default."""
    if column == "tenant":
        return [cell or DEFAULT_TENANT for cell in cells]
    values: list = []
    for index, cell in enumerate(cells):
        if not cell:
            values.append(0 if column == "priority" else None)
            continue
        try:
            number = float(cell)
        except ValueError:
            number = math.nan
        if column == "priority":
            if not number.is_integer():  # NaN and inf are not integers either
                raise _bad_row_error(path, line_numbers, index, column, "an integer", cell)
            values.append(int(number))
        else:
            if not (math.isfinite(number) and number > 0):
                raise _bad_row_error(path, line_numbers, index, column,
                                     "a positive number of ms or empty", cell)
            values.append(number)
    return values


def _parse_token_ids(text: str, prompt_len: int, where: str, path: Path) -> list[int]:
    try:
        token_ids = [int(token) for token in text.split()]
    except ValueError:
        raise ValueError(f"trace {path}: {where}: {TOKEN_IDS_COLUMN} must be space-separated "
                         f"integers, got {text[:40]!r}") from None
    if len(token_ids) != prompt_len:
        raise ValueError(f"trace {path}: {where}: {len(token_ids)} {TOKEN_IDS_COLUMN} for a "
                         f"prompt_len of {prompt_len}")
    return token_ids


def _check_vocabulary(token_ids: list[list[int]], vocab_size: int | None, path: Path) -> None:
    """Every id within the model's vocabulary (when the caller gives it)."""
    if vocab_size is None:
        return
    for row, ids in enumerate(token_ids, start=1):
        if ids and (min(ids) < 0 or max(ids) >= vocab_size):
            raise ValueError(f"trace {path}: row {row}: {TOKEN_IDS_COLUMN} outside the "
                             f"model's vocabulary [0, {vocab_size})")


def _bad_row_error(path: Path, line_numbers: list[int], index: int, column: str, what: str,
                   value: str) -> ValueError:
    return ValueError(f"trace {path}: row {index + 1} (line {line_numbers[index]}): {column} "
                      f"must be {what}, got {value!r}")


def _parse_lengths(values: list[str], column: str, line_numbers: list[int],
                   path: Path) -> np.ndarray:
    try:
        lengths = np.array(values, dtype=np.float64)
    except ValueError:
        lengths = None
    if lengths is None:  # find the culprit only on the error path
        for index, value in enumerate(values):
            try:
                float(value)
            except ValueError:
                raise _bad_row_error(path, line_numbers, index, column, "a positive integer",
                                     value) from None
    # NaN and inf fail these checks too.
    bad = ~np.isfinite(lengths) | (lengths < 1) | (lengths != np.floor(lengths))
    if bad.any():
        index = int(np.argmax(bad))
        raise _bad_row_error(path, line_numbers, index, column, "a positive integer", values[index])
    return lengths.astype(np.int64)


# Python's datetime.fromisoformat reads at most 6 fractional digits; the Azure trace has 7.
_EXTRA_FRACTION_DIGITS = re.compile(r"(\.\d{6})\d+")


def _parse_times(values: list[str], column: str, line_numbers: list[int],
                 path: Path) -> np.ndarray:
    """Seconds relative to the earliest value; numeric seconds or ISO datetimes."""
    try:
        seconds = np.array(values, dtype=np.float64)
    except ValueError:
        seconds = _parse_datetimes(values, column, line_numbers, path)
    bad = ~np.isfinite(seconds)
    if bad.any():
        index = int(np.argmax(bad))
        raise _bad_row_error(path, line_numbers, index, column, "a finite time", values[index])
    return seconds - seconds.min()


def _parse_datetimes(values: list[str], column: str, line_numbers: list[int],
                     path: Path) -> np.ndarray:
    """Seconds since the earliest of some datetime strings (naive ones taken as UTC)."""
    # Fast path: numpy parses naive ISO datetimes with up to 9 fractional digits, vectorised.
    # It warns about (and we then refuse) timezone offsets, which the slow path handles.
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            stamps = np.array(values, dtype="datetime64[ns]")
        return (stamps - stamps.min()).astype(np.int64) / 1e9
    except (ValueError, Warning):
        pass
    # Slow path: one row at a time, dropping fractional digits past the 6th (sub-microsecond).
    stamps = []
    for index, value in enumerate(values):
        try:
            stamp = datetime.fromisoformat(_EXTRA_FRACTION_DIGITS.sub(r"\1", value))
        except ValueError:
            raise _bad_row_error(path, line_numbers, index, column,
                                 "a datetime like 2023-11-16 18:17:03.9799600 or seconds",
                                 value) from None
        stamps.append(stamp if stamp.tzinfo else stamp.replace(tzinfo=timezone.utc))
    earliest = min(stamps)
    # Differences of datetimes are exact to the microsecond, unlike epoch seconds as floats.
    return np.array([(stamp - earliest).total_seconds() for stamp in stamps])
