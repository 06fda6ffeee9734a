"""Imports triton in the mode this machine runs the kernels in: compiled on CUDA, the interpreter
without it, which must be chosen before triton is first imported; UNAVAILABLE_REASON says why
the kernels cannot run when something imported triton too early.
"""
from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the only way Triton runs without a GPU

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

# Ground truth for "which mode are the kernels in": how triton.language's own jit functions
# were built, whatever the environment says now.
INTERPRETED = isinstance(tl.standard.zeros, InterpretedFunction)
UNAVAILABLE_REASON = (
    None if INTERPRETED or torch.cuda.is_available() else
    "no CUDA device, and triton was imported before TRITON_INTERPRET=1 was set: set it in the "
    "environment, or import kernels.triton_ops before anything imports triton")


__all__ = ["INTERPRETED", "UNAVAILABLE_REASON", "tl", "triton"]   # what the kernel modules import
