"""The engine on a mixture of experts against HF transformers: the tiny random Mixtral
(conf/model/tiny-moe.yaml: 8 experts of 256, 2 routed per token; fp32, CPU, one thread) and tiny
Mixtral / Qwen3-MoE checkpoints loaded by path.

Greedy outputs must be token-identical to HF `generate` on the same model object (its sdpa
attention, HF's own expert routing) for ragged prompts run together, with chunked prefill and
under preemption. The routing is checked to spread over the experts, so that a wrong token order
or position reaching the router shows as a different token.
"""
from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.model_loader import (_load_named_checkpoint, load_model, random_config,
                                 spec_from_hf_config)
from runtime.specs import ModelSpec

from factories import model_spec, token_ids
from test_engine import GREEDY, MAX_TOKENS, PROMPT_LENS, hf_greedy, random_prompts


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(PROMPT_LENS, seed=5)


@pytest.fixture(scope="module")
def reference_llm():
    return LLM("tiny-moe", num_gpu_blocks=256, seed=0)


@pytest.fixture(scope="module")
def expected(reference_llm, prompts):
    """HF generate on the engine's own model object."""
    outputs = hf_greedy(reference_llm.model, prompts)
    assert len(set(map(tuple, outputs))) == len(outputs), "the tiny MoE ignores its context"
    return outputs


def routed_experts(model, prompts) -> list[torch.Tensor]:
    """Per layer, how many of the prompts' tokens the router sent to each expert."""
    counts = []

    def count(router, inputs, outputs):
        counts.append(torch.bincount(outputs[2].flatten(), minlength=router.num_experts))

    hooks = [layer.mlp.gate.register_forward_hook(count) for layer in model.model.layers]
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            for prompt in prompts:
                model(torch.tensor([prompt]))
    finally:
        model.set_attn_implementation("twinserve_paged")
        for hook in hooks:
            hook.remove()
    num_layers = len(model.model.layers)
    return [sum(counts[layer::num_layers]) for layer in range(num_layers)]


def test_tiny_moe_is_a_seeded_mixtral_with_spread_routing(reference_llm, prompts):
    from transformers import MixtralForCausalLM

    model = reference_llm.model
    spec = model_spec("tiny-moe")
    assert isinstance(model, MixtralForCausalLM)
    assert model.config.num_local_experts == spec.num_experts == 8
    assert model.config.num_experts_per_tok == spec.num_experts_per_tok == 2
    experts = model.model.layers[0].mlp.experts
    assert tuple(experts.down_proj.shape) == (8, spec.hidden_size, spec.moe_intermediate_size)
    assert reference_llm.spec.is_moe and reference_llm.spec.num_experts == 8
    # The simulator's memory arithmetic counts every expert and the routers: HF's parameters.
    assert sum(p.numel() for p in model.parameters()) * 4 == spec.weight_bytes
    # Every layer's router reaches every expert, none taking more than a third of the tokens:
    # an equivalence test through a router that sends everything to one expert is a dense one.
    for per_expert in routed_experts(model, prompts):
        assert per_expert.min() > 0
        assert per_expert.max() < per_expert.sum() / 3
    again = load_model("tiny-moe", torch.device("cpu"), seed=0).model
    assert torch.equal(again.model.layers[2].mlp.experts.gate_up_proj,
                       model.model.layers[2].mlp.experts.gate_up_proj)


