"""Sanity step times of the GPU cost model (sim/cost/gpu/) on a few (model, GPU, tensor-parallel)
combinations, with where each term came from. Checks, not fits: nothing here tunes the model.

    python bench/gpu_step_times.py
"""
from __future__ import annotations

from omegaconf import OmegaConf

from policies.types import StepPlan
from runtime.policy_config import CONF_DIR
from sim.cost.gpu.cost_model import GPUCostModel


def decode(batch: int, context: int) -> StepPlan:
    return StepPlan(num_decode_seqs=batch, decode_context_tokens=batch * context)


def prefill(chunk: int) -> StepPlan:
    return StepPlan(num_prefill_tokens=chunk, num_prefill_seqs=1, prefill_attention_work=chunk ** 2,
                    prefill_context_tokens=chunk, sum_squared_prefill_chunks=chunk ** 2)


CASES = [("llama-3-8b", "a100-80gb", 1, f"decode batch {b}, context 500", decode(b, 500))
         for b in (1, 32, 128)] + [
    ("llama-3-8b", "a100-80gb", 1, "prefill chunk 2048", prefill(2048)),
    ("llama-2-70b", "h100-80gb", 4, "decode batch 64, context 500", decode(64, 500)),
    ("llama-3.1-8b", "rtx-4090", 1, "decode batch 32, context 1000", decode(32, 1000)),
    ("llama-3.1-8b", "rtx-pro-6000", 1, "decode batch 32, context 1000", decode(32, 1000)),
    ("llama-3.1-8b", "rtx-pro-6000", 1, "decode batch 128, context 1000", decode(128, 1000)),
]


def main() -> None:
    for model, hardware, tp, label, plan in CASES:
        cost = GPUCostModel(OmegaConf.load(CONF_DIR / "model" / f"{model}.yaml"),
                            OmegaConf.load(CONF_DIR / "hardware" / f"{hardware}.yaml"), tp)
        stated = cost.expected_error_pct
        print(f"{model} on {hardware} tp{tp}, {label}: {1e3 * cost.step_time(plan):.2f} ms "
              f"({cost.kernel_source}; a run's expected TPOT error "
              + (f"±{stated['tpot']:.0f} %)" if stated else "not stated)"))
        print(f"    linear: {cost.describe()['linear']}")
        print(f"    attention: {cost.describe()['attention']}")


if __name__ == "__main__":
    main()
