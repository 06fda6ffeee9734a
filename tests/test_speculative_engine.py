"""Speculative decoding on the engine: the rejection sampler, the drafters, and LLM(...,
speculative_model=...) end to end.

- The rejection sampler (pure torch) emits tokens distributed as the target's p at every
  position, for k = 1, 3, 5, with a draft distribution q or a deterministic (one-hot) proposal:
  chi-square against p over many vectorized trials; the same test rejects q itself.
- Greedy speculative output is token-identical to non-speculative output, for the n-gram drafter
  and a draft model, under preemption (recompute and swap), chunked prefill and prefix caching;
  no KV block is left allocated, and every running sequence holds exactly the blocks its tokens
  need after each step (rejected drafts' slots are given back).
- A draft model identical to the target (same seeded weights) has every greedy draft accepted:
  its own K/V keeps pace with the target's through catch-up, preemption and swaps.
- Sampled end to end: a random target and a different random draft over a vocabulary of 8; the
  marginal of each token produced by a speculating step matches the target's exact marginal.

The trained pair (models/tiny-pair, scripts/train_tiny_pair.py) runs the greedy tests: it is
small (3 and 1 layers of width 128, byte vocabulary) and its text continuations are
predictable, so drafts are often accepted and the bonus, correction and catch-up paths all run.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.drafters import ngram_lookup
from engine.rejection_sampler import rejection_sample, verify_greedy
from engine.sampler import Sampler

from factories import replay_on_sim_clock, token_ids

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from gpu_check_steps.ties import compare_run, reference_gaps  # noqa: E402
TARGET = str(REPO / "models" / "tiny-pair" / "target")
DRAFT = str(REPO / "models" / "tiny-pair" / "draft")


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit of `counts` to `probs` (cells with p > 0)."""
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    total = counts.sum()
    expected = probs[keep].double() * total
    statistic = ((counts[keep].double() - expected) ** 2 / expected).sum()
    degrees = keep.sum().item() - 1
    return torch.special.gammaincc(torch.tensor(degrees / 2, dtype=torch.float64),
                                   statistic / 2).item()


def emitted_by_position(draft_tokens, num_accepted, next_tokens, position):
    """The token each trial emitted at `position` (drafts accepted before it, then the next
    token), and which trials got that far."""
    reached = num_accepted >= position
    tokens = torch.where(num_accepted > position,
                         draft_tokens[:, min(position, draft_tokens.shape[1] - 1)], next_tokens)
    return tokens[reached]


# ---- the rejection sampler ------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("deterministic", [False, True], ids=["draft_probs", "one_hot"])
def test_rejection_sampling_follows_the_target_distribution(k, deterministic):
    vocab, trials = 6, 40_000
    gen = torch.Generator().manual_seed(k)
    # p and q differ a lot (q puts mass where p has none, p where q has none).
    target = torch.softmax(2 * torch.randn(k + 1, vocab, generator=gen), dim=-1)
    target[:, 0] = 0
    target /= target.sum(dim=-1, keepdim=True)
    draft = torch.softmax(2 * torch.randn(k, vocab, generator=gen), dim=-1)
    draft[:, 1] = 0
    draft /= draft.sum(dim=-1, keepdim=True)
    # Deterministic (n-gram): each trial's proposal is fixed by its context, q one-hot at it;
    # across trials they follow the skewed `draft` (uniform ones would hide a wrong residual).
    draft_tokens = torch.multinomial(draft, trials, replacement=True, generator=gen).T
    draft_probs = None if deterministic else draft.expand(trials, k, vocab)
    num_accepted, next_tokens = rejection_sample(
        target.expand(trials, k + 1, vocab), draft_tokens, draft_probs,
        torch.full((trials,), k), torch.rand(trials, k, generator=gen),
        torch.empty(trials, vocab).exponential_(generator=gen))
    assert 0 < num_accepted.float().mean() < k  # both accepts and rejections happen
    for position in range(k + 1):
        tokens = emitted_by_position(draft_tokens, num_accepted, next_tokens, position)
        counts = torch.bincount(tokens, minlength=vocab)
        assert chi_square_p_value(counts, target[position]) > 1e-3, position
        if position < k:
            # The test has power: the draft's own distribution fails it.
            drawn = torch.bincount(draft_tokens[:, position], minlength=vocab)
            assert chi_square_p_value(drawn, target[position].clamp(min=1e-3)) < 1e-6


