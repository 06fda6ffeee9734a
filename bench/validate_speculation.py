"""Does the simulator predict speculative decoding? For each draft length k (and k = 0) and batch
size, the same workload runs on the engine (the tiny pair, drafting and verifying for real) and
in the simulator (step costs from the executor's profile, acceptances measured on OTHER prompts),
through `twinserve-validate`'s `validate`; compared: the acceptance rate (for token trees, the
acceptance length) and the speedup, each within --gate-pct.

The workload is held-out Python source, all arriving at t = 0, greedy. Jobs run --repeats times
in interleaved rounds so that a burst of load spreads over all of them; the simulator runs
--sim-runs times per engine run, since one simulated run draws each sequence's acceptance from
one measured text and varies by several % from draw to draw.

    python bench/validate_speculation.py                      # draft model, k = 1..8, ~20 minutes
    python bench/validate_speculation.py --drafter ngram --batch-sizes 1
    python bench/validate_speculation.py --drafter medusa     # k = 2, 4 (9- and 33-node trees)
    python bench/validate_speculation.py --drafter medusa --ks 4 --tree '[[0],[0,0],[0,0,0]]'

Needs <profiles>/tiny-pair.json and <profiles>/tiny-pair+<drafter>.json (`make
profile-speculation`, `make profile-token-trees`); writes <out>/speculation.json, .md, .png.
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from tqdm import tqdm  # noqa: E402

import numpy as np  # noqa: E402

from calibration.validate.compare import DEFAULT_GATES, error_pct  # noqa: E402
from calibration.validate.run import validate  # noqa: E402
from policies.speculation.drafters import TREE_DRAFTERS  # noqa: E402  (k: the tree's depth)

DRAFTERS = {"tiny-pair-draft": "tiny-pair-draft", "ngram": "ngram", "medusa": "medusa",
            "lookahead": "lookahead"}
ACCEPTANCE_FILES = {"tiny-pair-draft": "tiny-pair-draft.json", "ngram": "tiny-pair-ngram.json",
                    "medusa": "tiny-pair-medusa.json", "lookahead": "tiny-pair-lookahead.json"}
MEDUSA_HEADS = REPO / "models" / "tiny-pair" / "medusa"
NO_GATES = dict.fromkeys(DEFAULT_GATES)  # every gate off: this script compares its own metrics
COMPARED = ("output_throughput", "spec_acceptance_rate", "mean_tokens_per_decode_step",
            "mean_tpot_ms")


def write_trace(path: Path, num_requests: int, prompt_len: int, output_len: int) -> Path:
    """Every request at t = 0, its prompt a held-out window (offset half a spacing from the
    windows the acceptance statistics were measured on)."""
    from train_tiny_pair import held_out_prompts

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["arrival_time", "prompt_len", "output_len", "prompt_token_ids"])
        for prompt in held_out_prompts(num_requests, prompt_len, offset=0.5):
            writer.writerow([0.0, len(prompt), output_len, " ".join(map(str, prompt))])
    return path


def parse_tree(text: str) -> list[list[int]]:
    """--tree: a JSON list of paths of head ranks ([[0], [0, 0], [1]])."""
    try:
        tree = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"--tree must be JSON, got {text!r}: {error}") from None
    if (not isinstance(tree, list) or not tree or any(
            not isinstance(path, list) or not path or any(
                isinstance(rank, bool) or not isinstance(rank, int) or rank < 0 for rank in path)
            for path in tree)):
        raise argparse.ArgumentTypeError(f"--tree must be a list of paths of non-negative head "
                                         f"ranks ([[0], [0, 0], [1]]), got {text!r}")
    return tree


def per_depth_statistics(acceptance: Path, out: Path) -> Path:
    """A copy of the acceptance statistics without their per-node counts (and the tree)."""
    data = json.loads(acceptance.read_text())
    for entry in [data, *(data.get("sequences") or [])]:
        for key in ("tree_paths", "node_trials", "node_accepts"):
            entry.pop(key, None)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data) + "\n")
    return out


def job_overrides(trace: Path, batch_size: int, k: int, drafter: str, profiles: Path,
                  acceptance: Path, tree: list[list[int]] | None = None) -> list[str]:
    overrides = ["model=tiny-pair", "hardware=cpu", "workload=trace",
                 f"workload.trace_path={trace}", "workload.with_token_ids=true",
                 f"scheduler.max_num_seqs={batch_size}", "kv_cache.block_size=16"]
    if k == 0:
        return [*overrides, f"cost_model.profile={profiles / 'tiny-pair.json'}"]
    if drafter == "medusa":
        overrides.append(f"speculation.medusa_heads={MEDUSA_HEADS}")
        if tree is not None:
            overrides.append(f"speculation.tree={json.dumps(tree).replace(' ', '')}")
    return [*overrides, "speculation=fixed", f"speculation.num_speculative_tokens={k}",
            f"speculation.draft_model={DRAFTERS[drafter]}",
            f"speculation.acceptance_profile={acceptance}",
            f"cost_model.profile={profiles / f'tiny-pair+{drafter}.json'}"]


def median_result(runs: list[dict]) -> dict:
    """One job's repeated validations as one: the median of each compared metric on each side,
    and the engine's throughput spread ((max - min) / median, %)."""
    metrics = {}
    for name in COMPARED:
        engine = float(np.median([run["metrics"][name]["engine"] for run in runs]))
        sim = float(np.median([run["metrics"][name]["sim"] for run in runs]))
        metrics[name] = {"engine": engine, "sim": sim, "error_pct": error_pct(engine, sim)}
    throughputs = [run["metrics"]["output_throughput"]["engine"] for run in runs]
    spread = (max(throughputs) - min(throughputs)) / float(np.median(throughputs)) * 100
    return {"metrics": metrics, "engine_spread_pct": spread, "num_runs": len(runs)}


