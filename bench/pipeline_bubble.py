"""Pipeline parallelism's bubble and overlap in the simulator (sim/core/pipeline.py), Llama-2-7B on
A100-80GBs, both cost models: one step's time at pp stages against one stage (a lone decode, a
lone 2,048-token prompt, eight 1,024-token prompts, 8 and 256 decodes at 512 tokens of context),
and whole runs with each run's KV blocks: a light load (one request at a time) and a heavy
compute-bound one at the same KV pool (so that only the micro-batches differ), at the default
token budget and at pp times it.

    python bench/pipeline_bubble.py [--stages 1 2 4]
"""
from __future__ import annotations

import argparse

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from policies.types import StepPlan
from sim.core.build import CONF_DIR, build_cost_model
from sim.core.experiment import run_experiment
from sim.core.specs import HardwareSpec, ModelSpec

LIGHT = ("workload.num_requests=20", "workload.rate=0.2")
HEAVY = ("workload.num_requests=200", "workload.rate=1000", "kv_cache.num_blocks=4000",
         "workload.prompt_len.mean=1800", "workload.prompt_len.min=1500",
         "workload.output_len.mean=3", "workload.output_len.min=2", "workload.output_len.max=4")


def _cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose("config", overrides=["progress=false", *overrides])


def _plans() -> dict[str, StepPlan]:
    def prefills(n: int, chunk: int) -> StepPlan:
        return StepPlan(num_prefill_seqs=n, num_prefill_tokens=n * chunk,
                        prefill_attention_work=n * chunk * chunk, prefill_context_tokens=n * chunk,
                        sum_squared_prefill_chunks=n * chunk * chunk)

    def decodes(n: int) -> StepPlan:
        return StepPlan(num_decode_seqs=n, decode_context_tokens=n * 512)
    return {"1 decode": decodes(1), "1 prompt of 2048": prefills(1, 2048),
            "8 prompts of 1024": prefills(8, 1024), "8 decodes": decodes(8),
            "256 decodes": decodes(256)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    model = ModelSpec.from_config(OmegaConf.load(CONF_DIR / "model" / "llama-2-7b.yaml"))
    hardware = HardwareSpec.from_config(OmegaConf.load(CONF_DIR / "hardware" / "a100-80gb.yaml"))
    for cost_model in ("roofline", "gpu"):
        print(f"cost_model={cost_model}: step time at pp stages / at one stage")
        base = build_cost_model(_cfg(f"cost_model={cost_model}"), model, hardware)
        print(f"  {'plan':<20}" + "".join(f"{f'pp={pp}':>10}" for pp in args.stages))
        models = {pp: build_cost_model(_cfg(f"cost_model={cost_model}",
                                            f"cluster.pipeline_parallel_size={pp}"),
                                       model, hardware) for pp in args.stages}
        for name, plan in _plans().items():
            print(f"  {name:<20}" + "".join(
                f"{models[pp].step_time(plan) / base.step_time(plan):>10.3f}"
                for pp in args.stages))
        print(f"  {'run':<20}{'pp':>4}{'KV blocks':>11}{'req/s':>9}{'tok/s':>9}"
              f"{'TPOT ms':>9}{'TTFT ms':>10}")
        for label, load in (("light", LIGHT), ("heavy, same pool", HEAVY),
                            ("heavy, budget x pp", HEAVY)):
            for pp in args.stages:
                # The step's token budget bounds all its micro-batches together: x pp gives each
                # micro-batch the default 4,096 tokens (vLLM V1's per-batch budget).
                budget = ([f"scheduler.max_num_batched_tokens={4096 * pp}"]
                          if label.endswith("x pp") else [])
                cfg = _cfg(f"cost_model={cost_model}", f"cluster.pipeline_parallel_size={pp}",
                           *load, *budget)
                result = run_experiment(cfg, plots=False)
                summary = result.summary
                print(f"  {label:<20}{pp:>4}{result.num_kv_blocks:>11}"
                      f"{summary['request_throughput']:>9.3f}{summary['output_throughput']:>9.1f}"
                      f"{summary['mean_tpot_ms']:>9.2f}{summary['mean_ttft_ms']:>10.1f}")


if __name__ == "__main__":
    main()
