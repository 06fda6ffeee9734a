"""The profiler's designed grid of step shapes and its timing runs: `make_grid` spans every step
feature alone and in combination (prefill chunks over cached contexts, decode batches, mixed
batches, copy-on-write and swaps next to a small decode), each plan built for real through a
`PagedBlockManager` over an aged pool; `profile`/`profile_together` time it on executors.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from calibration.cpu_noise.speed import SpeedProbe, normalize_samples, take_due_readings
from calibration.profiler.fit import fit_profile
from policies import validators
from runtime.step_shapes import GridPoint, build_plan, spread, spread_chunks
from sim.cost.profiled.step_features import STEP_FEATURES, step_features
from sim.cost.profiled.expert_features import EXPERT_FEATURES, ExpertRouting, expert_features
from sim.cost.profiled.tile_features import TILE_FEATURES, AttentionTiling, tile_features


# ---------------------------------------------------------------- grid


def make_grid(block_sizes: Iterable[int] = (16, 32), quick: bool = False,
              speculative_ks: Iterable[int] = (), draft_model_lags: bool = True
              ) -> list[GridPoint]:
    """The designed grid: the full one at the first block size, the shapes whose attention the
    block size changes at the others. `speculative_ks` adds decodes verifying k drafts (tree
    sizes for a token-tree drafter), alone and beside a prefill chunk, and with
    `draft_model_lags` sequences whose drafter lags one token."""
    specs: list[dict] = []

    def add(kind, full_only=False, **kw):
        specs.append({"kind": kind, "full_only": full_only, **kw})

    if quick:
        _add_quick_shapes(add)
    else:
        _add_full_shapes(add)
    _add_speculative_shapes(add, speculative_ks, quick, draft_model_lags)
    return _grid_points(specs, block_sizes, quick)


def _add_quick_shapes(add) -> None:
    for chunk, ctx in ((32, 0), (64, 64)):
        add("prefill", prefills=((chunk, ctx),))
    for batch, ctx in ((2, 32), (8, 96)):
        add("decode", decodes=(ctx,) * batch)
    add("decode_mixed_ctx", decodes=spread(6, 16, 160))
    add("mixed", decodes=(64,) * 4, prefills=((32, 32),))
    add("copy", full_only=True, decodes=(64,) * 2, num_copies=4)
    add("swap", full_only=True, decodes=(64,) * 2, num_swap_out=3, num_swap_in=3)


def _add_full_shapes(add) -> None:
    for chunk in (16, 64, 128, 256, 512):
        for ctx in (0, 128, 512):
            add("prefill", prefills=((chunk, ctx),))
    for ctx in (0, 256):  # longest chunks in the mix, kept within ~1k tokens of context
        add("prefill", prefills=((768, ctx),))
    add("prefill", prefills=((1536, 0),))
    # Several prompts in one step, up to a 2,048-token budget (continuous batching admits
    # every waiting prompt that fits).
    for count in (2, 4, 8):
        for chunk in (32, 128):
            add("multi_prefill", prefills=((chunk, 0),) * count)
    add("multi_prefill", prefills=((64, 256),) * 4)
    add("multi_prefill", prefills=spread_chunks(6, 32, 320))
    add("multi_prefill", prefills=spread_chunks(12, 64, 256))
    for count, chunk in ((4, 512), (8, 256), (16, 128)):
        add("multi_prefill", prefills=((chunk, 0),) * count)
    # 2 and 3 too: a light load runs mostly such batches, and from 1 to 4 sequences the
    # cost bends.
    for batch in (1, 2, 3, 4, 8, 16, 32, 64):
        for ctx in (32, 128, 256, 512, 1024):
            add("decode", decodes=(ctx,) * batch)
    for batch in (128, 256):  # the largest batches, with short contexts to fit the pool
        for ctx in (32, 128, 320):
            add("decode", decodes=(ctx,) * batch)
    # Real batches mix context lengths: the torch attention pads each tile to its longest.
    for batch in (2, 4, 8, 16, 32, 64, 128):
        for low, high in ((16, 320), (32, 1024)):
            add("decode_mixed_ctx", decodes=spread(batch, low, high))
    # From 1 decode on: chunked prefill at a light load mixes a prompt with one or two,
    # which a fit through 4+ under-predicts.
    for batch in (1, 2, 4, 16, 48):
        for chunk, ctx in ((64, 0), (256, 0), (128, 384), (512, 128)):
            add("mixed", decodes=(256,) * batch, prefills=((chunk, ctx),))
    for batch in (8, 32, 96):  # chunked prefill: decodes of spread contexts and chunks
        for chunk, ctx in ((32, 64), (200, 0), (1024, 256)):
            add("mixed", decodes=spread(batch, 16, 400), prefills=((chunk, ctx),))
    add("mixed", decodes=spread(24, 16, 320), prefills=spread_chunks(4, 16, 256))
    for copies in (4, 16, 64, 256):
        add("copy", full_only=True, decodes=(128,) * 4, num_copies=copies)
    for blocks in (4, 16, 64, 256):
        add("swap_out", full_only=True, decodes=(128,) * 4, num_swap_out=blocks)
        add("swap_in", full_only=True, decodes=(128,) * 4, num_swap_in=blocks)
    add("swap", full_only=True, decodes=(128,) * 4, num_swap_out=64, num_swap_in=64)


def _add_speculative_shapes(add, speculative_ks: Iterable[int], quick: bool,
                            draft_model_lags: bool) -> None:
    for k in speculative_ks:
        for batch in ((1, 8) if quick else (1, 2, 4, 8, 16, 32, 64)):
            for ctx in ((64,) if quick else (64, 320)):
                add("spec_decode", decodes=(ctx,) * batch, spec_len=k)
        if quick:
            if draft_model_lags:
                add("spec_decode", decodes=(64,) * 2, spec_len=k, num_lagging=1)
        else:
            add("spec_decode", decodes=spread(24, 16, 400), spec_len=k)
            for batch in (4, 16):
                add("spec_mixed", decodes=(128,) * batch, prefills=((128, 0),), spec_len=k)
            # After a step that accepted all its drafts a draft model lags the target by one
            # token, which its next pass runs again (most sequences, where acceptance is high).
            lagging = ((1, 1), (4, 2), (4, 4), (16, 8), (16, 16)) if draft_model_lags else ()
            for batch, num_lagging in lagging:
                add("spec_decode", decodes=(128,) * batch, spec_len=k, num_lagging=num_lagging)


def _grid_points(specs: list[dict], block_sizes: Iterable[int], quick: bool) -> list[GridPoint]:
    grid: list[GridPoint] = []
    for index, block_size in enumerate(block_sizes):
        for spec in specs:
            if index > 0 and spec["full_only"]:
                continue
            if index > 0 and not quick and spec["kind"] == "decode" and len(spec["decodes"]) in (
                    3, 4, 16):
                continue  # a coarser decode grid for the secondary block sizes
            kw = {k: v for k, v in spec.items() if k != "full_only"}
            grid.append(GridPoint(point_id=len(grid), block_size=block_size, **kw))
    return grid


# ---------------------------------------------------------------- measuring


@dataclass
class Profile:
    """Every sample of a run, one dict per (point, repeat) with its features and duration_s;
    with a speed probe, duration_s is at the run's median machine speed (raw_duration_s as
    measured) and speed_reference is the profile's."""

    points: list[GridPoint]
    samples: list[dict] = field(default_factory=list)
    repeats: int = 0
    wall_time_s: float = 0.0
    speed_reference: dict | None = None

    def fit(self, metadata: dict | None = None) -> dict:
        return fit_profile(self.samples, metadata)


