"""twinserve-profile: measure step durations on this device over the designed grid (grid.py),
fit the profiled cost model (fit.py), and write `profiles/<device>/<model>.json` with the raw
samples beside it (`<model>.samples.csv`).

    python -m calibration.profiler --model tiny-llama            # the default grid, 10 repeats
    python -m calibration.profiler --quick --out-dir /tmp/prof   # a handful of points
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
from pathlib import Path

from calibration.cpu_noise.engine_timing import build_prefill_probes, build_speed_probe
from calibration.cpu_noise.speed import DEFAULT_INTERVAL_S
from calibration.profiler.fit import fit_profile
from calibration.profiler.grid import make_grid, profile_together
from kernels.tiling import TILE_BYTES
from policies.speculation.drafters import TREE_DRAFTERS   # points that verify whole token trees
from sim.cost.profiled.expert_features import (EXPERT_FEATURES, ExpertRouting, profile_routing,
                                          sample_expert_features)
from sim.cost.profiled.step_features import STEP_FEATURES

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT_DIR = REPO_ROOT / "profiles"
NO_DRAFTER = "none"  # --speculative-models: the executor without a drafter


def read_samples(csv_path: Path) -> list[dict]:
    """A samples CSV as write_profile wrote it; a core step feature the file predates reads 0,
    as the profiler's steps did not have it then."""
    with Path(csv_path).open(newline="") as handle:
        return [{**dict.fromkeys(STEP_FEATURES, 0.0),
                 **{key: value if key == "kind" else float(value)
                    for key, value in row.items() if value != ""}}
                for row in csv.DictReader(handle)]


def refit(json_path: Path, expert_feature: bool = False) -> dict:
    """Re-fit a profile from its samples CSV, keeping its metadata and speed reference, so that
    a change of the fit needs no measuring; `expert_feature` adds experts_touched."""
    json_path = Path(json_path)
    old = json.loads(json_path.read_text())
    csv_path = json_path.with_name(json_path.stem + ".samples.csv")
    samples = read_samples(csv_path)
    if expert_feature:
        routing = profile_routing(old.get("metadata") or {})
        if routing is None:
            raise ValueError("--expert-feature: its metadata.model_config has no num_experts")
        for sample in samples:
            sample.update(zip(EXPERT_FEATURES, sample_expert_features(sample, routing)))
    content = fit_profile(samples, old.get("metadata"))
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
    """A factory of engine executors sharing one loaded model's weights, with a drafter or a
    token tree (`tree`) of up to max_num_speculative_tokens tokens."""
    from engine.builder import build_model_executor, load_draft

    draft = tree if tree is not None else load_draft(speculative_model, loaded, device, seed)

    def factory(block_size: int, num_blocks: int, num_host_blocks: int):
        return build_model_executor(loaded, num_blocks, num_host_blocks, block_size, device, seed,
                              kernel_backend, draft=draft,
                              max_num_speculative_tokens=max_num_speculative_tokens)

    return factory


def tree_setup(method: str, ks: list[int], medusa_heads: str | None = None):
    """For a token-tree drafter ("medusa" or "lookahead"): the executor's TreeSpec and the tree
    sizes its speculating grid points verify for the draft depths `ks` (lookahead at the deepest
    k whose tokens fit a tree mask)."""
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


def build_parser() -> argparse.ArgumentParser:
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
    parser.add_argument("--expert-feature", action="store_true",
                        help="a mixture of experts' samples also carry experts_touched "
                             "(sim/cost/profiled/expert_features.py) and its profile is fitted with "
                             "it; off by default: on tiny-moe it improved the fit but not the "
                             "predictions of held-out steps (docs/calibration.md)")
    parser.add_argument("--out-dir", default=str(DEFAULT_OUT_DIR))
    parser.add_argument("--refit", nargs="+", metavar="PROFILE_JSON",
                        help="re-fit these profiles from their samples CSVs (no measuring)")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def refit_profiles(parser: argparse.ArgumentParser, paths: list[str],
                   expert_feature: bool) -> int:
    """--refit: re-fit each profile from its samples and print the new fit's errors."""
    for path in paths:
        try:
            fit = refit(Path(path), expert_feature)["fit"]
        except (OSError, ValueError, KeyError) as error:
            parser.error(f"--refit {path}: cannot re-fit it ({type(error).__name__}: "
                         f"{error}); it needs a profile JSON and its .samples.csv beside it")
        print(f"{path}: R2={fit['r2']:.4f}, per point {fit['mean_abs_point_error']:.2%} "
              f"(linear), {fit['correction']['loo_point_error']:.2%} with the local "
              f"correction (each point left out)")
    return 0


def executor_setups(args, loaded, device, drafters: list[str | None],
                    ks: list[int]) -> tuple[dict, dict]:
    """Each executor's (factory, grid) by profile name, and each drafter's speculating lengths."""
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
    return setups, spec_lens


def speed_probes(args, loaded, device) -> tuple:
    """(speed probe, prefill probes) for --speed-probe-interval > 0, else (None, ())."""
    if args.speed_probe_interval <= 0:
        return None, ()
    from engine.builder import executor_builder

    new_executor = executor_builder(loaded, device, args.seed, args.kernel_backend)
    return (build_speed_probe(new_executor, args.seed, args.speed_probe_interval),
            build_prefill_probes(new_executor, args.seed))


def profile_metadata(args, loaded, device, device_name: str, dtype, kv_bytes_per_token: int,
                     drafter: str | None, ks: list[int], spec_lens: dict, profiles: dict,
                     prof) -> dict:
    """What one profile records of how it was measured."""
    import torch
    import transformers

    return {
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.refit:
        return refit_profiles(parser, args.refit, args.expert_feature)

    import torch

    from engine.builder import resolve_device
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
    setups, spec_lens = executor_setups(args, loaded, device, drafters, ks)
    dtype = next(loaded.model.parameters()).dtype
    spec = loaded.spec
    kv_bytes_per_token = 2 * spec.num_key_value_heads * spec.head_dim * dtype.itemsize
    routing = None
    if args.expert_feature:
        if not spec.is_moe:
            parser.error(f"--expert-feature: {args.model} is not a mixture of experts")
        routing = ExpertRouting(spec.num_experts, spec.num_experts_per_tok)
    speed_probe, prefill_probes = speed_probes(args, loaded, device)
    profiles = profile_together(setups, repeats=args.repeats, warmup=args.warmup,
                                seed=args.seed, progress=not args.no_progress,
                                kv_bytes_per_token=kv_bytes_per_token, speed_probe=speed_probe,
                                prefill_probes=prefill_probes,
                                routing=routing)
    device_name, device_dir = device_names(device)
    for drafter, (name, prof) in zip(drafters, profiles.items()):
        metadata = profile_metadata(args, loaded, device, device_name, dtype, kv_bytes_per_token,
                                    drafter, ks, spec_lens, profiles, prof)
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
