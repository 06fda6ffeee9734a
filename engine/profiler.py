"""twinserve-profile: measure step durations on this device over a designed grid of step shapes,
fit a linear model of duration on the step features, and write `profiles/<device>/<model>.json`
with the raw samples beside it (`<model>.samples.csv`).

The grid is not a workload: it is chosen to span every step feature
(sim/calibration/step_features.py, and the attention-tile features) on its own and in
combination: prefill chunks of several lengths over several cached-context lengths, several
prefill chunks in one step, decode batches of several sizes over several context lengths, mixed
batches (decodes + one prefill chunk), copy-on-write copies and swap transfers (next to a small
decode batch, since a real step always runs a forward), over a couple of block sizes. Every plan
is built for real through a `PagedBlockManager` (sim/calibration/step_shapes.py: valid block
tables, copy and swap pairs, blocks scattered over an aged pool); the KV contents are whatever
the pool holds, which is all that timing needs.

    python -m engine.profiler --model tiny-llama            # the default grid, 10 repeats
    python -m engine.profiler --quick --out-dir /tmp/prof   # a handful of points

Function API (tests, the profiled cost model):

    prof = profile(executor_factory, grid, repeats=5)   # -> Profile (samples + points)
    content = fit_profile(prof.samples, metadata)        # -> the JSON content (a dict)
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime as _dt
import json
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from kernels.tiling import TILE_BYTES
from policies import validators
from sim.calibration.cpu_noise.local_correction import fit_local_correction
from sim.calibration.cpu_noise.speed import (DEFAULT_INTERVAL_S, SpeedProbe, normalize_samples,
                                             take_due_readings)
from sim.calibration.cpu_noise.tile_features import TILE_FEATURES, AttentionTiling, tile_features
from sim.calibration.step_features import STEP_FEATURES, step_features
from sim.calibration.step_shapes import GridPoint, build_plan, spread, spread_chunks
from policies.speculation.drafters import TREE_DRAFTERS   # points that verify whole token trees

SCHEMA = 1
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT_DIR = REPO_ROOT / "profiles"
NO_DRAFTER = "none"  # --speculative-models: the executor without a drafter


# ---------------------------------------------------------------- grid


def make_grid(block_sizes: Iterable[int] = (16, 32), quick: bool = False,
              speculative_ks: Iterable[int] = (), draft_model_lags: bool = True
              ) -> list[GridPoint]:
    """The designed grid. The first block size gets the full grid; the others a subset (decode,
    prefill and mixed shapes, where the block size changes the attention's gathers). With
    `speculative_ks` (an executor with a drafter), decode batches that verify k drafts each, for
    every k given, alone and next to a prefill chunk, and (`draft_model_lags`: a draft model,
    n-gram profiled alike) with sequences whose drafter lags one token. A token-tree drafter's
    never lags (its trees are never accepted whole): its k are tree sizes."""
    specs: list[dict] = []

    def add(kind, full_only=False, **kw):
        specs.append({"kind": kind, "full_only": full_only, **kw})

    if quick:
        for chunk, ctx in ((32, 0), (64, 64)):
            add("prefill", prefills=((chunk, ctx),))
        for batch, ctx in ((2, 32), (8, 96)):
            add("decode", decodes=(ctx,) * batch)
        add("decode_mixed_ctx", decodes=spread(6, 16, 160))
        add("mixed", decodes=(64,) * 4, prefills=((32, 32),))
        add("copy", full_only=True, decodes=(64,) * 2, num_copies=4)
        add("swap", full_only=True, decodes=(64,) * 2, num_swap_out=3, num_swap_in=3)
    else:
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
    """Every sample of a run: one dict per (point, repeat) with point_id, kind, block_size,
    repeat, every STEP_FEATURES value (and TILE_FEATURES value, where measured with them) and
    duration_s; with a speed probe, duration_s is at the run's median machine speed,
    raw_duration_s as measured, speed_factor the machine's (smoothed) factor when it ran, and
    speed_reference is the profile's, with the exponent of that factor each kind of step follows
    (sim/calibration/cpu_noise/speed.py)."""

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
            prefill_probes: tuple[SpeedProbe, ...] = ()) -> Profile:
    """Run every grid point `warmup` untimed + `repeats` timed times on executors built by
    `executor_factory(block_size, num_blocks, num_host_blocks)` (one per block size, pools sized
    for its largest point), keeping every sample's measured `duration`. With
    `kv_bytes_per_token` (the engine's K/V bytes per token and layer) the samples carry the
    attention-tile features too. With a `speed_probe`, every sample is normalised to the
    machine's median speed over the run (sim/calibration/cpu_noise/speed.py)."""
    return profile_together({"": (executor_factory, grid)}, repeats, warmup, seed, progress,
                            kv_bytes_per_token, speed_probe, prefill_probes)[""]


def profile_together(setups: dict[str, tuple[ExecutorFactory, list[GridPoint]]],
                     repeats: int = 5, warmup: int = 1, seed: int = 0, progress: bool = True,
                     kv_bytes_per_token: int | None = None,
                     speed_probe: SpeedProbe | None = None,
                     prefill_probes: tuple[SpeedProbe, ...] = ()) -> dict[str, Profile]:
    """`profile` for several executors (name -> (factory, grid)) at once, every point of every
    one in the same interleaved rounds: profiles that a comparison divides by each other (a
    speedup with a drafter over one without) then see the same machine, drifts included (and
    one speed probe, so one speed reference). `prefill_probes` (with a speed_probe) time their
    prompts before prompt steps (sim/calibration/cpu_noise/speed.py)."""
    validators.positive_int("repeats", repeats)
    if prefill_probes and speed_probe is None:
        raise ValueError("prefill probes need the (decode) speed probe beside them")
    start = time.perf_counter()
    results = {name: Profile(points=list(grid), repeats=repeats)
               for name, (_, grid) in setups.items()}
    rng = np.random.default_rng(seed)
    runs = []  # (name, point, executor, plan, features) of every point, all block sizes
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
                runs.append((name, point, executor, plan, features))
                if point in largest:   # warm each executor up on its largest shapes first
                    executor.execute(plan)
    bar = _progress_bar(len(runs) * repeats, progress)
    # (sample, index of the probe reading before it, its run: one point of one executor)
    probed: list[tuple[dict, int, int]] = []
    prefill_readings: list[tuple[int, ...]] = []   # each prefill probe's before each sample
    try:
        for _ in range(warmup):
            for _, _, executor, plan, _ in runs:
                executor.execute(plan)
        # Repeats in rounds over every point of every executor and block size, in a fresh random
        # order each round: a drift or a burst of load from elsewhere on the machine spreads
        # over many points' samples instead of biasing one point, one kind or one executor.
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


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc="profiling", unit="step", file=sys.stderr)


# ---------------------------------------------------------------- fitting


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0: Lawson & Hanson's active-set method (scipy's nnls,
    in numpy)."""
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    max_iter = max_iter or 3 * n + 30
    tol = 10 * np.finfo(float).eps * np.linalg.norm(a, 1) * max(m, n)
    w = a.T @ (b - a @ x)
    for _ in range(max_iter):
        if passive.all() or not (w[~passive] > tol).any():
            break
        candidates = np.where(~passive, w, -np.inf)
        passive[int(np.argmax(candidates))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            # Step back toward x until a passive coefficient hits zero; drop it.
            blocking = passive & (z <= 0)
            alpha = np.min(x[blocking] / (x[blocking] - z[blocking] + 1e-300))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
        w = a.T @ (b - a @ x)
    return x


def sample_features(samples: list[dict]) -> list[str]:
    """The features a profile of these samples is fitted with: STEP_FEATURES, and the
    attention-tile features where every sample has them."""
    return [*STEP_FEATURES, *(name for name in TILE_FEATURES
                              if all(name in sample for sample in samples))]


def fit_profile(samples: list[dict], metadata: dict | None = None) -> dict:
    """Fit duration = intercept + Σ coef·feature (over `sample_features(samples)`) with every
    coefficient ≥ 0 to the median
    duration of each grid point (robust to a burst of load from elsewhere on the machine),
    weighting each point by 1/duration (so the fit minimises relative error: steps span two
    orders of magnitude, and an unweighted fit would sacrifice every small decode step to the
    long prefills). Returns the profile JSON's content.

    The residuals the cost model draws from are the measurement noise alone: each sample over
    its point's median, minus 1, so they spread the prediction the way repeats of one step
    spread, without the fit's misfit (which is per shape, not random)."""
    if not samples:
        raise ValueError("fit_profile: no samples")
    by_point: dict[object, list[int]] = {}
    for index, sample in enumerate(samples):
        by_point.setdefault(sample.get("point_id", f"sample {index}"), []).append(index)
    features = sample_features(samples)
    x_all = np.array([[float(s[f]) for f in features] for s in samples])
    y_all = np.array([float(s["duration_s"]) for s in samples])
    if (y_all <= 0).any():
        raise ValueError("fit_profile: durations must be positive")
    first = [indices[0] for indices in by_point.values()]
    x = x_all[first]
    y = np.array([np.median(y_all[indices]) for indices in by_point.values()])
    design = np.hstack([np.ones((len(y), 1)), x])
    # Column scaling for conditioning; a feature that never varies from zero is left out.
    scale = np.abs(design).max(axis=0)
    used = scale > 0
    weighted = design[:, used] / scale[used] / y[:, None]
    coef_scaled = nnls(weighted, np.ones(len(y)))
    coef = np.zeros(design.shape[1])
    coef[used] = coef_scaled / scale[used]
    point_errors = (design @ coef) / y - 1.0          # misfit per point (noise mostly removed)
    correction, correction_fit = fit_local_correction(x, y, design @ coef)
    noise = np.empty(len(samples))
    for indices, median in zip(by_point.values(), y):
        noise[indices] = y_all[indices] / median - 1.0
    predicted_all = np.hstack([np.ones((len(y_all), 1)), x_all]) @ coef
    relative = y_all / np.maximum(predicted_all, 1e-12) - 1.0
    by_kind: dict[str, list[float]] = {}
    for indices, error in zip(by_point.values(), point_errors):
        by_kind.setdefault(str(samples[indices[0]].get("kind", "all")), []).append(float(error))
    ss_res = float(((y_all - predicted_all) ** 2).sum())
    ss_tot = float(((y_all - y_all.mean()) ** 2).sum())
    return {
        "schema": SCHEMA,
        "metadata": dict(metadata or {}),
        "features": features,
        "model": {"kind": "linear", "intercept_s": float(coef[0]),
                  "coefficients_s": {f: float(c) for f, c in zip(features, coef[1:])}},
        "residuals": {"kind": "relative", "samples": [float(r) for r in noise]},
        "feature_ranges": {f: [float(x[:, i].min()), float(x[:, i].max())]
                           for i, f in enumerate(features)},
        "fit": {"r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0,
                "mean_abs_rel_error": float(np.abs(relative).mean()),
                "median_abs_rel_error": float(np.median(np.abs(relative))),
                "max_abs_rel_error": float(np.abs(relative).max()),
                "num_samples": len(y_all),
                "num_points": len(y),
                # Prediction vs each point's median: the model's misfit, noise mostly removed.
                "mean_abs_point_error": float(np.abs(point_errors).mean()),
                "max_abs_point_error": float(np.abs(point_errors).max()),
                "noise_std": float(noise.std()),
                # Per kind of grid point: a mean far from 0 is a shape the features miss.
                "by_kind": {kind: {"mean_point_error": float(np.mean(v)),
                                   "mean_abs_point_error": float(np.mean(np.abs(v))),
                                   "num_points": len(v)} for kind, v in by_kind.items()},
                # With the local correction, each point predicted from the others alone.
                "correction": correction_fit},
        "correction": None if correction is None else correction.to_json(x),
    }


