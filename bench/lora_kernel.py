"""Times the CPU path's grouped LoRA kernel (kernels/torch_lora.py) against a padded batched
matmul (each token's A and B gathered, then bmm), the alternative it was chosen over, at one
Llama-2-7B q_proj (4096 x 4096), fp32, one thread.

    PYTHONPATH=. python bench/lora_kernel.py [--tokens 512] [--adapters 4] [--rank 16]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from kernels import torch_lora
from kernels.lora_batch import LoRABatch


def padded_bmm(out, x, lora_a, lora_b, scalings, token_slots):
    """The alternative: per-token copies of A and B, two batched matmuls."""
    rows = torch.nonzero(token_slots >= 0).squeeze(1)
    slots = token_slots[rows]
    shrunk = torch.bmm(lora_a[slots], x[rows, :, None])
    delta = torch.bmm(lora_b[slots], shrunk)[:, :, 0] * scalings[slots, None]
    out.index_add_(0, rows, delta)


def best_of(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--features", type=int, default=4096)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    features, rank = args.features, args.rank
    x = torch.randn(args.tokens, features, generator=gen)
    lora_a = torch.randn(args.adapters, rank, features, generator=gen)
    lora_b = torch.randn(args.adapters, features, rank, generator=gen)
    scalings = torch.ones(args.adapters)
    token_slots = np.random.default_rng(0).integers(0, args.adapters, args.tokens)
    batch = LoRABatch.build(token_slots, "cpu")
    out = torch.zeros(args.tokens, features)
    grouped = best_of(lambda: torch_lora.add_lora(out, x, lora_a, lora_b, scalings, batch))
    bmm = best_of(lambda: padded_bmm(out, x, lora_a, lora_b, scalings, batch.token_slots))
    print(f"{args.tokens} tokens, {args.adapters} adapters of rank {rank}, {features} features: "
          f"grouped {grouped * 1e3:.2f} ms, padded bmm {bmm * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