def test_batched_greedy_matches_hf_generate(reference_llm, prompts, expected):
    assert token_ids(reference_llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert reference_llm.last_stats.num_steps <= MAX_TOKENS + 2  # the prompts ran together


def test_chunked_prefill_matches_hf_generate(prompts, expected):
    llm = LLM("tiny-moe", scheduler="chunked_prefill", max_num_batched_tokens=24,
              num_gpu_blocks=256)
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert llm.last_stats.num_steps > MAX_TOKENS + 4  # prompts took several steps


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preemption_keeps_outputs(preemption, prompts, expected):
    # 36 blocks of 4 slots: the longest request alone needs 29, all together 90.
    llm = LLM("tiny-moe", block_size=4, num_gpu_blocks=36, preemption=preemption,
              swap_space_gb=0.01)
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert llm.last_stats.num_preemptions > 0


def tiny_checkpoint(kind: str, path):
    """A 2-layer random mixture saved with save_pretrained: Mixtral or Qwen3-MoE."""
    from transformers import (MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    shape = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2,
                 eos_token_id=2, bos_token_id=1, pad_token_id=0)
    if kind == "mixtral":
        config = MixtralConfig(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                               **shape)
        model_class = MixtralForCausalLM
    else:
        config = Qwen3MoeConfig(intermediate_size=160, moe_intermediate_size=32, num_experts=6,
                                num_experts_per_tok=3, head_dim=16, **shape)
        model_class = Qwen3MoeForCausalLM
    torch.manual_seed(0)
    model_class(config).save_pretrained(path)
    return config


@pytest.mark.parametrize("kind, experts", [("mixtral", (4, 2, 48)), ("qwen3_moe", (6, 3, 32))])
def test_local_moe_checkpoint(kind, experts, tmp_path):
    """A Mixtral or Qwen3-MoE folder loads through from_pretrained with its experts in the spec,
    and the engine's greedy output equals HF's on it."""
    tiny_checkpoint(kind, tmp_path)
    llm = LLM(str(tmp_path), block_size=4, num_gpu_blocks=64)
    spec = llm.spec
    assert (spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size) == experts
    assert spec.shared_expert_intermediate_size == 0
    prompts = random_prompts([3, 9, 21], seed=2)
    prompts = [[token % 96 for token in prompt] for prompt in prompts]
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == hf_greedy(llm.model,
                                                                                 prompts)


def test_named_checkpoint_with_other_experts_is_refused(tmp_path):
    tiny_checkpoint("mixtral", tmp_path)
    spec = ModelSpec(name="tiny-mixtral", num_layers=2, hidden_size=64, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=48, vocab_size=96,
                     max_model_len=256, num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=48, checkpoint=str(tmp_path))
    with pytest.raises(ValueError, match="num_experts 8 vs 4"):
        _load_named_checkpoint(spec, torch.device("cpu"), torch.float32)


def test_hf_moe_configs_map_to_expert_fields():
    from transformers import LlamaConfig, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    mixtral = spec_from_hf_config(MixtralConfig(), "mixtral")
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size,
            mixtral.shared_expert_intermediate_size) == (8, 2, 14336, 0)
    assert mixtral.expert_parameters == model_spec("mixtral-8x7b").expert_parameters
    qwen3 = spec_from_hf_config(Qwen3MoeConfig(), "qwen3")
    assert (qwen3.num_experts, qwen3.num_experts_per_tok, qwen3.moe_intermediate_size) == (
        128, 8, 768)
    qwen2 = spec_from_hf_config(Qwen2MoeConfig(), "qwen2")
    assert (qwen2.num_experts, qwen2.shared_expert_intermediate_size) == (60, 5632)
    assert not spec_from_hf_config(LlamaConfig(), "llama").is_moe
    with pytest.raises(ValueError, match="decoder_sparse_step=2"):
        spec_from_hf_config(Qwen3MoeConfig(decoder_sparse_step=2), "qwen3-sparse")
    with pytest.raises(ValueError, match=r"mlp_only_layers=\[0\]"):
        spec_from_hf_config(Qwen3MoeConfig(mlp_only_layers=[0]), "qwen3-dense-first")


def test_random_mixture_with_shared_experts_is_refused():
    spec = ModelSpec(name="shared", num_layers=1, hidden_size=64, num_attention_heads=4,
                     intermediate_size=64, vocab_size=64, max_model_len=64, dtype_bytes=4,
                     num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                     shared_expert_intermediate_size=64)
    with pytest.raises(ValueError, match="shared_expert_intermediate_size=64"):
        random_config(spec)
