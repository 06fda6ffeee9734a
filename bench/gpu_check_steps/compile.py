"""Compile-only check (no GPU): every kernel variant the engine's warm-up launches, compiled
for sm_90; registers, spills and shared memory (what the interpreter cannot tell)."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from gpu_check_steps.common import dtype_of
from gpu_check_steps.kernels import DTYPES, KERNEL_MATRIX_NAMES
from gpu_check_steps.lora import LORA_SHAPES

# The multi-LoRA kernels at Llama-2-7B's target modules (LORA_SHAPES: q/k/v/o, gate/up, down)
# and adapter ranks padded to 16 and 64 (kernels/triton_lora.py): one variant per rank padding
# and dtype.
LORA_RANKS = (16, 64)


def compile_report(arch: int = 90) -> int:
    """Run the kernels' warm-up (kernels/triton_ops.warm_up: every variant the engine
    launches; kernels/triton_lora.warm_up_lora at LORA_SHAPES and LORA_RANKS) for each
    configuration of KERNEL_MATRIX_NAMES (block size 16; 32, 16, 8 KV heads
    for groups of 1, 2, 8: Llama-2-7B, -, 70B) with the kernel launches captured instead of
    run, compile each launch for sm_{arch} with the specialisation a real launch gets (16-byte
    aligned pointers; ints divisible by 16 or equal to 1, but for the kernels'
    do_not_specialize arguments), and print registers, spills (stack) and shared memory.
    Written against the internals of Triton 3.6 to 3.9 (JITFunction.run, ASTSource)."""
    import tempfile
    os.environ["TRITON_INTERPRET"] = "0"  # compile, do not interpret (before triton's import)
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from kernels import triton_lora, triton_ops

    launches = []
    original_run = JITFunction.run
    JITFunction.run = lambda self, *args, grid, warmup, **kwargs: launches.append(
        (self, args, kwargs))
    triton_ops.UNAVAILABLE_REASON = None  # the launchers only prepare arguments here
    try:
        for heads_per_kv_head, head_dim, dtype_name in KERNEL_MATRIX_NAMES:
            num_kv_heads = 32 // heads_per_kv_head
            triton_ops.warm_up(32, num_kv_heads, head_dim, 16, dtype_of(dtype_name),
                               torch.device("cpu"))
        for dtype_name in DTYPES:
            for rank in LORA_RANKS:
                triton_lora.warm_up_lora(LORA_SHAPES, rank, dtype_of(dtype_name),
                                         torch.device("cpu"))
    finally:
        JITFunction.run = original_run

    type_names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                  torch.int32: "i32", torch.int64: "i64"}
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    seen, worst_stack = set(), 0
    print(f"triton {triton.__version__}\n")
    print(f"| kernel (sm_{arch}) | constexprs | warps | registers | spill stack | shared |")
    print("|---|---|---|---|---|---|")
    for fn, args, kwargs in launches:
        kwargs = dict(kwargs)
        options = {"num_warps": kwargs.pop("num_warps", 4)}
        values = dict(zip(fn.arg_names, args), **kwargs)
        signature, constexprs, attrs = {}, {}, {}
        for i, name in enumerate(fn.arg_names):
            value = values[name]
            specialised = not fn.params[i].do_not_specialize
            if fn.params[i].is_constexpr or (specialised and type(value) is int and value == 1):
                signature[name], constexprs[name] = "constexpr", value
            elif isinstance(value, torch.Tensor):
                signature[name] = "*" + type_names[value.dtype]
                attrs[(i,)] = [["tt.divisibility", 16]]
            elif isinstance(value, int):
                signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
                if specialised and value % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
            else:
                signature[name] = "fp32"
        key = (fn.__name__, str(constexprs), str(signature), options["num_warps"])
        if key in seen:
            continue
        seen.add(key)
        compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs),
                                  target=GPUTarget("cuda", arch, 32), options=options)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(compiled.asm["cubin"])
            cubin.flush()
            usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", cubin.name],
                                   capture_output=True, text=True).stdout
        registers = re.search(r"REG:(\d+)", usage).group(1)
        stack = int(re.search(r"STACK:(\d+)", usage).group(1))
        worst_stack = max(worst_stack, stack)
        shown = {k: v for k, v in constexprs.items() if k.isupper() or k == "heads_per_kv_head"}
        shown = {k: (str(v).removeprefix("torch.") if not isinstance(v, (int, bool)) else v)
                 for k, v in shown.items()}
        print(f"| {fn.__name__} | {shown} | {options['num_warps']} | {registers} | {stack} | "
              f"{compiled.metadata.shared} |", flush=True)
    return 0 if worst_stack == 0 else 1