# ---------------------------------------------------------------- writing


def read_samples(csv_path: Path) -> list[dict]:
    """A samples CSV as write_profile wrote it (numbers as floats, kind as text; empty cells
    left out). A file from before a core step feature existed gets it as 0: the profiler's steps
    did not have it then."""
    with Path(csv_path).open(newline="") as handle:
        return [{**dict.fromkeys(STEP_FEATURES, 0.0),
                 **{key: value if key == "kind" else float(value)
                    for key, value in row.items() if value != ""}}
                for row in csv.DictReader(handle)]


def refit(json_path: Path) -> dict:
    """Re-fit a profile from its samples CSV (beside it), keeping its metadata and speed
    reference: what a change of the fit needs, without measuring again."""
    json_path = Path(json_path)
    old = json.loads(json_path.read_text())
    csv_path = json_path.with_name(json_path.stem + ".samples.csv")
    content = fit_profile(read_samples(csv_path), old.get("metadata"))
    if old.get("speed_reference") is not None:
        content["speed_reference"] = old["speed_reference"]
    content["metadata"]["refitted"] = _dt.datetime.now(_dt.timezone.utc).isoformat(
        timespec="seconds")
    json_path.write_text(json.dumps(content, indent=1) + "\n")
    return content


def write_profile(content: dict, samples: list[dict], out_dir: Path, device_dir: str,
                  model: str) -> tuple[Path, Path]:
    folder = Path(out_dir) / device_dir
    folder.mkdir(parents=True, exist_ok=True)
    json_path = folder / f"{model}.json"
    csv_path = folder / f"{model}.samples.csv"
    json_path.write_text(json.dumps(content, indent=1) + "\n")
    columns = ["point_id", "kind", "block_size", "repeat", *content["features"], "duration_s",
               "raw_duration_s", "speed_factor", "order", "after_probe"]
    with csv_path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        for sample in samples:   # (without a speed probe: as measured, factor 1)
            writer.writerow({"raw_duration_s": sample["duration_s"], "speed_factor": 1.0,
                             **{c: sample[c] for c in columns if c in sample}})
    return json_path, csv_path