def test_rejection_sampling_rows_with_fewer_drafts():
    """Padding past a row's own drafts is never examined: a row with 0 drafts samples from
    p at position 0; a row whose drafts all pass gets a bonus from the position after them."""
    vocab = 4
    target = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    draft_tokens = torch.tensor([[1, 2], [1, 0], [3, 3]])
    num_accepted, next_tokens = rejection_sample(
        target.expand(3, 3, vocab), draft_tokens, None, torch.tensor([1, 2, 0]),
        torch.full((3, 2), 0.5), torch.ones(3, vocab))
    # row 0: draft 1 passes (p=1), bonus from position 1 -> 2; row 1: 1 passes, 0 is rejected
    # (p(0) = 0) -> 2; row 2: no drafts -> 1.
    assert num_accepted.tolist() == [1, 1, 0]
    assert next_tokens.tolist() == [2, 2, 1]


def test_verify_greedy_matches_argmax():
    target_argmax = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    draft_tokens = torch.tensor([[5, 6, 7], [5, 9, 7], [1, 6, 7], [5, 6, 0]])
    num_accepted, next_tokens = verify_greedy(target_argmax, draft_tokens,
                                              torch.tensor([3, 3, 3, 2]))
    assert num_accepted.tolist() == [3, 1, 0, 2]
    assert next_tokens.tolist() == [8, 6, 5, 7]


def test_sampler_draws_are_per_row_reproducible():
    sampler = Sampler(torch.device("cpu"), seed=0)
    weights = torch.tensor([[1.0, 2.0, 3.0, 4.0]] * 3)
    first = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    again = [torch.Generator().manual_seed(s) for s in (3, 1)]
    tokens = sampler.draw(weights, first)
    assert sampler.draw(weights[:2], again).tolist() == [tokens[2].item(), tokens[0].item()]


# ---- the n-gram drafter ---------------------------------------------------------------------

@pytest.mark.parametrize("tokens, k, expected", [
    ([1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3], 3, [4, 5, 1]),  # longest n-gram, latest occurrence
    ([1, 2, 3, 9, 1, 2, 3], 5, [9, 1, 2, 3]),               # fewer than k follow the match
    ([1, 2, 8, 9, 4, 1, 2, 1, 2], 3, [1, 2]),               # the latest, even if short
    ([7, 1, 8, 2, 3, 1], 2, [8, 2]),                        # only a 1-gram recurs
    ([1, 2, 3, 4], 3, []),                                  # nothing recurs
    ([4], 3, []),
])
def test_ngram_lookup(tokens, k, expected):
    assert ngram_lookup(np.array(tokens), k, min_n=1, max_n=3) == expected


def test_ngram_lookup_respects_min_n():
    assert ngram_lookup(np.array([7, 1, 8, 2, 3, 1]), 2, min_n=2, max_n=3) == []


# ---- end to end: greedy -----------------------------------------------------------------------

MAX_TOKENS = 40
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def text_prompts() -> list[list[int]]:
    """Byte prompts cut from a Python source (what the pair was trained on), ragged lengths."""
    import textwrap

    source = Path(textwrap.__file__).read_bytes()
    starts = [0, 3000, 6000, 9000, 12000, 15000]
    return [list(source[start:start + length])
            for start, length in zip(starts, [1, 17, 40, 90, 150, 230])]


@pytest.fixture(scope="module")
def prompts():
    return text_prompts()


@pytest.fixture(scope="module")
def expected(prompts):
    """The target alone (non-speculative engine; tests/test_engine.py checks that path against
    HF generate)."""
    return token_ids(LLM(TARGET, num_gpu_blocks=256).generate(prompts, GREEDY, use_tqdm=False))


