"""The batch sizes vLLM V1 captures CUDA graphs at, and the size a batch replays."""
from __future__ import annotations


def cuda_graph_capture_sizes(max_tokens: int) -> list[int]:
    """vLLM V1's capture sizes up to `max_tokens`: 1, 2, 4, then every multiple of 8."""
    return [size for size in (1, 2, 4) if size <= max_tokens] + list(range(8, max_tokens + 1, 8))


def padded_index(max_tokens: int) -> list[int]:
    """n -> the capture size a batch of n tokens replays (n itself past the largest)."""
    sizes = cuda_graph_capture_sizes(max_tokens)
    index, size_iter = [0], iter(sizes)
    size = next(size_iter, None)
    for n in range(1, (sizes[-1] if sizes else 0) + 1):
        while size < n:
            size = next(size_iter)
        index.append(size)
    return index