def speculation_rows(results: dict[tuple[int, int], dict]) -> list[dict]:
    """One row per (batch size, k >= 1) of median results: acceptance rate and speedup over
    k = 0 on each side, and the simulator's errors."""
    rows = []
    for (batch_size, k), result in sorted(results.items()):
        if k == 0:
            continue
        base = results[(batch_size, 0)]["metrics"]["output_throughput"]
        metrics = result["metrics"]
        engine_speedup = metrics["output_throughput"]["engine"] / base["engine"]
        sim_speedup = metrics["output_throughput"]["sim"] / base["sim"]
        acceptance = metrics["spec_acceptance_rate"]
        tokens = metrics["mean_tokens_per_decode_step"]
        rows.append({
            "batch_size": batch_size, "k": k,
            "engine_acceptance": acceptance["engine"], "sim_acceptance": acceptance["sim"],
            "acceptance_error_pct": acceptance["error_pct"],
            "engine_tokens_per_step": tokens["engine"], "sim_tokens_per_step": tokens["sim"],
            "tokens_per_step_error_pct": tokens["error_pct"],
            "engine_speedup": engine_speedup, "sim_speedup": sim_speedup,
            "speedup_error_pct": error_pct(engine_speedup, sim_speedup),
            "throughput_error_pct": metrics["output_throughput"]["error_pct"],
            # The engine's own run-to-run spread of the two throughputs the speedup divides.
            "engine_spread_pct": max(result.get("engine_spread_pct", 0.0),
                                     results[(batch_size, 0)].get("engine_spread_pct", 0.0)),
        })
    return rows


def summarize(rows: list[dict], gate_pct: float, trees: bool = False) -> dict:
    """The largest errors and the gate: on the acceptance rate and the speedup, or with
    `trees` (a token-tree drafter) on the acceptance length (tokens per step) and the
    speedup."""
    def worst(key):
        errors = [abs(row[key]) for row in rows if row[key] is not None]
        return max(errors) if len(errors) == len(rows) else None
    acceptance, speedup = worst("acceptance_error_pct"), worst("speedup_error_pct")
    tokens = worst("tokens_per_step_error_pct")
    passed = all(e is not None and e <= gate_pct
                 for e in ((tokens if trees else acceptance), speedup))
    return {"num_jobs": len(rows), "max_abs_acceptance_error_pct": acceptance,
            "max_abs_tokens_per_step_error_pct": tokens,
            "max_abs_speedup_error_pct": speedup,
            "max_abs_throughput_error_pct": worst("throughput_error_pct"),
            "gated_on": "tokens_per_step" if trees else "acceptance_rate",
            "gate_pct": gate_pct, "passed": passed}