def device_names(device) -> tuple[str, str]:
    """(human name for the metadata, folder name under profiles/)."""
    import torch
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
        return name, slug or "cuda"
    return (platform.processor() or platform.machine() or "cpu"), "cpu"


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def executor_factory(loaded, device, seed: int = 0, kernel_backend: str | None = None,
                     speculative_model: str | None = None, max_num_speculative_tokens: int = 0,
                     tree=None):
    """A factory building engine executors of an already loaded model (several factories, with
    and without drafters, share its weights); with `tree` (a TreeSpec), executors that
    draft token trees of up to max_num_speculative_tokens tokens."""
    from engine.builder import build_model_executor, load_draft

    draft = tree if tree is not None else load_draft(speculative_model, loaded, device, seed)

    def factory(block_size: int, num_blocks: int, num_host_blocks: int):
        return build_model_executor(loaded, num_blocks, num_host_blocks, block_size, device, seed,
                              kernel_backend, draft=draft,
                              max_num_speculative_tokens=max_num_speculative_tokens)

    return factory


def tree_setup(method: str, ks: list[int], medusa_heads: str | None = None):
    """For a token-tree drafter ("medusa" or "lookahead"): the executor's TreeSpec and
    the tree sizes (tokens verified per sequence) its speculating grid points run, for the draft
    depths `ks`: Medusa's whole default tree at each depth (its heads bound the depth);
    lookahead (W = G = 4) at the deepest k whose tokens fit a tree mask, N = k + 1, in units of
    N - 1 tokens: 1, 2 and W window columns (always filled), and W + G (the guesses as many as
    its n-gram pool holds, the window the rest)."""
    from policies.speculation.drafters import LOOKAHEAD, MEDUSA, TreeSpec
    from policies.speculation.trees import MAX_TREE_TOKENS, lookahead_tokens

    if method == MEDUSA.name:
        tree = TreeSpec(method, max(ks), medusa_heads)
        sizes = {TreeSpec(method, k, medusa_heads).num_tokens() for k in ks}
        return tree, sorted(sizes)
    if method != LOOKAHEAD.name:
        raise ValueError(f"tree_setup: method must be {MEDUSA.name!r} or {LOOKAHEAD.name!r}, "
                         f"got {method!r}")
    tree = TreeSpec(method, 1)
    window, guesses = tree.lookahead_window, tree.lookahead_guesses
    fitting = [k for k in ks if lookahead_tokens(window, k + 1, guesses) <= MAX_TREE_TOKENS]
    if not fitting:
        raise ValueError(f"lookahead: no depth of {ks} fits a tree mask ({MAX_TREE_TOKENS} "
                         f"tokens at most, (W + G) x k = {window + guesses} x k)")
    tree = TreeSpec(method, max(fitting))
    return tree, [units * max(fitting) for units in (1, 2, window, window + guesses)]


