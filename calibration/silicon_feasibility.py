"""Whether a silicon row's latencies could come from the kernels its prediction is built of: the
tokens per second its closed loop implies, times the least seconds per token the cost model's
forward kernels take at any batch a step may hold. Above one second per second, the row was
served with less work than it records (a prefix cache's hits, shorter prompts), and no
kernel-built model can match it."""
from __future__ import annotations

from calibration.silicon import SiliconRow, row_config, scheduler_settings, silicon_overrides
from runtime.specs import HardwareSpec, ModelSpec
from sim.core.settings import replica_settings
from sim.cost.build import build_cost_model


def implied_tokens_per_s(row: SiliconRow) -> float:
    """Prompt and output tokens per second through one replica, at the request rate the row's
    concurrency and mean latencies give."""
    seconds_per_request = (row.ttft_ms + (row.osl - 1) * row.tpot_ms) / 1e3
    return row.concurrency / seconds_per_request * (row.isl + row.osl)


def least_seconds_per_token(cost_model, max_tokens: int) -> float:
    """The forward kernels' seconds per token at the most efficient batch of up to `max_tokens`."""
    counts = {max_tokens} | {2 ** power for power in range(max_tokens.bit_length())}
    return min(cost_model.forward_kernels_s(count) / count for count in counts)


def feasibility(row: SiliconRow, engine_settings: str = "aiconfigurator") -> dict:
    """The seconds of forward kernels the row's tokens need per second (`load`), and whether
    that is more than one (`beyond`)."""
    config = row_config(["progress=false", *silicon_overrides(row,
                                                              engine_settings=engine_settings)])
    model = ModelSpec.from_config(config.model)
    cost_model = build_cost_model(config.cost_model, replica_settings(config, model), model,
                                  HardwareSpec.from_config(config.hardware))
    budget = scheduler_settings(row, engine_settings)["max_num_batched_tokens"]
    load = implied_tokens_per_s(row) * least_seconds_per_token(cost_model, budget)
    return {"id": row.id, "load": load, "beyond": load > 1.0,
            "kernels": getattr(cost_model, "kernels_used", type(cost_model).__name__)}


def beyond_line(results: list[dict]) -> str | None:
    """One line saying how many rows need more forward-kernel time than a second per second
    (None: none)."""
    beyond = [result for result in results if result["beyond"]]
    if not beyond:
        return None
    worst = max(beyond, key=lambda result: result["load"])
    return (f"{len(beyond)} of {len(results)} rows imply more tokens per second than the forward "
            f"kernels ({worst['kernels']}) can run: up to {worst['load']:.2f} s of kernels per "
            f"second; those latencies cannot come from these kernels (a prefix cache, or less "
            f"work than recorded)")


def deployments_beyond_the_kernels(rows: list[SiliconRow]) -> set[tuple[str, str, str]]:
    """The (model, system, vLLM version) deployments with a row beyond the kernels: one harness
    measured them all, so none of their rows can test a kernel-built model."""
    return {(row.model, row.system, row.backend_version) for row in rows
            if feasibility(row)["beyond"]}
