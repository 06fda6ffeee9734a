"""Paged-KV kernels: Triton on CUDA (kernels/triton_ops.py), torch on CPU (kernels/torch_paged.py),
plain loops as the test oracle (kernels/naive.py), all with naive.py's API and layout.

Tree attention: paged_attention's optional `tree_mask` [num_tokens] int64 has bit d of token t's
entry set when t sees the cache position d before its own (bit 0: itself); positions TREE_WINDOW
or more before it are always seen, none after it, and -1 is plain causal attention."""
from __future__ import annotations

from typing import TYPE_CHECKING

from kernels.ops import KernelOps
from kernels.tree_mask import TREE_WINDOW, tree_mask_entry

if TYPE_CHECKING:
    import torch

__all__ = ["TREE_WINDOW", "KernelOps", "get_kernel_ops", "tree_mask_entry"]


def get_kernel_ops(device: torch.device | str, backend: str | None = None) -> KernelOps:
    """The kernels for `device`: "triton" on CUDA, "torch" elsewhere, "naive" (the loop oracle)
    when `backend` asks. Nothing falls back: Triton that cannot run on CUDA raises, naming
    kernel_backend="torch" as the way to take the torch path on purpose."""
    import torch  # here, not at the top: kernels.tiling is imported by the torch-free simulator

    device = torch.device(device)
    if backend is None:
        backend = "triton" if device.type == "cuda" else "torch"
    if backend == "torch":
        from kernels import torch_paged
        return torch_paged.KERNEL_OPS
    if backend == "naive":
        from kernels import naive
        return naive.KERNEL_OPS
    if backend == "triton":
        try:
            from kernels import triton_ops
        except ImportError as error:  # no triton build for this platform
            raise RuntimeError(f"the Triton kernels cannot load ({error}): install triton, or "
                               f"choose the torch kernels on purpose (kernel_backend='torch')"
                               ) from error
        if device.type == "cuda" and triton_ops.INTERPRETED:
            raise RuntimeError("the Triton kernels are in Triton's interpreter "
                               "(TRITON_INTERPRET=1 was set before triton was imported): they "
                               "would run on the CPU, one program at a time; unset it, or "
                               "choose the torch kernels on purpose (kernel_backend='torch')")
        return triton_ops.KERNEL_OPS
    raise ValueError(f"kernel backend must be one of triton, torch, naive; got {backend!r}")
