"""The engine against HF transformers, on the tiny random Llama (fp32, CPU, one thread).

Greedy outputs must be token-identical to HF `generate` (plain, unpaged, the model's sdpa
attention) for ragged prompts, under every scheduler, block size, preemption mode, with chunked
prefill and with prefix caching; n = 4 samples sharing blocks must equal 4 requests seeded
seed..seed+3; bad requests fail alone. The tiny model is random with wide weights
(initializer_range 0.1), so greedy continuations differ from prompt to prompt and a wrong
position, slot or mask shows as a different token.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

try:
    import engine  # noqa: F401
except ImportError:  # until pyproject.toml packages engine/ and kernels/ (editable install)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import LLM, SamplingParams
from engine.attention import PAGED_ATTENTION
from kernels import get_kernel_ops, torch_paged
from policies.protocols import Executor

from factories import replay_on_sim_clock, token_ids
from triton_interpreter import ran_in_fresh_process

MAX_TOKENS = 16
# Lengths around the block sizes tested (1, 16, 32): a one-token prompt, full blocks, one past.
PROMPT_LENS = [1, 7, 16, 17, 33, 64, 100]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def random_prompts(lens, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lens]


def hf_greedy(model, prompts, max_tokens=MAX_TOKENS):
    """HF generate, one unpadded prompt at a time, with the model's default sdpa attention."""
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            return [model.generate(torch.tensor([p]), max_new_tokens=max_tokens,
                                   min_new_tokens=max_tokens, do_sample=False,
                                   pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    finally:
        model.set_attn_implementation(PAGED_ATTENTION)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(PROMPT_LENS, seed=1)


@pytest.fixture(scope="module")
def reference_llm():
    return LLM("tiny-llama", num_gpu_blocks=256, seed=0)


@pytest.fixture(scope="module")
def expected(reference_llm, prompts):
    """HF generate on the engine's own model object."""
    outputs = hf_greedy(reference_llm.model, prompts)
    assert len(set(map(tuple, outputs))) == len(outputs), "the tiny model ignores its context"
    return outputs


def test_reference_llm_matches_hf_generate(reference_llm, prompts, expected):
    assert token_ids(reference_llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert isinstance(reference_llm.executor, Executor)


@pytest.mark.parametrize("name, kwargs", [
    ("static", dict(scheduler="static", num_gpu_blocks=256)),
    ("continuous", dict(scheduler="continuous", num_gpu_blocks=256)),
    ("chunked_prefill", dict(scheduler="chunked_prefill", max_num_batched_tokens=24,
                             num_gpu_blocks=256)),
    ("block_size_1", dict(block_size=1, num_gpu_blocks=2048)),
    ("block_size_32", dict(block_size=32, num_gpu_blocks=64)),
    ("default_pool_size", dict()),
])
def test_greedy_matches_hf_generate(name, kwargs, reference_llm, prompts, expected):
    llm = LLM("tiny-llama", **kwargs)
    # Seeded random weights: the same model as the reference's, which HF ran.
    assert torch.equal(llm.model.lm_head.weight, reference_llm.model.lm_head.weight)
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    if name == "chunked_prefill":
        assert llm.last_stats.num_steps > MAX_TOKENS + 4  # prompts took several steps


@pytest.mark.parametrize("scheduler, preemption", [("continuous", "recompute"),
                                                   ("continuous", "swap"),
                                                   ("chunked_prefill", "recompute"),
                                                   ("chunked_prefill", "swap")])
def test_preemption_keeps_outputs(scheduler, preemption, prompts, expected):
    # 36 blocks of 4 slots: the longest request alone needs 29, all together 90.
    llm = LLM("tiny-llama", block_size=4, num_gpu_blocks=36, scheduler=scheduler,
              max_num_batched_tokens=32 if scheduler == "chunked_prefill" else None,
              preemption=preemption, swap_space_gb=0.01)
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    stats = llm.last_stats
    assert stats.num_preemptions > 0
    if preemption == "swap":
        assert stats.num_swapped_out_blocks > 0 and stats.num_swapped_in_blocks > 0
    else:
        assert stats.num_computed_tokens > sum(map(len, prompts)) + len(prompts) * MAX_TOKENS


def test_prefix_caching_skips_cached_tokens(reference_llm):
    shared = random_prompts([48], seed=3)[0]
    prompts = [shared + tail for tail in random_prompts([5, 9, 20], seed=4)]
    expected = hf_greedy(reference_llm.model, prompts)
    llm = LLM("tiny-llama", num_gpu_blocks=256, enable_prefix_caching=True)
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    assert first[0].num_cached_tokens == 0
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert token_ids(first + rest) == expected
    assert [out.num_cached_tokens for out in rest] == [48, 48]  # three full blocks of 16
    assert llm.last_stats.num_computed_tokens == sum(len(p) - 48 for p in prompts[1:]) + \
        2 * (MAX_TOKENS - 1)


def test_parallel_samples_equal_separately_seeded_requests(reference_llm):
    prompt, other = random_prompts([20, 37], seed=5)  # 20: a shared, partly filled last block
    common = dict(temperature=0.8, top_k=50, top_p=0.9, max_tokens=12, ignore_eos=True)
    outputs = reference_llm.generate(
        [prompt, other], [SamplingParams(n=4, seed=123, **common), GREEDY], use_tqdm=False)
    assert reference_llm.last_stats.num_copied_blocks > 0  # copy-on-write of the shared block
    samples = [completion.token_ids for completion in outputs[0].outputs]
    assert len(samples) == 4 and len(set(map(tuple, samples))) == 4
    separate = reference_llm.generate(
        [prompt] * 4, [SamplingParams(n=1, seed=123 + j, **common) for j in range(4)],
        use_tqdm=False)
    assert samples == token_ids(separate)


def test_sampling_filters_reduce_to_greedy(reference_llm, prompts, expected):
    """top_k=1, or a top_p nucleus of one token, leaves argmax whatever the draw."""
    for params in (SamplingParams(temperature=1.0, top_k=1, seed=7, max_tokens=MAX_TOKENS,
                                  ignore_eos=True),
                   SamplingParams(temperature=0.5, top_p=1e-6, max_tokens=MAX_TOKENS,
                                  ignore_eos=True)):
        assert token_ids(reference_llm.generate(prompts, params, use_tqdm=False)) == expected


def test_stops_at_eos(reference_llm, prompts, expected):
    """With the 4th greedy token declared EOS, generation stops right after it."""
    executor = reference_llm.executor
    eos = next(token for i, token in enumerate(expected[3]) if i >= 3
               and token not in expected[3][:i])
    stop_at = expected[3].index(eos) + 1
    previous, executor.eos_token_id = executor.eos_token_id, eos
    try:
        out = reference_llm.generate(prompts[3], SamplingParams(temperature=0, max_tokens=40),
                                     use_tqdm=False)[0]
    finally:
        executor.eos_token_id = previous
    assert out.outputs[0].token_ids == expected[3][:stop_at]
    assert out.outputs[0].finish_reason == "stop"


def test_bad_requests_fail_alone(reference_llm, prompts, expected):
    greedy4 = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    changed_since = SamplingParams()
    changed_since.top_p = 1.5   # (built valid: generate checks again)
    outputs = reference_llm.generate(
        [prompts[2], [5] * 2100, [], [5, 600], [-1, 4], prompts[4], [5] * 2040, "a string"],
        [greedy4, greedy4, greedy4, greedy4, greedy4, changed_since,
         SamplingParams(max_tokens=10), greedy4],
        use_tqdm=False)
    errors = [out.error for out in outputs]
    assert errors[0] is None and outputs[0].outputs[0].token_ids == expected[2][:4]
    assert "more than max_model_len=2048" in errors[1]
    assert "empty" in errors[2]
    assert "600" in errors[3] and "vocabulary" in errors[3]
    assert "-1" in errors[4]
    assert "top_p" in errors[5]
    assert "exceeds max_model_len" in errors[6]  # the scheduler's rejection: 2040 + 10 tokens
    assert "tokenizer" in errors[7]
    assert all(not out.outputs for out in outputs[1:])


def test_local_checkpoint_with_tokenizer(tmp_path):
    """A checkpoint saved with save_pretrained loads by path through from_pretrained, with its
    tokenizer; string prompts work."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, initializer_range=0.2, eos_token_id=2,
                         bos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {word: i for i, word in enumerate(specials + [f"w{i}" for i in range(4, 64)])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                            eos_token="</s>", unk_token="<unk>").save_pretrained(tmp_path)

    llm = LLM(str(tmp_path), block_size=4, num_gpu_blocks=64)
    assert llm.tokenizer is not None and llm.spec.vocab_size == 64
    prompts = [[5, 9, 13, 40, 7], [33] * 11]
    outputs = llm.generate(prompts + ["w5 w9 w13 w40 w7"], GREEDY, use_tqdm=False)
    expected = hf_greedy(llm.model, prompts)
    assert token_ids(outputs[:2]) == expected
    assert outputs[2].outputs[0].token_ids == expected[0]
    assert outputs[2].outputs[0].text == " ".join(
        f"w{t}" if t >= 4 else specials[t] for t in expected[0])


def test_reference_attention_tiles_match_naive(monkeypatch):
    """The vectorized torch path against the loop oracle, with tiles so small that a step
    splits into many (decodes and prefills mixed, ragged, GQA)."""
    from kernels import naive

    gen = torch.Generator().manual_seed(0)
    block_size, num_kv_heads, heads, head_dim = 4, 2, 4, 8
    query_lens = [1, 5, 1, 3, 7, 1, 1]
    seq_lens = [9, 5, 20, 3, 12, 1, 30]
    tables = torch.randperm(80, generator=gen)[:len(seq_lens) * 8].view(len(seq_lens), 8).int()
    kv_cache = torch.randn(2, 80, block_size, num_kv_heads, head_dim, generator=gen)
    query = torch.randn(sum(query_lens), heads, head_dim, generator=gen)
    query_start_loc = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist()).int()
    args = (query, kv_cache, tables, torch.tensor(seq_lens).int(), query_start_loc, 0.3)
    expected = naive.paged_attention(*args)
    for tile_bytes in (1, 200 * 2 * num_kv_heads * head_dim * 4, torch_paged.TILE_BYTES):
        monkeypatch.setattr(torch_paged, "TILE_BYTES", tile_bytes)
        torch.testing.assert_close(torch_paged.paged_attention(*args), expected)
    ops = get_kernel_ops("cpu")
    assert ops.name == "torch" and ops.plan_attention is torch_paged.plan_attention
    plan = ops.plan_attention(*args[2:5], kv_cache)
    torch.testing.assert_close(ops.paged_attention(*args, plan=plan), expected)


def test_scheduler_object_plugs_in(reference_llm, prompts, expected):
    """A policy object (here a plug-in that admits the shortest prompt first) drives the
    engine; its KV manager sizes the pools."""
    from policies.batching import ContinuousBatchingScheduler
    from policies.memory import PagedBlockManager
    from policies.preemption import RecomputePreemption

    class ShortestPromptFirst(ContinuousBatchingScheduler):
        def next_waiting(self, now):
            return min(self.waiting, key=lambda request: request.prompt_len)

    scheduler = ShortestPromptFirst(PagedBlockManager(num_blocks=40, block_size=8),
                                    RecomputePreemption(), max_num_seqs=3,
                                    max_num_batched_tokens=2048, max_model_len=2048)
    llm = LLM("tiny-llama", scheduler=scheduler)
    assert llm.executor.pool.num_blocks == 40
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected


def test_prefix_cache_host_tier_reloads_keep_outputs(reference_llm):
    """A pool of 40 blocks of 4: the fillers push the first turns' cached blocks out; with a
    host tier they are stored there (real host tensors) and the second turns load them back.
    Greedy outputs equal HF's with and without the tier, and the tier served more."""
    shared = random_prompts([40], seed=5)[0]
    first_turns = [shared + tail for tail in random_prompts([6, 10], seed=6)]
    fillers = random_prompts([50, 50], seed=7)
    second_turns = [turn + tail for turn, tail in zip(first_turns, random_prompts([5, 9], seed=8))]
    batches = [first_turns, fillers, second_turns]
    expected = [hf_greedy(reference_llm.model, batch) for batch in batches]
    cached = {}
    for kv_offload_gb in (0.0, 0.002):                      # 0.002 GiB: 131 blocks of 16 KiB
        llm = LLM("tiny-llama", block_size=4, num_gpu_blocks=40, enable_prefix_caching=True,
                  kv_offload_gb=kv_offload_gb)
        assert [token_ids(llm.generate(batch, GREEDY, use_tqdm=False))
                for batch in batches] == expected
        stats = llm.last_stats
        cached[kv_offload_gb] = stats.num_cached_tokens
        if kv_offload_gb:
            assert llm.scheduler.kv_cache.num_offload_blocks == int(
                0.002 * 2**30 // llm.spec.kv_bytes_per_block(4))
            assert stats.num_loaded_blocks > 0
            assert stats.num_host_cached_tokens == 4 * stats.num_loaded_blocks
        else:
            assert stats.num_loaded_blocks == stats.num_host_cached_tokens == 0
    assert cached[0.002] > cached[0.0]


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_size=0), "block_size must be a positive integer, got 0"),
    (dict(num_gpu_blocks=-3), "num_gpu_blocks must be a positive integer, got -3"),
    (dict(max_num_seqs=2.5), "max_num_seqs must be a positive integer, got 2.5"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be a positive integer"),
    (dict(swap_space_gb=-1), "swap_space_gb must be a number >= 0, got -1"),
    (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization must be a number in \(0, 1\]"),
    (dict(enable_prefix_caching="yes"), "enable_prefix_caching must be true or false"),
    (dict(kv_offload_gb=-1), "kv_offload_gb must be a number >= 0, got -1"),
    (dict(kv_offload_gb=1), "kv_offload_gb needs enable_prefix_caching=True"),
    (dict(seed="abc"), "seed must be a non-negative integer, got 'abc'"),
    (dict(hardware="tpu"), "hardware must be a conf/hardware name"),
    (dict(scheduler="fastest"),
     "scheduler must be one of chunked_prefill, continuous, edf, lora_affinity, mlfq, priority, "
     "sjf, static, vtc"),
    (dict(preemption="evict"), "preemption must be one of recompute, swap"),
])
def test_bad_engine_settings_name_the_argument(kwargs, message):
    """Each bad setting is named as LLM(...) takes it, not as some function inside calls it."""
    with pytest.raises(ValueError, match="^" + message) as error:
        LLM("tiny-llama", **kwargs)
    assert "kv_cache_num_blocks" not in str(error.value)


def test_policies_are_named_as_the_simulator_names_them():
    """A conf/ group name brings that file's class and defaults (chunked prefill's budget of
    2048, swap's 4 GiB host pool), a dotted path or a {_target_} mapping its class, and the
    engine's own settings override the defaults."""
    from policies.batching import ChunkedPrefillScheduler, StaticBatchingScheduler
    from policies.preemption import SwapPreemption
    from runtime.specs import GIB

    llm = LLM("tiny-llama", scheduler="chunked_prefill", preemption="swap", num_gpu_blocks=64)
    scheduler = llm.scheduler
    assert type(scheduler) is ChunkedPrefillScheduler
    assert scheduler.max_num_batched_tokens == 2048
    assert type(scheduler.preemption) is SwapPreemption
    assert scheduler.preemption.swap_space_gb == 4.0
    assert scheduler.kv_cache.num_host_blocks == int(4 * GIB // llm.spec.kv_bytes_per_block(16))
    assert scheduler.kv_cache.watermark == 0.01            # conf/kv_cache/paged.yaml's

    llm = LLM("tiny-llama", scheduler="policies.batching.StaticBatchingScheduler",
              preemption="swap", swap_space_gb=0.01, num_gpu_blocks=64)
    assert type(llm.scheduler) is StaticBatchingScheduler
    assert llm.scheduler.max_num_batched_tokens == 2048    # max(max_model_len, 2048)
    assert llm.scheduler.preemption.swap_space_gb == 0.01

    llm = LLM("tiny-llama", scheduler={"_target_": "policies.batching.ChunkedPrefillScheduler",
                                       "max_num_batched_tokens": 64}, num_gpu_blocks=64)
    assert llm.scheduler.max_num_batched_tokens == 64
    assert LLM("tiny-llama", scheduler="chunked_prefill", max_num_batched_tokens=32,
               num_gpu_blocks=64).scheduler.max_num_batched_tokens == 32


def test_default_pool_is_the_simulators_arithmetic():
    """Without num_gpu_blocks the CPU pool is the simulator's arithmetic with the engine's
    cap: max_num_seqs sequences of max_model_len tokens, and cpu_kv_cache_gb."""
    from omegaconf import OmegaConf

    from runtime.policy_config import CONF_DIR
    from runtime.specs import HardwareSpec
    from runtime.kv_sizing import kv_cache_num_blocks

    llm = LLM("tiny-llama", max_num_seqs=4, max_model_len=512, device="cpu")
    cpu = HardwareSpec.from_config(OmegaConf.load(CONF_DIR / "hardware" / "cpu.yaml"))
    assert llm.executor.pool.num_blocks == 4 * 512 // 16 == kv_cache_num_blocks(
        llm.spec, cpu, 16, max_num_seqs=4, kv_cache_limit_gb=0.5, max_model_len=512)
    small = LLM("tiny-llama", cpu_kv_cache_gb=0.001, device="cpu")
    assert small.executor.pool.num_blocks == int(0.001 * 2**30 // llm.spec.kv_bytes_per_block(16))


def test_engine_executor_under_the_simulator_clock(reference_llm, prompts, expected):
    """The executor as a simulator replica's: simpy time advances by measured step durations,
    and the replayed requests (no SamplingParams: greedy, fixed length) get HF's tokens."""
    from engine import build_engine_executor
    from policies.batching import ChunkedPrefillScheduler
    from policies.memory import PagedBlockManager
    from policies.preemption import RecomputePreemption

    kv_cache = PagedBlockManager(num_blocks=48, block_size=8)
    scheduler = ChunkedPrefillScheduler(kv_cache, RecomputePreemption(), max_num_seqs=8,
                                        max_num_batched_tokens=64, max_model_len=2048)
    executor = build_engine_executor("tiny-llama", kv_cache)
    requests, end = replay_on_sim_clock(scheduler, executor, prompts, MAX_TOKENS)
    assert all(request.finish_time is not None for request in requests)
    assert [request.sequences[0].output_token_ids for request in requests] == expected
    assert end == max(request.finish_time for request in requests) > requests[-1].arrival_time


def test_warm_up_runs_the_longest_prefill_the_pool_holds_and_a_decode_batch():
    """build_engine_executor warms the executor up before a timed run (engine/builder.py)."""
    from engine.builder import warm_up
    from policies.types import StepResult

    class Recorder:
        def __init__(self):
            self.plans = []

        def execute(self, plan):
            self.plans.append(plan)
            return StepResult(duration=0.0)

    recorder = Recorder()
    warm_up(recorder, num_blocks=48, block_size=8, max_tokens=2048)
    prefill, decode = recorder.plans
    assert prefill.num_new_tokens == [47 * 8] and prefill.num_prefill_tokens == 47 * 8
    assert len(decode.seqs) == 23 and decode.num_decode_seqs == 23
    recorder.plans.clear()
    warm_up(recorder, num_blocks=48, block_size=8, max_tokens=100)   # the model's limit
    assert recorder.plans[0].num_new_tokens == [100]
    recorder.plans.clear()
    warm_up(recorder, num_blocks=1, block_size=8, max_tokens=2048)   # nothing fits
    assert recorder.plans == []


# ---------------------------------------------------------------------------------------------
# The engine end to end on the Triton kernels (Triton's interpreter without a GPU): the path a
# GPU runs, tokens identical to HF's (and so to the torch path's, which the tests above hold
# to the same outputs). Where this process imported triton before the interpreter could be
# chosen, each test re-runs alone in a fresh one (tests/triton_interpreter.py).


@pytest.mark.parametrize("name, kwargs", [
    ("continuous", dict(num_gpu_blocks=256)),
    ("chunked_prefill", dict(scheduler="chunked_prefill", max_num_batched_tokens=24,
                             num_gpu_blocks=256)),
    ("swap_preemption", dict(block_size=4, num_gpu_blocks=36, preemption="swap",
                             swap_space_gb=0.01)),
    # The target as its own draft: every draft is accepted, so verification (k + 1 queries per
    # sequence through the prefill kernel) makes every token.
    ("speculative_verification", dict(num_gpu_blocks=256, speculative_model="tiny-llama",
                                      num_speculative_tokens=3)),
])
def test_triton_path_matches_hf_generate(name, kwargs, prompts, expected, request):
    if ran_in_fresh_process(request):
        return
    llm = LLM("tiny-llama", kernel_backend="triton", **kwargs)
    assert llm.executor.runner.ops.name == "triton"
    if name == "speculative_verification":
        prompts, expected = prompts[:3], expected[:3]  # two models through the interpreter
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    if name == "swap_preemption":
        assert llm.last_stats.num_swapped_out_blocks > 0
    if name == "speculative_verification":
        assert llm.last_stats.num_accepted_tokens > 0


def test_triton_path_prefix_caching(reference_llm, request):
    if ran_in_fresh_process(request):
        return
    shared = random_prompts([48], seed=3)[0]
    prompts = [shared + tail for tail in random_prompts([5, 9], seed=4)]
    expected = hf_greedy(reference_llm.model, prompts)
    llm = LLM("tiny-llama", num_gpu_blocks=256, enable_prefix_caching=True,
              kernel_backend="triton")
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert token_ids(first + rest) == expected
    assert rest[0].num_cached_tokens == 48


def test_conf_model_dtype_loads_on_every_device():
    """A conf/model entry's dtype_bytes is its dtype on a CPU too; dtype= overrides it."""
    from engine.model_loader import load_model

    tiny = load_model("tiny-llama", torch.device("cpu"))
    assert next(tiny.model.parameters()).dtype == torch.float32 and tiny.spec.dtype_bytes == 4
    half = load_model("tiny-llama", torch.device("cpu"), dtype="bfloat16")
    assert next(half.model.parameters()).dtype == torch.bfloat16 and half.spec.dtype_bytes == 2
