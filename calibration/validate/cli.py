"""`twinserve-validate`: run one workload on the engine and on the profiled simulator, and compare
(docs/calibration.md describes the outputs, gates, grids, --real and --silicon).

    twinserve-validate --out validation/ cost_model.profile=profiles/cpu/tiny-llama.json \\
        model=tiny-llama hardware=cpu workload.with_token_ids=true workload.num_requests=50
    twinserve-validate --real data/real-runs/llmservingsim/RTX4090/Llama-3.1-8B --out out/
    twinserve-validate --silicon --system h100_sxm --model Qwen/Qwen3-32B --precision bf16

Both runs share one config but the backend; the simulator predicts each step from the profile
alone. Exit status: 0 when every gated error is within its gate, 1 when any is not, 2 on bad
input.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from calibration.validate.compare import UNSET
from calibration.validate.grid import tabulate, validate_grid
from calibration.validate.compare import ValidationInputError
from calibration.validate.run import (DEFAULT_ENGINE_REPEATS, DEFAULT_SIM_RUNS,
                                          check_engine_repeats, validate)
from calibration.validate.sweep import expand_sweep


def gate_percentage(text: str) -> float | None:
    """A --gate-*-pct argument: a percentage >= 0, or off/none/null for no gate."""
    if text.lower() in ("none", "off", "null"):
        return None
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"a gate is a percentage >= 0 or 'off', got {text!r}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="twinserve-validate",
        description="Run one workload on the engine and on the profiled simulator and compare "
                    "their metrics. Other arguments are Hydra overrides, as for twinserve.")
    parser.add_argument("overrides", nargs="*",
                        help="Hydra overrides, e.g. model=tiny-llama (with --tabulate: "
                             "validation directories)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default: ./validation); with --silicon a JSON file "
                             "(default: none written)")
    parser.add_argument("--tabulate", action="store_true",
                        help="run nothing: the arguments are directories of validations run "
                             "before (each with a validation.json); write one table of them, "
                             "grid.md, grid.csv and grid.json, to --out")
    parser.add_argument("--real", nargs="+", action="extend", metavar="RUN",
                        help="replay these measured runs (files, or folders holding "
                             "vllm_requests.jsonl) through the simulator and compare per load "
                             "stage; the runs' engine settings, then the overrides, configure it")
    silicon = parser.add_argument_group("--silicon: NVIDIA's measured vLLM rows")
    silicon.add_argument("--silicon", action="store_true",
                         help="replay the rows of data/gpu/aiconfigurator/silicon_vllm.csv (agg "
                              "only) through the simulator; the overrides apply to every row")
    silicon.add_argument("--system", help="only rows of this system (h100_sxm, h200_sxm, ...)")
    silicon.add_argument("--model", help="only rows of this HF model (Qwen/Qwen3-32B, ...)")
    silicon.add_argument("--precision", help="only rows of this weight precision (bf16, fp8)")
    silicon.add_argument("--limit", type=int, help="at most this many rows (after the filters)")
    silicon.add_argument("--waves", type=int, default=None,
                         help="requests per row = waves x the row's concurrency (default: "
                              "calibration.silicon.DEFAULT_WAVES)")
    silicon.add_argument("--engine-settings", default=None,
                         help="the servers' batch limits: aiconfigurator (the generator's "
                              "flags, default) or vllm-serve (vLLM's defaults)")
    silicon.add_argument("--silicon-csv", help="another silicon CSV of the same columns")
    parser.add_argument("--profile", help="the profile JSON (same as cost_model.profile=...)")
    parser.add_argument("--wall-clock", action="store_true",
                        help="time the engine's steps as measured, not normalised to the "
                             "profile's machine speed by the speed probe")
    parser.add_argument("--sim-runs", type=int, default=DEFAULT_SIM_RUNS,
                        help="simulator runs of the workload, each with its own residual and "
                             "acceptance draws (sim_seed, sim_seed + 1, ...); the simulator's "
                             f"value of a metric is its mean over them (default "
                             f"{DEFAULT_SIM_RUNS})")
    # Checked in main (check_engine_repeats): a bad value is one line naming the option.
    parser.add_argument("--engine-repeats", default=DEFAULT_ENGINE_REPEATS,
                        help="engine runs of the workload (same config and seed; default "
                             f"{DEFAULT_ENGINE_REPEATS}); with more than one, the engine's value "
                             "of a metric is its mean over them, reported with their spread "
                             "(relative half-range, %%) and a verdict: within gate, within "
                             "engine noise, outside both")
    parser.add_argument("--gate-mean-pct", type=gate_percentage, default=UNSET,
                        help="|error| %% gate on means/medians of TTFT, TPOT, e2e and throughputs "
                             "(default 3; 'off' disables a gate)")
    parser.add_argument("--gate-p99-pct", type=gate_percentage, default=UNSET,
                        help="|error| %% gate on p99 TPOT, ITL and e2e (default 8)")
    parser.add_argument("--gate-p99-ttft-pct", type=gate_percentage, default=UNSET,
                        help="|error| %% gate on p99 TTFT (default 10)")
    parser.add_argument("--gate-preemptions-pct", type=gate_percentage,
                        default=UNSET,
                        help="|error| %% gate on the preemption count (default 5)")
    # Intermixed: overrides and options in any order, as Hydra users write them.
    return parser.parse_intermixed_args(argv)


def main_real(args: argparse.Namespace, argv: list[str] | None) -> int:
    """--real: the runs replayed through the simulator (arguments with '=' are overrides)."""
    from calibration.realrun.cli import is_override, validate_real

    arguments = [*args.real, *args.overrides]
    runs = [argument for argument in arguments if not is_override(argument)]
    overrides = [argument for argument in arguments if is_override(argument)]
    if args.profile:
        overrides.append(f"cost_model.profile={args.profile}")
    command = shlex.join(["twinserve-validate", *(argv if argv is not None else sys.argv[1:])])
    try:
        validate_real(runs, args.out, overrides, command=command)
    except ValueError as error:  # RealRunError, a bad override or config value
        print(f"twinserve-validate: error: {error}", file=sys.stderr)
        return 2
    print(f"results in {args.out}")
    return 0


def main_silicon(args: argparse.Namespace) -> int:
    """--silicon: the silicon rows replayed; the table and summary printed, --out JSON written."""
    import json

    from calibration import silicon
    from calibration.silicon_feasibility import beyond_line, feasibility

    def refuse(message: str) -> int:
        print(f"twinserve-validate: error: {message}", file=sys.stderr)
        return 2

    if args.limit is not None and args.limit < 1:
        return refuse(f"--limit must be >= 1, got {args.limit}")
    waves = silicon.DEFAULT_WAVES if args.waves is None else args.waves
    if waves < 1:
        return refuse(f"--waves must be >= 1, got {waves}")
    settings = args.engine_settings or silicon.DEFAULT_ENGINE_SETTINGS
    if settings not in silicon.ENGINE_SETTINGS:
        return refuse(f"--engine-settings must be one of {', '.join(silicon.ENGINE_SETTINGS)}, "
                      f"got {settings!r}")
    if args.precision is not None and args.precision not in silicon.PRECISIONS:
        return refuse(f"--precision must be one of {', '.join(silicon.PRECISIONS)}, got "
                      f"{args.precision!r}")
    overrides = list(args.overrides) + ([f"cost_model.profile={args.profile}"]
                                        if args.profile else [])
    try:
        rows = silicon.select_rows(silicon.read_silicon_rows(args.silicon_csv),
                                   system=args.system, model=args.model,
                                   precision=args.precision, limit=args.limit)
        if not rows:
            return refuse("no silicon row matches --system/--model/--precision")
        report = silicon.compare_rows(rows, overrides, waves, settings)
    except ValueError as error:   # SiliconDataError, a bad override or config value
        return refuse(str(error))
    by_id = {row.id: row for row in rows}
    loads = [feasibility(by_id[result["id"]], settings) for result in report["rows"]]
    for result, load in zip(report["rows"], loads):
        result["kernel_load"] = load["load"]   # (seconds of forward kernels per second)
    for line in silicon.table_lines(report):
        print(line)
    beyond = beyond_line(loads)
    if beyond is not None:
        print(beyond)
    for skipped in report["skipped"]:
        print(f"skipped {skipped['id']}: {skipped['reason']}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"results in {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.silicon:
        return main_silicon(args)
    if args.out is None:
        args.out = Path("validation")
    if args.real:
        return main_real(args, argv)
    if args.tabulate:
        command = shlex.join(["twinserve-validate", *(argv if argv is not None else sys.argv[1:])])
        try:
            tabulate([Path(d) for d in args.overrides], args.out, command)
        except ValueError as error:
            print(f"twinserve-validate: error: {error}", file=sys.stderr)
            return 2
        print(f"results in {args.out}")
        return 0
    overrides = list(args.overrides)
    if args.profile:
        overrides.append(f"cost_model.profile={args.profile}")
    gates = {"mean_pct": args.gate_mean_pct, "p99_pct": args.gate_p99_pct,
             "p99_ttft_pct": args.gate_p99_ttft_pct,
             "preemptions_pct": args.gate_preemptions_pct}
    try:
        engine_repeats = check_engine_repeats(args.engine_repeats)
    except ValidationInputError as error:
        print(f"twinserve-validate: error: {error}", file=sys.stderr)
        return 2
    try:
        if len(expand_sweep(overrides)) > 1:
            command = shlex.join(["twinserve-validate",
                                  *(argv if argv is not None else sys.argv[1:])])
            grid = validate_grid(overrides, args.out, gates, command=command,
                                 normalize_speed=not args.wall_clock, sim_runs=args.sim_runs,
                                 engine_repeats=engine_repeats)
            print(f"results in {args.out}")
            failed = grid["failures"]
            if failed:
                print(f"twinserve-validate: gate failed in {len(failed)} of "
                      f"{grid['summary']['num_jobs']} jobs: "
                      f"{', '.join(str(job) for job in failed)}", file=sys.stderr)
                return 1
            return 0
        result = validate(overrides, args.out, gates, normalize_speed=not args.wall_clock,
                          sim_runs=args.sim_runs, engine_repeats=engine_repeats)
    except ValueError as error:  # ValidationInputError, ProfileError, a bad config value
        print(f"twinserve-validate: error: {error}", file=sys.stderr)
        return 2
    print(f"results in {args.out}")
    if result["failures"]:
        print("twinserve-validate: gate failed:\n  " + "\n  ".join(result["failures"]),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
