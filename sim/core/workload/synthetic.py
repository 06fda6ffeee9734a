"""The `synthetic` workload kind: sampled arrivals and lengths, with optional request `classes`
mixed by `share`."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from sim.core.workload.distributions import (
    ARRIVAL_PROCESSES, LengthDistribution, parse_length_distribution, sample_arrival_times)
from sim.core.workload.fields import (
    DEFAULT_TENANT, Fields, RequestArrays, Streams, parse_common)

SYNTHETIC_FIELDS = ("kind", "num_requests", "rate", "arrival", "burstiness", "prompt_len",
                    "output_len", "n", "with_token_ids", "shared_prefix_len", "classes",
                    "timeout_s")
CLASS_FIELDS = ("share", "priority", "tenant", "slo_ttft_ms", "slo_tpot_ms", "prompt_len",
                "output_len")
# Shares written as decimals (1/3 each) may not add up to exactly 1.
SHARE_SUM_TOLERANCE = 1e-9


def sample_synthetic(fields: Fields, vocab_size: int | None, streams: Streams) -> RequestArrays:
    """The synthetic kind's requests; classes draw from a stream of their own, so tagging
    requests with classes that keep the workload's lengths changes nothing but the tags."""
    fields.reject_unknown(SYNTHETIC_FIELDS)
    num_requests = fields.integer("num_requests", minimum=1)
    rate = fields.rate("rate")
    arrival = fields.choice("arrival", ARRIVAL_PROCESSES, default="poisson")
    burstiness = fields.number("burstiness", default=1.0, greater_than=0.0)
    prompt_dist = parse_length_distribution(fields.section("prompt_len"))
    output_dist = parse_length_distribution(fields.section("output_len"))
    classes = _parse_classes(fields)
    n, token_spec = parse_common(fields, vocab_size)

    arrival_times = sample_arrival_times(arrival, rate, burstiness, num_requests, streams.arrival)
    prompt_lens = prompt_dist.sample(num_requests, streams.prompt)
    output_lens = output_dist.sample(num_requests, streams.output)
    metadata = {}
    if classes:
        metadata = _apply_classes(classes, prompt_lens, output_lens, streams.classes)
    return RequestArrays(arrival_times, prompt_lens, output_lens, n, token_spec,
                         metadata=metadata)


@dataclass(frozen=True)
class _RequestClass:
    """One entry of `workload.classes`; None lengths: the workload's own distributions."""

    share: float
    priority: int = 0
    tenant: str = DEFAULT_TENANT
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    prompt_len: LengthDistribution | None = None
    output_len: LengthDistribution | None = None


def _parse_classes(fields: Fields) -> list[_RequestClass]:
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
        item = Fields(entry, path)
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
            prompt_len=(parse_length_distribution(item.section("prompt_len"))
                        if item.get("prompt_len", None) is not None else None),
            output_len=(parse_length_distribution(item.section("output_len"))
                        if item.get("output_len", None) is not None else None)))
    total = math.fsum(request_class.share for request_class in classes)
    if abs(total - 1.0) > SHARE_SUM_TOLERANCE:
        shares = " + ".join(f"{request_class.share:g}" for request_class in classes)
        raise ValueError(f"{name}: shares must sum to 1, got {shares} = {total:.12g}")
    return classes


def _apply_classes(classes: list[_RequestClass], prompt_lens: np.ndarray,
                   output_lens: np.ndarray, rng: np.random.Generator) -> dict[str, list]:
    """Draw each request's class, give it its class's lengths in place, and return the classes'
    fields per request."""
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
        # A full-length sample per class, so a request's lengths do not depend on who else joined.
        if request_class.prompt_len is not None:
            prompt_lens[members] = request_class.prompt_len.sample(
                num_requests, length_rngs[2 * index])[members]
        if request_class.output_len is not None:
            output_lens[members] = request_class.output_len.sample(
                num_requests, length_rngs[2 * index + 1])[members]
    chosen = chosen.tolist()
    return {name: [getattr(classes[index], name) for index in chosen]
            for name in ("priority", "tenant", "slo_ttft_ms", "slo_tpot_ms")}