def check_blocks_after_each_step(llm):
    """Wrap the scheduler's update: after every step each running sequence with outputs holds
    no block past its tokens (rejected drafts' slots were given back)."""
    scheduler = llm.scheduler
    kv_cache = scheduler.kv_cache
    update = scheduler.update

    def checked_update(plan, result, now):
        finished = update(plan, result, now)
        for request in scheduler.running:
            for seq in request.unfinished_sequences():
                table = kv_cache.block_tables.get(seq.seq_id)
                if table is not None and seq.num_output_tokens:
                    assert len(table) <= -(-seq.num_tokens // kv_cache.block_size), seq
        return finished

    scheduler.update = checked_update


@pytest.fixture(scope="module")
def target_fp32(prompts):
    """The target alone in fp32 on every device, with its top-2 logit gaps: a checkpoint loads
    in bf16 on CUDA, where a verification pass rounds differently from one-token decodes and
    the two part at near ties (the first GPU's swap-5-draft_model failure, at a near tie)."""
    llm = LLM(TARGET, num_gpu_blocks=256, dtype="float32")
    outputs = token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    return (outputs, *reference_gaps(llm.model, prompts, outputs))


SCENARIOS = {
    "continuous": dict(num_gpu_blocks=256),
    "block_size_1": dict(block_size=1, num_gpu_blocks=4096),
    "chunked_prefill": dict(scheduler="chunked_prefill", max_num_batched_tokens=24,
                            num_gpu_blocks=256),
    # 80 blocks of 4: the longest request alone needs 68 (+ 2 for drafts), all together 192.
    "recompute": dict(block_size=4, num_gpu_blocks=80),
    "swap": dict(block_size=4, num_gpu_blocks=80, preemption="swap", swap_space_gb=0.01),
}


@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
@pytest.mark.parametrize("scenario, k", [("continuous", 1), ("continuous", 3),
                                         ("continuous", 5), ("block_size_1", 4),
                                         ("chunked_prefill", 3), ("recompute", 3), ("swap", 5)])
def test_greedy_speculative_output_is_the_targets(drafter, scenario, k, prompts, target_fp32):
    """Token by token the target's, but where its top two logits lie within fp32's rounding
    (bench/gpu_check_steps/ties.py; on the CPU: identical)."""
    llm = LLM(TARGET, speculative_model="ngram" if drafter == "ngram" else DRAFT,
              num_speculative_tokens=k, dtype="float32", **SCENARIOS[scenario])
    check_blocks_after_each_step(llm)
    comparison = compare_run(token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)),
                             *target_fp32, "float32")
    assert comparison.ok, comparison.summary()
    stats = llm.executor.acceptance_stats
    assert len(stats.position_trials) == k
    assert 0 < stats.position_accepts[0] < stats.position_trials[0]  # accepts and rejections
    assert llm.last_stats.num_accepted_tokens == sum(stats.position_accepts)
    assert llm.last_stats.num_steps < len(prompts) * MAX_TOKENS
    kv_cache = llm.scheduler.kv_cache
    assert kv_cache.num_free_blocks() == kv_cache.num_blocks  # no block leaked
    if scenario in ("recompute", "swap"):
        assert llm.last_stats.num_preemptions > 0
    if scenario == "swap":
        assert llm.last_stats.num_swapped_out_blocks > 0


def test_adaptive_speculation_and_prefix_caching(prompts, expected):
    shared = prompts[-1][:64]
    cached_prompts = [shared + prompt for prompt in prompts[1:4]]
    reference = token_ids(LLM(TARGET, num_gpu_blocks=256).generate(cached_prompts, GREEDY,
                                                                   use_tqdm=False))
    llm = LLM(TARGET, speculative_model=DRAFT, num_speculative_tokens=4,
              speculation="adaptive", enable_prefix_caching=True, num_gpu_blocks=256)
    first = llm.generate(cached_prompts[:1], GREEDY, use_tqdm=False)
    rest = llm.generate(cached_prompts[1:], GREEDY, use_tqdm=False)
    assert [out.num_cached_tokens for out in rest] == [64, 64]
    assert token_ids(first + rest) == reference
    assert sum(llm.executor.acceptance_stats.position_accepts) > 0


