"""The real-run loop's shared steps, for any server twinserve-bench reaches: a server as a child
process, two loads benched in alternation (each `repeats` times, for the server's own spread),
terms fitted with twinserve-calibrate on one load and the other load replayed with them, and the
table (bench/cpu_serving_loop.py: twinserve-serve; bench/vllm_cpu_loop.py: vLLM's CPU build)."""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx

# The table's rows; the claim is about the means.
TABLE_METRICS = ("mean_ttft_ms", "mean_tpot_ms", "mean_e2el_ms",
                 "median_ttft_ms", "median_tpot_ms", "median_e2el_ms")
GATE_PCT = 10.0
# Request lengths of both loads: tiny-llama's prompts and outputs of a chat-like spread.
LENGTHS = ["workload.prompt_len.mean=128", "workload.prompt_len.sigma=0.5",
           "workload.prompt_len.min=16", "workload.prompt_len.max=512",
           "workload.output_len.mean=64", "workload.output_len.sigma=0.5",
           "workload.output_len.min=8", "workload.output_len.max=256"]
HEALTH_POLL_S = 1.0


def loop_arguments(description: str, out: Path, light_requests: int, heavy_requests: int,
                   heavy_help: str) -> argparse.ArgumentParser:
    """The two loop scripts' shared options (output folder, repeats, warm-up, the two loads);
    each adds its server's own; check_loop_arguments checks them after parsing."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path,
                        default=out / datetime.now().strftime("%Y-%m-%d_%H-%M-%S"))
    parser.add_argument("--repeats", type=int, default=4, help="runs of each load (>= 2)")
    parser.add_argument("--warmup", type=int, default=8,
                        help="unrecorded requests before each run (twinserve-bench --warmup)")
    parser.add_argument("--light-rate", type=float, default=2.0)
    parser.add_argument("--light-requests", type=int, default=light_requests)
    parser.add_argument("--heavy-rate", type=float, default=6.0, help=heavy_help)
    parser.add_argument("--heavy-requests", type=int, default=heavy_requests)
    return parser


def check_loop_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace,
                         counts: tuple[str, ...] = ()) -> argparse.Namespace:
    """`args` with the shared options (and the `counts` named) in range, else the parser's
    one-line error naming the flag."""
    for name in ("light_requests", "heavy_requests", *counts):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("light_rate", "heavy_rate"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.repeats < 2:
        parser.error("--repeats must be >= 2: the spread needs two runs of each load")
    return args


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """A server as a child process in its own process group, logging to `log_path`: started,
    waited for on /health (bounded), stopped with every process it started on exit, also on
    error."""

    def __init__(self, command: list[str], env: dict, port: int, log_path: Path,
                 startup_timeout_s: float, name: str):
        self.command, self.env, self.name = command, env, name
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "ServerProcess":
        print(f"starting {self.name}: {' '.join(self.command)}", flush=True)
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                            env=self.env, cwd=self.log_path.parent,
                                            start_new_session=True)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.process.returncode}) while "
                                   f"starting: {self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=HEALTH_POLL_S).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(HEALTH_POLL_S)
        raise RuntimeError(f"{self.name} did not answer /health within --startup-timeout "
                           f"{self.startup_timeout_s:.0f} s; its log: {self.log_path}")

    def log_tail(self) -> str:
        lines = self.log_path.read_text(errors="replace").strip().splitlines()
        return lines[-1][:300] if lines else "(no output)"

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after a bounded wait."""
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        except ProcessLookupError:
            pass


@dataclass
class Load:
    """One benched load: its name, Poisson rate (req/s), request count and workload seed, and
    its requests' lengths (and classes) as workload overrides."""
    name: str
    rate: float
    requests: int
    seed: int
    workload: tuple[str, ...] = tuple(LENGTHS)

    def overrides(self) -> list[str]:
        return [f"seed={self.seed}", f"workload.num_requests={self.requests}",
                f"workload.rate={self.rate}", *self.workload]


def bench_loads(url: str, loads: list[Load], repeats: int, warmup: int, runs_dir: Path,
                engine_settings: dict | None = None) -> dict[str, list[Path]]:
    """Each load `repeats` times, the loads alternating (light, heavy, light, ...: a shared
    machine's speed drifts by tens of % within minutes, and a load benched in one block would be
    compared with the other at another speed); the run files per load. `engine_settings` are
    recorded over the server's own (twinserve-bench --engine-setting)."""
    from sim.tools.bench_client import bench, parse_args as bench_args

    runs: dict[str, list[Path]] = {load.name: [] for load in loads}
    for repeat in range(1, repeats + 1):
        for load in loads:
            out = runs_dir / f"{load.name}-{repeat}.json"
            argv = ["--endpoint", url, "--out", str(out), "--warmup", str(warmup),
                    *(f"--engine-setting={k}={json.dumps(v)}"
                      for k, v in (engine_settings or {}).items()),
                    *load.overrides()]
            print(f"\n$ twinserve-bench {' '.join(argv)}", flush=True)
            result = bench(bench_args(argv))
            if result["failed"]:
                raise RuntimeError(f"{out}: {result['failed']} requests failed: "
                                   f"{next(e for e in result['errors'] if e)}")
            # A constant rate is one load stage: labelled, so that a client that sent a burst
            # late on a busy machine is not read as a change of rate.
            result["stages"] = [load.name] * result["num_prompts"]
            out.write_text(json.dumps(result, indent=1))
            runs[load.name].append(out)
    return runs