def markdown(rows: list[dict], summary: dict, command: str) -> str:
    lines = ["# Speculative decoding: simulator vs engine\n", f"`{command}`\n",
             "| batch | k | acceptance engine | sim | error % | tokens/step engine | sim | "
             "error % | speedup engine | sim | error % | throughput error % | "
             "engine spread % |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(
            f"| {row['batch_size']} | {row['k']} | {row['engine_acceptance']:.3f} | "
            f"{row['sim_acceptance']:.3f} | {_pct(row['acceptance_error_pct'])} | "
            f"{row['engine_tokens_per_step']:.2f} | {row['sim_tokens_per_step']:.2f} | "
            f"{_pct(row['tokens_per_step_error_pct'])} | {row['engine_speedup']:.2f} | {row['sim_speedup']:.2f} | "
            f"{_pct(row['speedup_error_pct'])} | {_pct(row['throughput_error_pct'])} | "
            f"{row['engine_spread_pct']:.1f} |")
    if summary.get("engine_clock") == "profile speed":
        low, high = summary["machine_speed_factor_range"]
        lines.append(f"\nEngine steps timed at the profiles' machine speed "
                     f"(calibration/cpu_noise/speed.py); "
                     f"the machine ran {low:.2f}-{high:.2f}x the profile's step times.")
    lines.append(f"\nLargest |error|: acceptance {_pct(summary['max_abs_acceptance_error_pct'])} "
                 f"%, tokens/step {_pct(summary['max_abs_tokens_per_step_error_pct'])} "
                 f"%, speedup {_pct(summary['max_abs_speedup_error_pct'])} % (gate "
                 f"{summary['gate_pct']:g} %): {'passed' if summary['passed'] else 'FAILED'}.\n")
    return "\n".join(lines)


def _pct(value) -> str:
    return "inf" if value is None else f"{value:+.1f}"


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for batch_size in sorted({row["batch_size"] for row in rows}):
        own = [row for row in rows if row["batch_size"] == batch_size]
        ks = [row["k"] for row in own]
        line, = right.plot(ks, [row["engine_speedup"] for row in own], "o-",
                           label=f"engine, batch {batch_size}")
        right.plot(ks, [row["sim_speedup"] for row in own], "x--", color=line.get_color(),
                   label=f"sim, batch {batch_size}")
        left.plot(ks, [row["engine_acceptance"] for row in own], "o-", color=line.get_color(),
                  label=f"engine, batch {batch_size}")
        left.plot(ks, [row["sim_acceptance"] for row in own], "x--", color=line.get_color(),
                  label=f"sim, batch {batch_size}")
    left.set(xlabel="draft tokens k", ylabel="draft acceptance rate", ylim=(0, 1))
    right.axhline(1.0, color="grey", linewidth=0.8)
    right.set(xlabel="draft tokens k", ylabel="speedup over no speculation")
    for axis in (left, right):
        axis.grid(alpha=0.3)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def table(rows: list[dict], summary: dict) -> Table:
    out = Table(title=f"speculative decoding: simulator vs engine (gate ±{summary['gate_pct']:g} %)")
    for name in ("batch", "k", "accept eng", "accept sim", "err %", "tok/step eng",
                 "tok/step sim", "err %", "speedup eng", "speedup sim", "err %",
                 "eng spread %"):
        out.add_column(name, justify="right")
    for row in rows:
        out.add_row(str(row["batch_size"]), str(row["k"]), f"{row['engine_acceptance']:.3f}",
                    f"{row['sim_acceptance']:.3f}", _pct(row["acceptance_error_pct"]),
                    f"{row['engine_tokens_per_step']:.2f}", f"{row['sim_tokens_per_step']:.2f}",
                    _pct(row["tokens_per_step_error_pct"]),
                    f"{row['engine_speedup']:.2f}", f"{row['sim_speedup']:.2f}",
                    _pct(row["speedup_error_pct"]), f"{row['engine_spread_pct']:.1f}")
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drafter", default="tiny-pair-draft", choices=DRAFTERS)
    parser.add_argument("--ks", type=int, nargs="+", default=None,
                        help="draft lengths (medusa, lookahead: tree depths); default 1..8, "
                             "for the token trees 2 and 4")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--profiles", type=Path, default=None,
                        help="folder with tiny-pair.json and tiny-pair+<drafter>.json (default "
                             "profiles/cpu, for medusa and lookahead profiles/token-trees/cpu)")
    parser.add_argument("--acceptance", type=Path, default=None,
                        help="acceptance statistics (default profiles/speculation/"
                             "tiny-pair-<drafter>.json, from bench/speculative.py)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of every job (interleaved rounds); medians count")
    parser.add_argument("--sim-runs", type=int, default=16,
                        help="simulator runs per engine run (each its own acceptance and "
                             "residual draws: one run draws 16 of the measured texts' rates); "
                             "the simulator's value is their mean")
    parser.add_argument("--tree", type=parse_tree, default=None,
                        help="medusa: the tree as a JSON list of paths of head ranks "
                             "('[[0],[0,0],[1]]'; default: top 3, 2, 2, 1 per head)")
    parser.add_argument("--per-depth", action="store_true",
                        help="medusa: the simulator draws per depth (the statistics' per-node "
                             "counts dropped)")
    parser.add_argument("--gate-pct", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=REPO / "validation" / "speculation")
    return parser


