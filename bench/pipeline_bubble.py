"""Pipeline parallelism's bubble and overlap in the simulator (sim/cost/pipeline.py,
sim/core/pipelined_replica.py), Llama-2-7B on A100-80GBs, both cost models. Per step (a lone
decode, a lone 2,048-token prompt, eight 1,024-token prompts, 8 and 256 decodes at 512 tokens of
context), against the step at one stage: its latency through idle stages (the bubble: a lone
batch gains nothing) and its slowest stage (the time per step once pp busy virtual engines keep
that stage working: 1/pp at best). Whole runs with each run's KV blocks: a light load (one
request at a time), a heavy compute-bound one at the same KV pool (so that only the stages
differ) and a busy decode-heavy one, with each stage's busy share of the run (the rest is the
bubble: steps of unequal size, engines without work).

    python bench/pipeline_bubble.py [--stages 1 2 4]
"""
from __future__ import annotations

import argparse

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from policies.types import StepPlan
from sim.cost.build import build_cost_model
from runtime.policy_config import CONF_DIR
from sim.core.experiment import run_experiment
from sim.core.settings import replica_settings
from runtime.specs import HardwareSpec, ModelSpec

LIGHT = ("workload.num_requests=20", "workload.rate=0.2")
HEAVY = ("workload.num_requests=200", "workload.rate=1000", "kv_cache.num_blocks=4000",
         "workload.prompt_len.mean=1800", "workload.prompt_len.min=1500",
         "workload.output_len.mean=3", "workload.output_len.min=2", "workload.output_len.max=4")
DECODES = ("workload.num_requests=400", "workload.rate=20", "kv_cache.num_blocks=4000",
           "++workload.prompt_len={dist: fixed, value: 512}",
           "++workload.output_len={dist: fixed, value: 256}")


def _cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose("config", overrides=["progress=false", *overrides])


def _cost_model(model: ModelSpec, hardware: HardwareSpec, *overrides: str):
    cfg = _cfg(*overrides)
    return build_cost_model(cfg.cost_model, replica_settings(cfg, model), model, hardware)


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
    stages = [pp for pp in args.stages if pp > 1]
    model = ModelSpec.from_config(OmegaConf.load(CONF_DIR / "model" / "llama-2-7b.yaml"))
    hardware = HardwareSpec.from_config(OmegaConf.load(CONF_DIR / "hardware" / "a100-80gb.yaml"))
    for cost_model in ("roofline", "gpu"):
        print(f"cost_model={cost_model}: at pp stages / the step at one stage")
        base = _cost_model(model, hardware, f"cost_model={cost_model}")
        print(f"  {'plan':<20}" + "".join(f"{f'latency pp={pp}':>16}" for pp in stages)
              + "".join(f"{f'slowest pp={pp}':>16}" for pp in stages))
        models = {pp: _cost_model(model, hardware, f"cost_model={cost_model}",
                                  f"cluster.pipeline_parallel_size={pp}") for pp in stages}
        for name, plan in _plans().items():
            step_s = base.step_time(plan)
            times = {pp: models[pp].stage_times(plan) for pp in stages}
            print(f"  {name:<20}"
                  + "".join(f"{sum(times[pp]) / step_s:>16.3f}" for pp in stages)
                  + "".join(f"{max(times[pp]) / step_s:>16.3f}" for pp in stages))
        print(f"  {'run':<18}{'pp':>4}{'KV blocks':>11}{'req/s':>9}{'tok/s':>9}"
              f"{'TPOT ms':>9}{'TTFT ms':>10}  stages busy")
        for label, load in (("light", LIGHT), ("heavy, same pool", HEAVY),
                            ("decodes, same pool", DECODES)):
            for pp in args.stages:
                cfg = _cfg(f"cost_model={cost_model}", f"cluster.pipeline_parallel_size={pp}",
                           *load)
                result = run_experiment(cfg, plots=False)
                summary = result.summary
                meter = result.replicas[0].recorder.energy
                busy = ([stage.busy_s for stage in meter.stages] if pp > 1
                        else [meter.busy_s])
                shares = " ".join(f"{b / summary['duration_s']:.0%}" for b in busy)
                print(f"  {label:<18}{pp:>4}{result.num_kv_blocks:>11}"
                      f"{summary['request_throughput']:>9.3f}{summary['output_throughput']:>9.1f}"
                      f"{summary['mean_tpot_ms']:>9.2f}{summary['mean_ttft_ms']:>10.1f}  {shares}")


if __name__ == "__main__":
    main()