def spread_pct(values: list[float]) -> float:
    """Half the range of the repeats over their mean (the engine's spread in validate)."""
    return 50.0 * (max(values) - min(values)) / statistics.fmean(values)


def fit_terms(fit_runs: list[Path], overrides: list[str], terms: tuple[str, ...],
              metrics: tuple[str, ...], fit_path: Path) -> tuple[dict, list[str]]:
    """Fit `terms` to `metrics` on `fit_runs` (twinserve-calibrate, its file at `fit_path`):
    (the fitted values, the overrides that set them)."""
    from calibration.realrun import calibrate

    argv = ["--real", *map(str, fit_runs), "--terms", ",".join(terms),
            "--metrics", ",".join(metrics), "--out", str(fit_path), *overrides]
    print(f"\n$ twinserve-calibrate {' '.join(argv)}", flush=True)
    if calibrate.main(argv) != 0:
        raise RuntimeError(f"twinserve-calibrate on {fit_path.stem} failed")
    fit_file = json.loads(fit_path.read_text())
    fitted = {**fit_file["terms"], **fit_file["config"]}
    return fitted, [f"{calibrate.term_key(term)}={value!r}" for term, value in fitted.items()]


def predict(fit_on: str, check_on: str, runs: dict[str, list[Path]], overrides: list[str],
            terms: tuple[str, ...], metrics: tuple[str, ...], out: Path) -> dict:
    """Fit `terms` to `metrics` on `fit_on`'s runs (twinserve-calibrate), replay `check_on`'s
    with the fit (twinserve-validate --real); the table's rows."""
    from calibration.realrun.cli import validate_real

    fitted, fitted_overrides = fit_terms(runs[fit_on], overrides, terms, metrics,
                                         out / f"fit-{fit_on}.json")
    command = (f"twinserve-validate --real {' '.join(map(str, runs[check_on]))} "
               f"{' '.join(overrides + fitted_overrides)}")
    print(f"\n$ {command}", flush=True)
    replays = validate_real(runs[check_on], out / f"validate-{check_on}-from-{fit_on}",
                            overrides + fitted_overrides, command=command)
    rows = []
    for metric in TABLE_METRICS:
        # One load stage per run (a constant rate); its real and simulated values per repeat.
        real = [replay["stages"][0]["real"][metric] for replay in replays]
        sim = [replay["stages"][0]["sim"][metric] for replay in replays]
        real_mean, sim_mean = statistics.fmean(real), statistics.fmean(sim)
        error = 100.0 * (sim_mean / real_mean - 1.0)
        spread = spread_pct(real)
        rows.append({"metric": metric, "real_mean": real_mean, "real_spread_pct": spread,
                     "real_repeats": real, "sim_mean": sim_mean, "sim_repeats": sim,
                     "error_pct": error, "within_gate": abs(error) <= GATE_PCT,
                     "within_spread": abs(error) <= spread})
    overloaded = [replay["stages"][0]["overloaded"] for replay in replays]
    return {"fit_on": fit_on, "check_on": check_on, "terms": fitted, "rows": rows,
            "cost_model": replays[0]["cost_model"], "overloaded": overloaded}


def markdown_table(result: dict, server: str) -> list[str]:
    """The table of one direction: `server`'s mean of repeats and spread, the simulated mean,
    the error and whether it lies within 10 % or within the spread."""
    terms = ", ".join(f"{k} = {v:.4g}" for k, v in result["terms"].items())
    lines = [f"Fitted on the {result['fit_on']} load ({result['cost_model']}; {terms}); "
             f"predicting the {result['check_on']} load:", "",
             f"| metric | {server} (mean of repeats ± spread) | simulated | error | "
             f"within 10 % or the spread? |",
             "|---|---:|---:|---:|:---:|"]
    for row in result["rows"]:
        verdict = ("yes" if row["within_gate"] else
                   "within the spread" if row["within_spread"] else "no")
        lines.append(f"| {row['metric'].removesuffix('_ms')} (ms) | {row['real_mean']:.2f} ± "
                     f"{row['real_spread_pct']:.1f} % | {row['sim_mean']:.2f} | "
                     f"{row['error_pct']:+.1f} % | {verdict} |")
    disagree = sum(flag["disagree"] for flag in result["overloaded"])
    lines += ["", f"Overload verdicts real/sim disagree on {disagree} of "
                  f"{len(result['overloaded'])} runs."]
    return lines


def drift_line(runs: dict[str, list[Path]], repeats: int) -> str:
    """The machine's drift, run by run: a steady server would repeat each load's TPOT."""
    order = [runs[name][i] for i in range(repeats) for name in runs]
    return "Median TPOT (ms) of each run, in the order they ran: " + ", ".join(
        f"{path.stem} {json.loads(path.read_text())['median_tpot_ms']:.2f}" for path in order)