def checked_acceptance(parser: argparse.ArgumentParser, args, trees: bool) -> Path:
    """Fill the drafter's defaults into `args` and check them; the acceptance statistics' file."""
    if args.ks is None:
        args.ks = [2, 4] if trees else list(range(1, 9))
    if args.profiles is None:
        args.profiles = REPO / "profiles" / ("token-trees" if trees else "") / "cpu"
    if min(args.ks) < 1 or min(args.batch_sizes) < 1 or min(args.num_requests, args.repeats,
                                                             args.sim_runs) < 1:
        parser.error("--ks, --batch-sizes, --num-requests, --repeats and --sim-runs take "
                     "integers >= 1")
    acceptance = args.acceptance or REPO / "profiles" / "speculation" / ACCEPTANCE_FILES[
        args.drafter]
    needed = [args.profiles / "tiny-pair.json", args.profiles / f"tiny-pair+{args.drafter}.json",
              acceptance]
    missing = [str(path) for path in needed if not path.is_file()]
    if missing:
        parser.error(f"missing {', '.join(missing)} (make profile-speculation, or for medusa "
                     f"and lookahead make profile-token-trees, writes the profiles, "
                     f"python bench/speculative.py the acceptance statistics)")

    if args.drafter != "medusa" and (args.tree is not None or args.per_depth):
        parser.error("--tree and --per-depth are for --drafter medusa")
    if args.per_depth:
        acceptance = per_depth_statistics(acceptance, args.out / "acceptance-per-depth.json")
    return acceptance


def run_rounds(args, trace, jobs: list[tuple[int, int]], acceptance: Path
               ) -> dict[tuple[int, int], list[dict]]:
    """Every job's validations, `args.repeats` interleaved rounds of them."""
    runs: dict[tuple[int, int], list[dict]] = {job: [] for job in jobs}
    with tqdm(total=len(jobs) * args.repeats, desc="validation runs", unit="run") as bar:
        for repeat in range(args.repeats):
            for batch_size, k in jobs:
                bar.set_postfix_str(f"round {repeat + 1}, batch {batch_size}, k {k}")
                # Each round's simulator runs draw from seeds of their own.
                overrides = [*job_overrides(trace, batch_size, k, args.drafter, args.profiles,
                                            acceptance, args.tree), f"seed={repeat}",
                             f"sim_seed={repeat * args.sim_runs}"]
                runs[(batch_size, k)].append(validate(
                    overrides, args.out / f"b{batch_size}-k{k}" / f"run{repeat}",
                    dict(NO_GATES), console=Console(quiet=True), sim_runs=args.sim_runs))
                bar.update(1)
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    trees = args.drafter in TREE_DRAFTERS
    acceptance = checked_acceptance(parser, args, trees)
    console = Console()
    trace = write_trace(args.out / "trace.csv", args.num_requests, args.prompt_len,
                        args.output_len)
    jobs = [(batch_size, k) for batch_size in args.batch_sizes for k in [0, *args.ks]]
    runs = run_rounds(args, trace, jobs, acceptance)
    rows = speculation_rows({job: median_result(job_runs) for job, job_runs in runs.items()})
    summary = summarize(rows, args.gate_pct, trees)
    # How much slower than at profiling the machine ran during the engine runs (their steps are
    # timed at the profile's speed when the profiles carry a speed reference).
    factors = [run["engine_conditions"].get("speed_factor_median", 1.0)
               for job_runs in runs.values() for run in job_runs]
    summary["machine_speed_factor_range"] = [min(factors), max(factors)]
    summary["engine_clock"] = runs[jobs[0]][0]["engine_conditions"]["clock"]
    command = "python bench/validate_speculation.py " + " ".join(argv if argv is not None
                                                                  else sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "speculation.json").write_text(json.dumps(
        {"summary": summary, "rows": rows, "drafter": args.drafter, "tree": args.tree,
         "per_depth": args.per_depth, "acceptance_statistics": str(acceptance), "command": command}, indent=2) + "\n")
    (args.out / "speculation.md").write_text(markdown(rows, summary, command))
    plot(rows, args.out / "speculation.png")
    console.print(table(rows, summary))
    console.print(f"largest |error|: acceptance {_pct(summary['max_abs_acceptance_error_pct'])} %, "
                  f"tokens/step {_pct(summary['max_abs_tokens_per_step_error_pct'])} %, "
                  f"speedup {_pct(summary['max_abs_speedup_error_pct'])} %; results in {args.out}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
