"""CUDA graphs for decode steps (engine/cuda_graphs.py) without a GPU: the buckets, the padding
of a batch to its bucket, and the engine's decode steps run through the graphs' static, padded
buffers (capture=False: the same forward without a graph, the Triton kernels in their
interpreter), whose greedy outputs must equal HF generate's. Capture and replay themselves run
on a GPU (bench/gpu_check.py's engine step: graphs are on by default there)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM
from engine.cuda_graphs import (DecodeBatch, DecodeGraphs, bucket_for, capture_sizes,
                                pad_decode_batch)

from factories import token_ids
from test_engine import GREEDY, hf_greedy, random_prompts
from triton_interpreter import ran_in_fresh_process


def test_capture_sizes_cover_every_batch_up_to_the_largest():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 24]
    sizes = capture_sizes(256)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 256 and len(sizes) == 3 + 32
    for batch in range(1, 257):
        bucket = bucket_for(batch, sizes)
        assert bucket >= batch and (bucket - batch < 8)
        assert all(size < batch for size in sizes if size < bucket)  # the smallest that holds it
    assert bucket_for(257, sizes) is None
    with pytest.raises(ValueError, match="max_batch must be a positive integer"):
        capture_sizes(0)


def test_padding_rows_attend_to_nothing_and_write_nothing():
    batch = DecodeBatch(token_ids=np.array([7, 9, 11]), positions=np.array([5, 0, 30]),
                        slots=np.array([21, 40, 3]),
                        block_tables=np.array([[5, 2], [10, 0], [1, 4]], dtype=np.int32),
                        seq_lens=np.array([6, 1, 31], dtype=np.int32))
    padded = pad_decode_batch(batch, size=4, width=8)
    assert padded.num_seqs == 4 and padded.block_tables.shape == (4, 8)
    assert padded.token_ids.tolist() == [7, 9, 11, 0]
    assert padded.positions.tolist() == [5, 0, 30, 0]
    assert padded.slots.tolist() == [21, 40, 3, -1]          # the cache write skips -1
    assert padded.seq_lens.tolist() == [6, 1, 31, 0]         # an empty context
    assert padded.block_tables[:3, :2].tolist() == batch.block_tables.tolist()
    assert not padded.block_tables[3].any() and not padded.block_tables[:, 2:].any()
    assert padded.token_ids.dtype == np.int64 and padded.seq_lens.dtype == np.int32
    with pytest.raises(ValueError, match="does not fit a bucket"):
        pad_decode_batch(batch, size=2, width=8)
    with pytest.raises(ValueError, match="does not fit a bucket"):
        pad_decode_batch(batch, size=4, width=1)


def test_decode_steps_through_the_padded_static_buffers_match_hf_generate(request):
    """Three prompts decode together in the bucket of 4 (one padding row); their prompts'
    steps run eagerly. The tokens equal HF's."""
    if ran_in_fresh_process(request):
        return
    llm = LLM("tiny-llama", num_gpu_blocks=64, kernel_backend="triton",
              scheduler="chunked_prefill", max_num_batched_tokens=32)
    runner = llm.executor.runner
    assert runner.decode_graphs is None  # no graphs off CUDA
    runner.decode_graphs = DecodeGraphs(llm.model, runner.kv_caches, runner.ops,
                                        torch.device("cpu"), capture_sizes(4),
                                        llm.spec.max_model_len, runner.block_size,
                                        capture=False)
    prompts = random_prompts([5, 17, 40], seed=8)
    expected = hf_greedy(llm.model, prompts)
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    replays = runner.decode_graphs.num_replays
    assert 0 < replays < llm.last_stats.num_steps  # decodes replayed, prompt chunks eager


def test_enforce_eager_is_a_checked_setting():
    with pytest.raises(ValueError, match="^enforce_eager must be true or false"):
        LLM("tiny-llama", enforce_eager="no")
    assert LLM("tiny-llama", num_gpu_blocks=16, enforce_eager=True).executor.runner \
        .decode_graphs is None