def profile_name(model: str, speculative_model: str | None) -> str:
    """The profile's file stem: the model's, and `+<drafter>` for an executor with a drafter
    (its steps also run the draft model, so they are another executor's)."""
    def stem(name: str) -> str:
        return Path(name).name if Path(name).expanduser().is_dir() else name
    return stem(model) + (f"+{stem(speculative_model)}" if speculative_model else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="twinserve-profile",
        description="Measure step durations over a designed grid and fit the profiled cost "
                    "model: writes <out-dir>/<device>/<model>.json and .samples.csv")
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if "
                                                       "available)")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--kernel-backend", default=None)
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs per point")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a handful of points (tests)")
    parser.add_argument("--speculative-models", nargs="+", default=[NO_DRAFTER],
                        help="the executors to profile, together: 'none' (no drafter) and/or "
                             "drafters (ngram, a conf/model name or a checkpoint folder), whose "
                             "executors also run the drafter every step and whose grids add "
                             "decodes verifying k drafts; writes <model>.json and "
                             "<model>+<drafter>.json")
    parser.add_argument("--speculative-ks", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8],
                        help="draft lengths of the speculating points (medusa, lookahead: "
                             "draft depths, whose trees' sizes the points verify)")
    parser.add_argument("--medusa-heads", default=None,
                        help="Medusa heads folder (scripts/train_medusa.py; default: seeded "
                             "heads, as many as the deepest k, which cost the same)")
    parser.add_argument("--speed-probe-interval", type=float, default=DEFAULT_INTERVAL_S,
                        help="seconds between speed probes, which normalise every sample to "
                             "the run's median machine speed and give the profile the speed "
                             "reference that twinserve-validate's engine runs use (0: off)")
    parser.add_argument("--out-dir", default=str(DEFAULT_OUT_DIR))
    parser.add_argument("--refit", nargs="+", metavar="PROFILE_JSON",
                        help="re-fit these profiles from their samples CSVs (no measuring)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.refit:
        for path in args.refit:
            try:
                fit = refit(Path(path))["fit"]
            except (OSError, ValueError, KeyError) as error:
                parser.error(f"--refit {path}: cannot re-fit it ({type(error).__name__}: "
                             f"{error}); it needs a profile JSON and its .samples.csv beside it")
            print(f"{path}: R2={fit['r2']:.4f}, per point {fit['mean_abs_point_error']:.2%} "
                  f"(linear), {fit['correction']['loo_point_error']:.2%} with the local "
                  f"correction (each point left out)")
        return 0

    import torch
    import transformers

    from engine.builder import build_prefill_probes, build_speed_probe, resolve_device
    from engine.model_loader import load_model

    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    ks = sorted(set(args.speculative_ks))
    if ks[0] < 1:
        parser.error(f"--speculative-ks must be >= 1, got {ks}")
    if not args.speed_probe_interval >= 0:
        parser.error(f"--speed-probe-interval must be >= 0, got {args.speed_probe_interval}")
    drafters = [None if name == NO_DRAFTER else name
                for name in dict.fromkeys(args.speculative_models)]
    loaded = load_model(args.model, device, args.dtype, args.seed)
    setups, spec_lens = {}, {}
    for drafter in drafters:
        tree, drafter_ks = None, ks if drafter else []
        if drafter in TREE_DRAFTERS:
            tree, drafter_ks = tree_setup(drafter, ks, args.medusa_heads)
        spec_lens[drafter] = drafter_ks
        factory = executor_factory(loaded, device, args.seed, args.kernel_backend, drafter,
                                   max(drafter_ks, default=0), tree)
        setups[profile_name(args.model, drafter)] = (factory, make_grid(
            args.block_sizes, quick=args.quick, speculative_ks=drafter_ks,
            draft_model_lags=tree is None))
    dtype = next(loaded.model.parameters()).dtype
    spec = loaded.spec
    kv_bytes_per_token = 2 * spec.num_key_value_heads * spec.head_dim * dtype.itemsize
    speed_probe, prefill_probes = None, ()
    if args.speed_probe_interval > 0:
        speed_probe = build_speed_probe(loaded, device, args.seed, args.kernel_backend,
                                        args.speed_probe_interval)
        prefill_probes = build_prefill_probes(loaded, device, args.seed, args.kernel_backend)
    profiles = profile_together(setups, repeats=args.repeats, warmup=args.warmup,
                                seed=args.seed, progress=not args.no_progress,
                                kv_bytes_per_token=kv_bytes_per_token, speed_probe=speed_probe,
                                prefill_probes=prefill_probes)
    device_name, device_dir = device_names(device)
    for drafter, (name, prof) in zip(drafters, profiles.items()):
        metadata = {
            "device": device_name, "device_type": device.type,
            "torch_version": torch.__version__, "transformers_version": transformers.__version__,
            "model": profile_name(args.model, None),
            "model_config": dataclasses.asdict(loaded.spec),
            "dtype": str(dtype).removeprefix("torch."),
            # What the tile features were computed with (cpu_noise.tile_features.profile_tiling).
            "attention_tiling": {"kv_bytes_per_token": kv_bytes_per_token,
                                 "tile_bytes": TILE_BYTES},
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": git_commit(), "block_sizes": list(args.block_sizes),
            "repeats": args.repeats, "warmup": args.warmup, "threads": torch.get_num_threads(),
            "grid": "quick" if args.quick else "default", "num_points": len(prof.points),
            "speculative_model": drafter, "speculative_ks": ks if drafter else [],
            "spec_lens": spec_lens[drafter],
            "profiled_with": list(profiles), "profile_wall_time_s": round(prof.wall_time_s, 2),
            "platform": platform.platform(), "python": platform.python_version(),
        }
        content = fit_profile(prof.samples, metadata)
        if prof.speed_reference is not None:
            content["speed_reference"] = prof.speed_reference
        json_path, csv_path = write_profile(content, prof.samples, Path(args.out_dir),
                                            device_dir, name)
        fit = content["fit"]
        print(f"{len(prof.points)} points x {args.repeats} repeats ({len(profiles)} executor(s) "
              f"together, {prof.wall_time_s:.1f} s); R2={fit['r2']:.4f}, mean |rel err| per "
              f"sample {fit['mean_abs_rel_error']:.2%}, per point "
              f"{fit['mean_abs_point_error']:.2%}; wrote {json_path} and {csv_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
