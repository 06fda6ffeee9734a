"""The grouped multi-LoRA kernels (kernels/torch_lora.py; kernels/triton_lora.py, through Triton's
interpreter without a GPU) against the per-token loop oracle (kernels/naive.py add_lora), itself
checked against a per-adapter computation, on fresh random inputs at tiny sizes: adapters of
mixed ranks in slots padded to the widest (rows and columns past a rank zero), a loaded slot no
token uses, tokens without an adapter interleaved with grouped ones, feature sizes that are not
multiples of the kernels' tiles, and every row followed by NaNs (an unmasked read shows)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import naive, torch_lora
from kernels.lora_batch import NO_ADAPTER, LoRABatch
from triton_interpreter import ran_in_fresh_process

TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=2e-2)}


def poisoned(shape, pad: int, dtype) -> torch.Tensor:
    """A zero tensor of `shape` whose rows are views into NaN-filled rows `pad` wider: a kernel
    reading past a row's last column (an unmasked load) makes NaNs."""
    buffer = torch.full((*shape[:-1], shape[-1] + pad), float("nan"), dtype=dtype)
    view = buffer[..., :shape[-1]]
    view.zero_()
    return view


def random_lora_case(seed: int, num_tokens: int, in_features: int, out_features: int,
                     ranks: list[int], dtype=torch.float32):
    """(out, x, lora_a, lora_b, scalings, batch): slots of `ranks` plus one more slot holding
    an adapter no token uses, each token's slot drawn at random, a third of them without an
    adapter. Every tensor's rows end in NaN padding."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    num_slots, max_rank = len(ranks) + 1, max(ranks)
    lora_a = poisoned((num_slots, max_rank, in_features), 5, dtype)
    lora_b = poisoned((num_slots, out_features, max_rank), 3, dtype)
    for slot, rank in enumerate(ranks + [max_rank]):
        lora_a[slot, :rank] = torch.randn(rank, in_features, generator=gen).to(dtype)
        lora_b[slot, :, :rank] = torch.randn(out_features, rank, generator=gen).to(dtype)
    scalings = torch.rand(num_slots, generator=gen) + 0.5
    token_slots = rng.integers(0, len(ranks), num_tokens)
    token_slots[rng.random(num_tokens) < 1 / 3] = NO_ADAPTER
    x = poisoned((num_tokens, in_features), 7, dtype)
    x.copy_(torch.randn(num_tokens, in_features, generator=gen))
    out = poisoned((num_tokens, out_features), 2, dtype)
    out.copy_(torch.randn(num_tokens, out_features, generator=gen))
    return out, x, lora_a, lora_b, scalings, LoRABatch.build(token_slots, "cpu")


def per_request_loop(out, x, lora_a, lora_b, scalings, token_slots):
    """An independent reference for the oracle: each adapter's tokens through PEFT's order of
    products, lora_B(lora_A(x)) * scaling, one adapter at a time."""
    expected = out.clone().float()
    for slot in set(token_slots) - {NO_ADAPTER}:
        rows = [t for t, s in enumerate(token_slots) if s == slot]
        expected[rows] += (x[rows].float() @ lora_a[slot].float().t()
                           @ lora_b[slot].float().t()) * scalings[slot]
    return expected


CASES = [  # (seed, tokens, in, out, ranks)
    (0, 1, 32, 48, [8]),              # one decode token
    (1, 37, 90, 100, [4, 16, 7]),     # ragged ranks, features off the tiles of 16
    (2, 70, 40, 130, [1, 32, 8, 16]),
]


def test_oracle_matches_a_per_adapter_computation():
    out, x, lora_a, lora_b, scalings, batch = random_lora_case(3, 29, 40, 24, [4, 12])
    expected = per_request_loop(out, x, lora_a, lora_b, scalings, batch.token_slots.tolist())
    naive.add_lora(out, x, lora_a, lora_b, scalings, batch)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_batch_groups_tokens_by_slot_in_order():
    batch = LoRABatch.build(np.array([2, -1, 0, 2, 0, -1, 2]), "cpu")
    assert batch.sorted_tokens.tolist() == [2, 4, 0, 3, 6]
    assert batch.host_group_slots == [0, 2] and batch.group_slots.tolist() == [0, 2]
    assert batch.host_group_starts == [0, 2, 5] and batch.group_starts.tolist() == [0, 2, 5]
    assert batch.max_group_len == 3 and batch.num_lora_tokens == 5
    empty = LoRABatch.build(np.array([-1, -1]), "cpu")
    assert empty.num_groups == 0 and empty.max_group_len == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_torch_grouped_kernel_matches_the_loop(case, dtype):
    out, x, lora_a, lora_b, scalings, batch = random_lora_case(*case, dtype=dtype)
    expected = out.clone()
    naive.add_lora(expected, x, lora_a, lora_b, scalings, batch)
    torch_lora.add_lora(out, x, lora_a, lora_b, scalings, batch)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


def test_triton_grouped_kernel_matches_the_loop(request):
    """Every case and dtype in one test: without the interpreter in this process it re-runs in
    a fresh one (tests/triton_interpreter.py), once."""
    if ran_in_fresh_process(request):
        return
    from kernels import triton_ops
    for case in CASES:
        for dtype in (torch.float32, torch.float16):
            out, x, lora_a, lora_b, scalings, batch = random_lora_case(*case, dtype=dtype)
            expected = out.clone()
            naive.add_lora(expected, x, lora_a, lora_b, scalings, batch)
            before = out.clone()
            # Tiles of 16 columns: every case's features span several (the GPU's are wider).
            triton_ops.KERNEL_OPS.add_lora(out, x, lora_a, lora_b, scalings, batch, block_k=16,
                                           block_n=16)
            torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
            untouched = batch.token_slots == NO_ADAPTER
            assert torch.equal(out[untouched], before[untouched])
