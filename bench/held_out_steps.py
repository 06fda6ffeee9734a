"""Profiles against engine steps they were not fitted on: step shapes off the profiler's grid
(decode batches of 5-48 between its 1, 2, 3, 4, 8, 16, 32; prompt chunks between its lengths;
mixed steps), timed on the engine with the speed probes and normalised to the first profile's
machine speed, then each profile's prediction (its fitted mean: line and local correction) per
shape against the shape's median.

    python bench/held_out_steps.py --model tiny-moe profiles/cpu/tiny-moe.json OTHER.json

Prints each profile's mean signed and mean |error| per kind of shape and over all of them.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.step_shapes import GridPoint  # noqa: E402


def held_out_shapes(block_size: int) -> list[GridPoint]:
    """Step shapes the default grid does not run, inside its ranges."""
    shapes = []

    def add(kind, **kw):
        shapes.append(GridPoint(len(shapes), kind, block_size, **kw))

    for batch in (5, 6, 7, 10, 12, 24, 48):
        for ctx in (64, 200, 700):
            add("decode", decodes=(ctx,) * batch)
    for chunk in (40, 96, 200, 384):
        for ctx in (0, 300):
            add("prefill", prefills=((chunk, ctx),))
    for batch in (3, 10):
        for chunk, ctx in ((96, 0), (300, 100)):
            add("mixed", decodes=(200,) * batch, prefills=((chunk, ctx),))
    return shapes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profiles", nargs="+", help="profile JSONs of --model to compare")
    parser.add_argument("--model", default="tiny-moe")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--each", action="store_true", help="print every shape's numbers too")
    args = parser.parse_args(argv)

    import torch

    from calibration.cpu_noise.engine_timing import build_prefill_probes, build_speed_probe
    from calibration.profiler.cli import executor_factory
    from calibration.profiler.grid import profile_together
    from engine.builder import executor_builder
    from engine.model_loader import load_model
    from sim.cost.profiled.cost_model import ProfiledCostModel
    from sim.cost.profiled.expert_features import ExpertRouting

    torch.set_num_threads(1)
    device = torch.device("cpu")
    loaded = load_model(args.model, device, None, args.seed)
    spec = loaded.spec
    routing = (ExpertRouting(spec.num_experts, spec.num_experts_per_tok) if spec.is_moe
               else None)
    new_executor = executor_builder(loaded, device, args.seed, None)
    shapes = held_out_shapes(args.block_size)
    kv_bytes_per_token = 2 * spec.num_key_value_heads * spec.head_dim * spec.dtype_bytes
    measured = profile_together(
        {"": (executor_factory(loaded, device, args.seed), shapes)}, repeats=args.repeats,
        seed=args.seed, progress=False, kv_bytes_per_token=kv_bytes_per_token,
        speed_probe=build_speed_probe(new_executor, args.seed),
        prefill_probes=build_prefill_probes(new_executor, args.seed), routing=routing)[""]
    # This run's samples are at its own median speed; the profiles' at theirs.
    reference = json.loads(Path(args.profiles[0]).read_text())["speed_reference"]
    factor = measured.speed_reference["duration_s"] / reference["duration_s"]
    print(f"{len(shapes)} held-out shapes x {args.repeats} repeats in "
          f"{measured.wall_time_s:.0f} s; this run's machine ran {factor:.3f}x the step times of "
          f"{args.profiles[0]}'s (its samples divided by that)")
    by_point: dict[int, list[dict]] = {}
    for sample in measured.samples:
        by_point.setdefault(sample["point_id"], []).append(sample)
    for path in args.profiles:
        model = ProfiledCostModel(path, sample_residuals=False, block_size=args.block_size)
        errors: dict[str, list[float]] = {}
        for point_id, samples in by_point.items():
            duration = float(np.median([s["duration_s"] for s in samples])) / factor
            features = tuple(samples[0].get(name, 0.0) for name in model.feature_names)
            predicted = model.predict_mean(features)
            errors.setdefault(samples[0]["kind"], []).append(predicted / duration - 1)
            if args.each:
                point = shapes[point_id]
                print(f"  {point.kind} decodes {len(point.decodes)}x{point.decodes[:1]} "
                      f"prefills {point.prefills}: measured {duration * 1e3:.1f} ms, predicted "
                      f"{predicted * 1e3:.1f} ms ({predicted / duration - 1:+.1%})")
        every = [e for kind_errors in errors.values() for e in kind_errors]
        print(f"{path}: all {len(every)} shapes mean {np.mean(every):+.2%}, mean |error| "
              f"{np.mean(np.abs(every)):.2%}; " + "; ".join(
                  f"{kind} {np.mean(e):+.2%} / {np.mean(np.abs(e)):.2%} (n={len(e)})"
                  for kind, e in errors.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
