"""The engine's disaggregated pair (engine/disaggregated.py) on the tiny random Llama: greedy
outputs token-identical to one replica's, with and without preemption on either replica; each
request's KV really copied between the two pools (the decode replica reads only its own)."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, DisaggregatedLLM, SamplingParams
from engine.disaggregated import copy_kv_blocks
from engine.kv_cache import KVCachePool
from kernels import get_kernel_ops

from factories import model_spec, token_ids

MAX_TOKENS = 16
PROMPT_LENS = [1, 7, 16, 17, 33, 64, 100]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def expected(prompts):
    """One replica's greedy outputs (tests/test_engine.py checks them against HF generate)."""
    outputs = token_ids(LLM("tiny-llama", num_gpu_blocks=256, seed=0)
                        .generate(prompts, GREEDY, use_tqdm=False))
    assert len(set(map(tuple, outputs))) == len(outputs), "the tiny model ignores its context"
    return outputs


def test_greedy_through_the_pair_equals_one_replica(prompts, expected):
    llm = DisaggregatedLLM("tiny-llama", num_gpu_blocks=256, seed=0)
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    transfers = llm.last_transfers
    assert sorted(t.num_tokens for t in transfers) == sorted(PROMPT_LENS)
    pool = llm.executor.pool
    bytes_per_block = sum(cache[:, 0].numel() * cache.element_size()
                          for cache in pool.device_caches)
    for transfer in transfers:
        assert transfer.num_bytes == -(-transfer.num_tokens // pool.block_size) * bytes_per_block
        assert transfer.seconds > 0
    # The prefill replica only prefilled: one step per prompt token's worth, no decodes there.
    assert llm.scheduler.kv_cache.num_used_blocks() == 0
    assert llm.decode_scheduler.kv_cache.num_used_blocks() == 0


@pytest.mark.parametrize("scheduler, preemption, prefill_blocks, decode_blocks", [
    ("continuous", "recompute", 256, 36),
    ("continuous", "swap", 256, 36),
    ("chunked_prefill", "recompute", 40, 36),
    ("chunked_prefill", "swap", 40, 36),
])
def test_preemption_in_the_pair_keeps_outputs(scheduler, preemption, prefill_blocks,
                                              decode_blocks, prompts, expected):
    # Blocks of 4 slots: the longest request alone needs 29 blocks, all together 90.
    llm = DisaggregatedLLM("tiny-llama", block_size=4, num_gpu_blocks=prefill_blocks,
                           decode_num_gpu_blocks=decode_blocks, scheduler=scheduler,
                           max_num_batched_tokens=32 if scheduler == "chunked_prefill" else None,
                           preemption=preemption, swap_space_gb=0.01)
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert llm.last_stats.num_preemptions > 0
    assert len(llm.last_transfers) == len(prompts)
    for scheduler_ in (llm.scheduler, llm.decode_scheduler):
        assert scheduler_.kv_cache.num_used_blocks() == 0
        assert not (scheduler_.has_unfinished() or scheduler_.handoff.handed_off or scheduler_.receiving)


def test_a_prompt_the_decode_replica_can_never_hold_fails_alone(prompts, expected):
    # 7 blocks of 16: 100 + 16 tokens need 8.
    llm = DisaggregatedLLM("tiny-llama", num_gpu_blocks=256, decode_num_gpu_blocks=7)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert "can never fit" in outputs[-1].error and not outputs[-1].outputs
    assert token_ids(outputs[:-1]) == expected[:-1]


def test_copy_kv_blocks_moves_every_layers_blocks_through_both_tables():
    spec = model_spec("tiny-llama")
    ops = get_kernel_ops(torch.device("cpu"))
    source, destination = (KVCachePool(spec, 8, 0, 4, torch.float32, torch.device("cpu"), ops)
                           for _ in range(2))
    gen = torch.Generator().manual_seed(0)
    for cache in source.device_caches:
        cache.copy_(torch.randn(cache.shape, generator=gen))
    num_bytes = copy_kv_blocks(source, [5, 2, 7], destination, [0, 6, 3])
    for source_cache, destination_cache in zip(source.device_caches, destination.device_caches):
        for from_block, to_block in ((5, 0), (2, 6), (7, 3)):
            assert torch.equal(destination_cache[:, to_block], source_cache[:, from_block])
        untouched = [1, 2, 4, 5, 7]
        assert not destination_cache[:, untouched].any()
    assert num_bytes == 3 * sum(cache[:, 0].numel() * 4 for cache in source.device_caches)
    with pytest.raises(ValueError, match="2 source blocks for 1 destination blocks"):
        copy_kv_blocks(source, [0, 1], destination, [0])


def test_a_deadline_is_refused_in_one_line_naming_timeout_s():
    llm = DisaggregatedLLM("tiny-llama", num_gpu_blocks=64, seed=0)
    output = llm.add_request([1, 2, 3], GREEDY, timeout_s=1.0)
    assert output.error is not None and output.error.startswith("timeout_s")
    assert not llm.has_unfinished_requests()