ExecutorFactory = Callable[[int, int, int], object]  # (block_size, num_blocks, host_blocks)


def profile(executor_factory: ExecutorFactory, grid: list[GridPoint], repeats: int = 5,
            warmup: int = 1, seed: int = 0, progress: bool = True,
            kv_bytes_per_token: int | None = None,
            speed_probe: SpeedProbe | None = None,
            prefill_probes: tuple[SpeedProbe, ...] = (),
            routing: ExpertRouting | None = None) -> Profile:
    """Run every grid point `warmup` untimed + `repeats` timed times on executors from
    `executor_factory(block_size, num_blocks, num_host_blocks)`; `kv_bytes_per_token` adds the
    attention-tile features, `routing` the expert feature, `speed_probe` the normalisation."""
    return profile_together({"": (executor_factory, grid)}, repeats, warmup, seed, progress,
                            kv_bytes_per_token, speed_probe, prefill_probes, routing)[""]


def profile_together(setups: dict[str, tuple[ExecutorFactory, list[GridPoint]]],
                     repeats: int = 5, warmup: int = 1, seed: int = 0, progress: bool = True,
                     kv_bytes_per_token: int | None = None,
                     speed_probe: SpeedProbe | None = None,
                     prefill_probes: tuple[SpeedProbe, ...] = (),
                     routing: ExpertRouting | None = None) -> dict[str, Profile]:
    """`profile` for several executors (name -> (factory, grid)) in the same interleaved rounds,
    so that profiles a comparison divides by each other see the same machine and one speed
    reference."""
    validators.positive_int("repeats", repeats)
    if prefill_probes and speed_probe is None:
        raise ValueError("prefill probes need the (decode) speed probe beside them")
    start = time.perf_counter()
    results = {name: Profile(points=list(grid), repeats=repeats)
               for name, (_, grid) in setups.items()}
    rng = np.random.default_rng(seed)
    runs = _prepare_runs(setups, rng, kv_bytes_per_token, routing)
    bar = _progress_bar(len(runs) * repeats, progress)
    try:
        probed, prefill_readings = _timed_rounds(runs, results, repeats, warmup, rng,
                                                 speed_probe, prefill_probes, bar)
    finally:
        if bar is not None:
            bar.close()
    wall_time_s = time.perf_counter() - start
    speed_reference = None if speed_probe is None else normalize_samples(
        probed, speed_probe, prefill_probes, prefill_readings)
    for result in results.values():
        result.samples.sort(key=lambda s: (s["point_id"], s["repeat"]))
        result.wall_time_s = wall_time_s
        result.speed_reference = speed_reference
    return results


