"""The real executor: HF model code with a registered paged attention function, KV block pools,
a sampler, and an offline `LLM.generate()` API shaped like vLLM's.

    from engine import LLM, SamplingParams
    llm = LLM(model="tiny-llama", block_size=16, scheduler="continuous")
    outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0, max_tokens=8))
    outs[0].outputs[0].token_ids

Speculative decoding: LLM(..., speculative_model="ngram" or a draft model,
num_speculative_tokens=k, speculation="fixed" | "adaptive" | a dotted class path | a policy
object); engine/drafters.py proposes, engine/rejection_sampler.py verifies.

Prefill/decode disaggregation: DisaggregatedLLM(...) runs a prefill and a decode replica with
pools of their own, each request's KV copied between them (engine/disaggregated.py).
"""
from engine.builder import (build_engine, build_engine_executor, build_model_executor,
                            kv_cache_limit_gb)
from engine.config import EngineConfig
from engine.disaggregated import DisaggregatedLLM
from engine.executor import EngineExecutor
from engine.llm import LLM, CompletionOutput, GenerateStats, RequestOutput, StepOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "DisaggregatedLLM", "SamplingParams", "RequestOutput", "CompletionOutput",
           "GenerateStats", "StepOutput",
           "EngineConfig", "EngineExecutor", "build_engine", "build_engine_executor",
           "build_model_executor", "kv_cache_limit_gb"]