@pytest.mark.parametrize("scenario", ["continuous", "chunked_prefill", "recompute", "swap"])
def test_draft_identical_to_target_is_always_accepted(scenario):
    """Same seeded random weights for draft and target: every greedy draft must pass, which
    holds only if the draft's K/V is right (catch-up after a bonus token, preemption by
    recompute, swapped draft layers)."""
    prompts = [torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (5, 17, 33, 64)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reference = token_ids(LLM("tiny-llama", num_gpu_blocks=256).generate(prompts, params,
                                                                        use_tqdm=False))
    settings = dict(SCENARIOS[scenario])
    if scenario in ("recompute", "swap"):
        settings["num_gpu_blocks"] = 26  # the longest needs 22 (+ 1 for drafts), all 54
    llm = LLM("tiny-llama", speculative_model="tiny-llama", num_speculative_tokens=3,
              **settings)
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == reference
    stats = llm.executor.acceptance_stats
    assert stats.position_trials[0] > 0 and stats.position_accepts == stats.position_trials
    if scenario in ("recompute", "swap"):
        assert llm.last_stats.num_preemptions > 0
    if scenario == "swap":
        assert llm.last_stats.num_swapped_out_blocks > 0


@pytest.mark.parametrize("drafter", ["ngram", DRAFT])
def test_stops_at_eos_inside_accepted_drafts(drafter, prompts, expected):
    """With a token of the greedy output declared EOS, generation stops right after it, even
    when it comes among several tokens gained in one step."""
    llm = LLM(TARGET, speculative_model=drafter, num_speculative_tokens=5, num_gpu_blocks=256)
    output = expected[5]
    eos = next(token for i, token in enumerate(output) if i >= 10 and token not in output[:i])
    llm.executor.eos_token_id = eos
    out = llm.generate(prompts[5], SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == output[:output.index(eos) + 1]
    assert out.outputs[0].finish_reason == "stop"
    kv_cache = llm.scheduler.kv_cache
    assert kv_cache.num_free_blocks() == kv_cache.num_blocks


# ---- end to end: sampling -------------------------------------------------------------------

SMALL_VOCAB = 8


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    """A random target and a different random draft over 8 tokens, saved as checkpoints."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("small_vocab_pair")
    config = LlamaConfig(vocab_size=SMALL_VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=64, initializer_range=0.3, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None)
    for seed, role in ((0, "target"), (1, "draft")):
        torch.manual_seed(seed)
        LlamaForCausalLM(config).save_pretrained(folder / role)
    return str(folder / "target"), str(folder / "draft")


def exact_marginals(model, prompt: list[int], num_tokens: int, temperature: float):
    """P(token j = v) for j < num_tokens under the model sampling at `temperature`, by
    enumerating every continuation."""
    from engine.attention import PAGED_ATTENTION

    prefixes = torch.cartesian_prod(*[torch.arange(SMALL_VOCAB)] * (num_tokens - 1))
    inputs = torch.cat([torch.tensor(prompt).expand(len(prefixes), -1), prefixes], dim=1)
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            device = next(model.parameters()).device   # the engine's: cuda where there is one
            logits = model(inputs.to(device)).logits[:, len(prompt) - 1:].double().cpu()
    finally:
        model.set_attn_implementation(PAGED_ATTENTION)
    conditionals = torch.softmax(logits / temperature, dim=-1)  # [prefixes, num_tokens, vocab]
    marginals = []
    prefix_probs = torch.ones(len(prefixes), dtype=torch.float64)
    for j in range(num_tokens):
        marginals.append((prefix_probs[:, None] * conditionals[:, j]).sum(0)
                         / SMALL_VOCAB ** (num_tokens - 1 - j))
        if j < num_tokens - 1:
            prefix_probs = prefix_probs * conditionals[:, j].gather(1, prefixes[:, j:j + 1])[:, 0]
    return marginals


@pytest.mark.parametrize("k", [1, 3, 5])
def test_sampled_speculative_output_follows_the_target(k, small_vocab_pair):
    """The first speculating step (after the prompt's token) can use all k drafts; the
    marginals of the first five tokens are checked (enumerating 8^4 continuations)."""
    target, draft = small_vocab_pair
    prompt, trials, temperature, max_tokens = [1, 5, 2], 3000, 0.8, k + 2
    llm = LLM(target, speculative_model=draft, num_speculative_tokens=k, block_size=4,
              num_gpu_blocks=2048, max_num_seqs=256)
    outputs = token_ids(llm.generate(
        [prompt] * trials, [SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                           seed=seed, ignore_eos=True)
                            for seed in range(trials)], use_tqdm=False))
    stats = llm.executor.acceptance_stats
    assert 0 < sum(stats.position_accepts) < sum(stats.position_trials)
    assert stats.position_trials[k - 1] > 0  # every position was examined
    tokens = torch.tensor(outputs)
    for position, marginal in enumerate(exact_marginals(llm.model, prompt, min(max_tokens, 5),
                                                        temperature)):
        counts = torch.bincount(tokens[:, position], minlength=SMALL_VOCAB)
        assert chi_square_p_value(counts, marginal) > 1e-3, position
    # Seeded requests are reproducible, whatever else shares their batches.
    again = token_ids(llm.generate([prompt] * 3, [SamplingParams(
        temperature=temperature, max_tokens=max_tokens, seed=seed, ignore_eos=True)
        for seed in (7, 0, 2999)], use_tqdm=False))
    assert again == [outputs[7], outputs[0], outputs[2999]]


# ---- configuration --------------------------------------------------------------------------

def test_bad_speculation_settings_are_named(small_vocab_pair):
    target, draft = small_vocab_pair
    with pytest.raises(ValueError, match="vocabulary of 8 tokens, the target 512"):
        LLM("tiny-llama", speculative_model=draft, num_speculative_tokens=2)
    with pytest.raises(ValueError, match="num_speculative_tokens=3 needs a speculative_model"):
        LLM(target, num_speculative_tokens=3)
    with pytest.raises(ValueError, match="num_speculative_tokens must be a positive integer"):
        LLM(target, speculative_model="ngram")
    with pytest.raises(ValueError, match="speculation must be one of adaptive, fixed, none"):
        LLM(target, speculative_model="ngram", num_speculative_tokens=2, speculation="greedy")
    with pytest.raises(ValueError, match="neither a local checkpoint folder"):
        LLM(target, speculative_model="no-such-model", num_speculative_tokens=2)


def test_draft_kv_layers_share_the_block_budget():
    """The pool holds the draft's K/V layers in every block: fewer blocks fit the same memory,
    and swaps and copies move both models' layers."""
    from engine.kv_cache import KVCachePool
    from kernels import get_kernel_ops
    from engine.model_loader import load_model
    from runtime.specs import HardwareSpec
    from runtime.kv_sizing import kv_cache_num_blocks

    device = torch.device("cpu")
    target = load_model("tiny-llama", device).spec
    draft = load_model(DRAFT, device).spec
    hardware = HardwareSpec(name="small", memory_gb=1, peak_tflops=1, memory_bandwidth_gbps=1,
                            host_to_device_gbps=1, interconnect_gbps=1)
    sizing = dict(block_size=16, max_num_seqs=4096, max_model_len=2048,
                  max_num_batched_tokens=2048, gpu_memory_utilization=0.9, kv_cache_limit_gb=64)
    alone = kv_cache_num_blocks(target, hardware, **sizing)
    with_draft = kv_cache_num_blocks(target, hardware, draft=draft, **sizing)
    target_bytes = target.kv_bytes_per_block(16)
    block_bytes = target_bytes + draft.kv_bytes_per_block(16)
    # The draft's weights and blocks fit where the target's blocks alone did, one more does not.
    assert with_draft * block_bytes + draft.weight_bytes <= (alone + 1) * target_bytes
    assert (with_draft + 1) * block_bytes + draft.weight_bytes > alone * target_bytes

    pool = KVCachePool(target, 8, 4, 16, torch.float32, device, get_kernel_ops(device),
                       draft_spec=draft)
    assert len(pool.device_caches) == target.num_layers + draft.num_layers
    assert pool.draft_caches[0].shape[3:] == (draft.num_key_value_heads, draft.head_dim)
    draft_layer = pool.draft_caches[-1]
    draft_layer[:, 3].normal_()
    pool.copy([(3, 5)])
    pool.swap_out([(5, 1)])
    pool.swap_in([(1, 6)])
    assert torch.equal(draft_layer[:, 6], draft_layer[:, 3])


def test_engine_executor_speculates_under_the_simulator_clock(prompts, expected):
    """backend=engine: a simulator replica whose scheduler speculates drives the engine
    executor built by build_engine_executor; replayed requests (greedy) get the target's tokens."""
    from engine import build_engine_executor
    from policies.batching import ChunkedPrefillScheduler
    from policies.memory import PagedBlockManager
    from policies.preemption import RecomputePreemption
    from policies.speculation import FixedSpeculation

    kv_cache = PagedBlockManager(num_blocks=64, block_size=8)
    scheduler = ChunkedPrefillScheduler(kv_cache, RecomputePreemption(), max_num_seqs=8,
                                        max_num_batched_tokens=64, max_model_len=2048,
                                        speculation=FixedSpeculation(3))
    executor = build_engine_executor(TARGET, kv_cache, speculative_model=DRAFT,
                                     max_num_speculative_tokens=3)
    requests, _ = replay_on_sim_clock(scheduler, executor, prompts, MAX_TOKENS)
    assert [request.sequences[0].output_token_ids for request in requests] == expected
    stats = executor.acceptance_stats
    assert sum(stats.position_accepts) > 0
    # Steps right after a rejection are a part of all steps, position by position.
    assert 0 < stats.fresh_position_trials[0] < stats.position_trials[0]
    assert all(f <= t for f, t in zip(stats.fresh_position_trials, stats.position_trials))
    assert kv_cache.num_free_blocks() == kv_cache.num_blocks


def test_parallel_samples_speculate_like_separately_seeded_requests(prompts):
    """n = 3 samples sharing the prompt's blocks (copy-on-write of the last one, draft layers
    included) equal three requests seeded seed..seed+2: every draw of a sample, its drafts'
    included, comes from its own generator."""
    llm = LLM(TARGET, speculative_model=DRAFT, num_speculative_tokens=3, num_gpu_blocks=256)
    common = dict(temperature=0.9, top_k=20, top_p=0.95, max_tokens=24, ignore_eos=True)
    outputs = llm.generate([prompts[3], prompts[2]], [SamplingParams(n=3, seed=11, **common),
                                                      GREEDY], use_tqdm=False)
    assert llm.last_stats.num_copied_blocks > 0
    samples = [completion.token_ids for completion in outputs[0].outputs]
    assert len(set(map(tuple, samples))) == 3
    separate = llm.generate([prompts[3]] * 3, [SamplingParams(seed=11 + j, **common)
                                               for j in range(3)], use_tqdm=False)
    assert samples == token_ids(separate)


def test_conf_model_with_a_checkpoint_loads_its_weights():
    """model=tiny-pair (conf/model/tiny-pair.yaml, `checkpoint:`) is the trained target; a conf
    whose shape differs from its checkpoint, or whose folder is missing, is a named error."""
    import dataclasses

    from engine.model_loader import _load_named_checkpoint, load_model

    device = torch.device("cpu")
    named, folder = load_model("tiny-pair", device), load_model(TARGET, device)
    assert named.spec.name == "tiny-pair"
    for (name, a), (_, b) in zip(named.model.state_dict().items(),
                                 folder.model.state_dict().items()):
        assert torch.equal(a, b), name
    wrong = dataclasses.replace(named.spec, num_layers=2, checkpoint="models/tiny-pair/target")
    with pytest.raises(ValueError, match="differ: num_layers 2 vs 3"):
        _load_named_checkpoint(wrong, device, None)
    missing = dataclasses.replace(wrong, checkpoint="models/no-such-model")
    with pytest.raises(ValueError, match="checkpoint folder .*no-such-model does not exist"):
        _load_named_checkpoint(missing, device, None)


def test_draft_model_runs_its_lagging_token_again():
    """A sequence whose draft model lags the target (Sequence.draft_lag, left by a step that
    accepted all its drafts) starts the draft's pass one token earlier: the extra token the
    step features count as draft_catch_up_tokens."""
    from engine.model_loader import load_model
    from calibration.profiler.cli import executor_factory
    from runtime.step_shapes import GridPoint, build_plan
    from sim.cost.profiled.step_features import STEP_FEATURES, step_features

    device = torch.device("cpu")
    factory = executor_factory(load_model(TARGET, device), device,
                               speculative_model=DRAFT, max_num_speculative_tokens=2)
    point = GridPoint(0, "spec_decode", 16, decodes=(40, 40, 40), spec_len=2, num_lagging=2)
    plan = build_plan(point)
    assert [seq.draft_lag for seq in plan.seqs] == [1, 1, 0]
    assert dict(zip(STEP_FEATURES, step_features(plan)))["draft_catch_up_tokens"] == 2
    executor = factory(16, point.num_blocks_needed(), 0)
    runner = executor.drafter.runner
    passes = []
    build = runner.build
    runner.build = lambda token_ids, starts, query_lens, *rest: (
        passes.append((starts.tolist(), query_lens.tolist()))
        or build(token_ids, starts, query_lens, *rest))
    executor.execute(plan)
    computed = [seq.num_computed_tokens for seq in plan.seqs]
    assert passes[0] == ([computed[0] - 1, computed[1] - 1, computed[2]], [2, 2, 1])
    assert [query_lens for _, query_lens in passes[1:]] == [[1, 1, 1]]  # draft 2 of 2
