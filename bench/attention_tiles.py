"""Attention tiles with short queries kept apart, against one class for every multi-token query.

The torch attention path (kernels/torch_paged.py) attends sequences in padded tiles, and a tile
pads every query to its longest. A speculating decode verifies k + 1 tokens; in a tile with a
prompt's chunk it was padded to the chunk's length. kernels/tiling.py now tiles short queries
(up to MAX_SHORT_QUERY_LEN tokens) apart from prefill chunks. This times the steps where that
matters, speculating decodes next to a 128-token prompt on the trained tiny pair (draft model),
both ways alternately in one process, and prints the ratio.

    python bench/attention_tiles.py [--rounds 30]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import kernels.tiling as tiling  # noqa: E402
from engine.builder import resolve_device  # noqa: E402
from engine.model_loader import load_model  # noqa: E402
from calibration.profiler.cli import executor_factory  # noqa: E402
from runtime.step_shapes import GridPoint, build_plan  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = resolve_device("cpu")
    factory = executor_factory(load_model("tiny-pair", device), device,
                               speculative_model="tiny-pair-draft", max_num_speculative_tokens=8)
    num_blocks = 600
    executor = factory(16, num_blocks, 0)
    rng = np.random.default_rng(0)
    shapes = {(batch, k): build_plan(GridPoint(0, "spec_mixed", 16, decodes=(128,) * batch,
                                               prefills=((128, 0),), spec_len=k),
                                     rng, num_blocks, 0)
              for batch in (4, 16) for k in (1, 4)}
    short_query_len = tiling.MAX_SHORT_QUERY_LEN
    durations = {(shape, split): [] for shape in shapes for split in (False, True)}
    for plan in shapes.values():
        executor.execute(plan)   # warm-up
    for _ in range(args.rounds):
        for shape, plan in shapes.items():
            for split in rng.permutation([False, True]):
                # 0: every query longer than one token in one class, as before the split.
                tiling.MAX_SHORT_QUERY_LEN = short_query_len if split else 0
                durations[shape, bool(split)].append(executor.execute(plan).duration)
    tiling.MAX_SHORT_QUERY_LEN = short_query_len
    print("decodes verifying k drafts next to a 128-token prompt (median step, ms)")
    print(f"{'decodes':>7} {'k':>2} {'one class':>10} {'apart':>8} {'ratio':>6}")
    for batch, k in shapes:
        together = np.median(durations[(batch, k), False]) * 1e3
        apart = np.median(durations[(batch, k), True]) * 1e3
        print(f"{batch:>7} {k:>2} {together:>10.2f} {apart:>8.2f} {apart / together:>6.2f}")


if __name__ == "__main__":
    main()
