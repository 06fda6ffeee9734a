"""The real executor: HF model code over paged KV block pools, with an offline `LLM.generate()`
shaped like vLLM's.

    from engine import LLM, SamplingParams
    llm = LLM(model="tiny-llama", block_size=16, scheduler="continuous")
    outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0, max_tokens=8))
    outs[0].outputs[0].token_ids
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