def _prepare_runs(setups: dict[str, tuple[ExecutorFactory, list[GridPoint]]],
                  rng: np.random.Generator, kv_bytes_per_token: int | None,
                  routing: ExpertRouting | None) -> list[tuple]:
    """(name, point, executor, plan, features) of every point of every executor, one executor
    per block size, each warmed up on its largest shapes."""
    runs = []
    for name, (executor_factory, grid) in setups.items():
        by_block_size: dict[int, list[GridPoint]] = {}
        for point in grid:
            by_block_size.setdefault(point.block_size, []).append(point)
        for block_size, points in by_block_size.items():
            num_blocks = max(p.num_blocks_needed() for p in points)
            num_host = max(p.num_host_blocks_needed() for p in points)
            executor = executor_factory(block_size, num_blocks, num_host)
            tiling = None if kv_bytes_per_token is None else AttentionTiling.of(
                block_size, kv_bytes_per_token)
            largest = sorted(points, key=lambda p: -p.num_blocks_needed())[:3]
            for point in points:
                # Blocks scattered over the pool, as a serving run's are (build_plan's aged_pool).
                plan = build_plan(point, rng, num_blocks, num_host, aged_pool=True)
                features = dict(zip(STEP_FEATURES, step_features(plan)))
                if tiling is not None:
                    features.update(zip(TILE_FEATURES, tile_features(plan, tiling)))
                if routing is not None:
                    features.update(zip(EXPERT_FEATURES, expert_features(plan, routing)))
                runs.append((name, point, executor, plan, features))
                if point in largest:
                    executor.execute(plan)
    return runs


def _timed_rounds(runs: list[tuple], results: dict[str, Profile], repeats: int, warmup: int,
                  rng: np.random.Generator, speed_probe: SpeedProbe | None,
                  prefill_probes: tuple[SpeedProbe, ...], bar
                  ) -> tuple[list[tuple[dict, int, int]], list[tuple[int, ...]]]:
    """Time every run `repeats` times into `results`; returns what normalize_samples needs:
    (sample, index of the probe reading before it, its run) and each prefill probe's reading
    before each sample."""
    probed: list[tuple[dict, int, int]] = []
    prefill_readings: list[tuple[int, ...]] = []
    for _ in range(warmup):
        for _, _, executor, plan, _ in runs:
            executor.execute(plan)
    # Rounds in a fresh random order, so that a drift or burst of load spreads over many
    # points instead of biasing one point, kind or executor.
    order = 0   # the sample's position in the run: what ran before it is order - 1
    for repeat in range(repeats):
        for index in rng.permutation(len(runs)):
            name, point, executor, plan, features = runs[index]
            after_probe = speed_probe is not None and take_due_readings(
                plan, speed_probe, prefill_probes)
            duration = float(executor.execute(plan).duration)
            sample = {"point_id": point.point_id, "kind": point.kind,
                      "block_size": point.block_size, "repeat": repeat, **features,
                      "duration_s": duration, "order": order,
                      "after_probe": int(after_probe)}
            order += 1
            results[name].samples.append(sample)
            if speed_probe is not None:
                probed.append((sample, len(speed_probe.readings) - 1, index))
                prefill_readings.append(tuple(len(p.readings) - 1 for p in prefill_probes))
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.set_postfix_str(f"round {repeat + 1}/{repeats}")
    return probed, prefill_readings


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc="profiling", unit="step", file=sys.stderr)
