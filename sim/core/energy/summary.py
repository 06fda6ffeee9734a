"""The run's energy keys (total joules, average power, joules per output token, tokens per joule)
for the run, each replica and each pool; docs/energy.md says what counts as busy and idle and
which replica a token counts for.
"""
from __future__ import annotations

from collections.abc import Mapping

from policies.types import Request
from sim.core.energy.meter import EnergyMeter
from runtime.metrics.statistics import is_completed


def energy_numbers(energy_j: float, output_tokens: int, span_s: float) -> dict[str, float]:
    """energy_j, avg_power_w, joules_per_output_token and tokens_per_joule (0.0 where the
    denominator is 0: no time, no tokens, or no power stated)."""
    return {"energy_j": energy_j,
            "avg_power_w": energy_j / span_s if span_s > 0 else 0.0,
            "joules_per_output_token": energy_j / output_tokens if output_tokens else 0.0,
            "tokens_per_joule": output_tokens / energy_j if energy_j > 0 else 0.0}


def energy_summary(meters: Mapping[int, EnergyMeter], pools: Mapping[int, str],
                   requests: list[Request], span_s: float, total_output_tokens: int,
                   output_tokens_by_replica: Mapping[int, int] | None = None) -> dict:
    """The run's energy numbers at the top level, `energy_per_replica`, `energy_per_pool` and
    `energy_model` (how they were worked out). `output_tokens_by_replica`: counted already, for a
    streamed run whose `requests` are gone."""
    if len(meters) == 1:   # (every request's tokens are the one replica's)
        tokens_by_replica = dict.fromkeys(meters, total_output_tokens)
    elif output_tokens_by_replica is not None:
        tokens_by_replica = {replica_id: output_tokens_by_replica.get(replica_id, 0)
                             for replica_id in meters}
    else:
        tokens_by_replica = dict.fromkeys(meters, 0)
        for request in requests:
            if is_completed(request) and request.replica_id in tokens_by_replica:
                tokens_by_replica[request.replica_id] += request.num_output_tokens
    joules = {replica_id: meter.energy_j(span_s) for replica_id, meter in meters.items()}
    per_pool: dict[str, list[int]] = {}
    for replica_id in meters:
        per_pool.setdefault(pools[replica_id], []).append(replica_id)
    total_tokens = sum(tokens_by_replica.values())
    summary = energy_numbers(sum(joules.values()), total_tokens, span_s)
    summary["energy_per_replica"] = {
        str(replica_id): energy_numbers(joules[replica_id], tokens_by_replica[replica_id], span_s)
        for replica_id in meters}
    summary["energy_per_pool"] = {
        pool: energy_numbers(sum(joules[i] for i in ids),
                             sum(tokens_by_replica[i] for i in ids), span_s)
        for pool, ids in per_pool.items()}
    descriptions = sorted({meter.power_model.describe() for meter in meters.values()})
    summary["energy_model"] = "; ".join(descriptions)
    return summary
