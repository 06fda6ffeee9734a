"""Step: the simulator against the engine on a GPU-sized model. A Llama-2-7B-shaped model
(conf/model/llama-2-7b.yaml, seeded random weights, bf16: nothing downloaded) is profiled on the
device (twinserve-profile, one block size, few repeats), then a small validation grid runs on
the engine (twice, for its spread) and on the profiled simulator: continuous and chunked
prefill at two loads, and one preemption case on a small pool. The same workloads are also
predicted by the calibrated GPU cost model (cost_model=gpu, the detected hardware preset) for
comparison. Gated by twinserve-validate's default gates; the table goes to fidelity.md and the
numbers to fidelity.json in the output folder as soon as they are known. --smoke runs every
part at a toy shape (tiny-llama) on CPU, gates off."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from gpu_check_steps.common import REPO, StepReport
from gpu_check_steps.goals import goals_for, validation_verdict

MODEL = {False: "llama-2-7b", True: "tiny-llama"}   # by smoke
# The table's metrics: (summary name, column).
TABLE_METRICS = (("mean_ttft_ms", "mean TTFT"), ("mean_tpot_ms", "mean TPOT"),
                 ("p99_tpot_ms", "p99 TPOT"), ("mean_e2el_ms", "mean E2E"),
                 ("output_throughput", "output tok/s"))
GATES_OFF = {"mean_pct": None, "p99_pct": None, "p99_ttft_pct": None, "preemptions_pct": None}
ENGINE_REPEATS = 2   # the engine's spread: the half-range of its two runs
SIM_RUNS = {False: 3, True: 1}   # by smoke


def workload(smoke: bool) -> list[str]:
    """The grid's shared overrides (the KV pool pinned, block size 16)."""
    if smoke:   # most requests cross into a second block: 3 blocks preempt
        return ["workload.num_requests=4", "++workload.prompt_len={dist: uniform, low: 12, "
                "high: 16}", "++workload.output_len={dist: uniform, low: 4, high: 8}",
                "kv_cache.block_size=16"]
    return ["workload.num_requests=24", "++workload.prompt_len={dist: uniform, low: 32, "
            "high: 512}", "++workload.output_len={dist: uniform, low: 16, high: 128}",
            "kv_cache.block_size=16"]


def jobs(smoke: bool) -> list[tuple[str, list[str]]]:
    """(label, overrides) of each validation: continuous and chunked prefill at a moderate and
    an unbounded rate, then recompute preemption on a pool a quarter of the workload's peak."""
    loads = ["workload.rate=inf"] if smoke else ["workload.rate=6", "workload.rate=inf"]
    pool, small_pool = (64, 3) if smoke else (2048, 160)
    grid = [(f"{scheduler}, {load.split('=')[1]} req/s",
             [f"scheduler={scheduler}", load, f"kv_cache.num_blocks={pool}"])
            for load in loads for scheduler in ("continuous", "chunked_prefill")]
    return grid + [("continuous, inf req/s, recompute preemption",
                    ["scheduler=continuous", "workload.rate=inf", "preemption=recompute",
                     f"kv_cache.num_blocks={small_pool}"])]


def gpu_hardware(smoke: bool) -> str:
    """The conf/hardware preset of this device for the GPU cost model (smoke: an H100's)."""
    if smoke:
        return "h100-80gb"
    import torch
    name = torch.cuda.get_device_name(0)
    return "h200" if "H200" in name else "h100-80gb"


def profile(smoke: bool, work_dir: Path, report: StepReport) -> Path | None:
    """twinserve-profile on the device; the profile's path, or None (reported)."""
    model = MODEL[smoke]
    args = [sys.executable, "-m", "calibration.profiler", "--model", model,
            "--device", "cpu" if smoke else "cuda", "--block-sizes", "16",
            "--repeats", "1" if smoke else "3", "--speed-probe-interval", "0",
            "--out-dir", str(work_dir / "profiles"), "--no-progress"]
    if smoke:
        args += ["--quick", "--kernel-backend", "torch"]
    print("$ " + " ".join(args[1:]), flush=True)
    started = time.perf_counter()
    result = subprocess.run(args, cwd=REPO)
    found = sorted((work_dir / "profiles").glob(f"*/{model}.json"))
    report.check(f"twinserve-profile {model}", f"exit {result.returncode} in "
                 f"{time.perf_counter() - started:.0f} s, "
                 f"{found[0].name if found else 'no profile written'}",
                 result.returncode == 0 and bool(found))
    return found[0] if result.returncode == 0 and found else None


def gpu_model_errors(overrides: list[str], job_dir: Path, hardware: str) -> dict:
    """The calibrated GPU cost model's prediction of the job's workload, against the engine's
    mean over its repeats: {metric: error %}."""
    from hydra import compose, initialize_config_dir

    from calibration.validate.compare import compare_summaries, mean_summary
    from calibration.validate.configs import CONF_DIR
    from sim.core.experiment import run_experiment
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=["progress=false", "backend=sim", "cost_model=gpu",
                                           *[o for o in overrides if not o.startswith(
                                               ("hardware=", "cost_model."))],
                                           f"hardware={hardware}"])
    run = run_experiment(cfg, job_dir / "sim-gpu-cost-model", plots=False)
    engines = [json.loads(path.read_text())
               for path in sorted(job_dir.glob("engine*/summary.json"))]
    names = tuple(name for name, _ in TABLE_METRICS)
    metrics = compare_summaries(mean_summary(engines, names), run.summary, names)
    return {name: values["error_pct"] for name, values in metrics.items()}


def pct(value) -> str:
    return "-" if value is None else f"{value:+.1f}"


def table(rows: list[dict], model: str, hardware: str, dtype: str) -> str:
    """fidelity.md: per job and metric, the engine's value and spread, the profiled simulator's
    error and the GPU cost model's."""
    head = ["job", "passed"] + [f"{column}: engine (spread %) / sim % / gpu model %"
                                for _, column in TABLE_METRICS]
    lines = [f"Simulator against the engine, {model} (seeded random weights, {dtype}) on this "
             f"device: signed error %, the engine's spread (half-range of {ENGINE_REPEATS} runs) "
             f"beside it; 'gpu model': cost_model=gpu hardware={hardware}.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["job"], "yes" if row["passed"] else "NO"]
        for name, _ in TABLE_METRICS:
            metric = row["metrics"][name]
            cells.append(f"{metric['engine']:.4g} ({pct(metric.get('engine_spread_pct'))}) / "
                         f"{pct(metric['error_pct'])} / {pct(row['gpu_model'].get(name))}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def step_fidelity(report: StepReport, smoke: bool, out_dir: Path, work_dir: Path) -> None:
    from calibration.validate.compare import ValidationInputError
    from calibration.validate.run import validate
    model, hardware = MODEL[smoke], gpu_hardware(smoke)
    profile_path = profile(smoke, work_dir, report)
    if profile_path is None:
        return
    shutil.copy(profile_path, out_dir / profile_path.name)
    gates = GATES_OFF if not goals_for(smoke).validation_gates else {}
    common = [f"model={model}", f"hardware={'cpu' if smoke else hardware}",
              "workload.with_token_ids=true", f"cost_model.profile={profile_path}",
              *workload(smoke)]
    rows = []
    for index, (label, overrides) in enumerate(jobs(smoke)):
        job_dir = work_dir / "validation" / str(index)
        job = [*common, *overrides]
        print(f"$ twinserve-validate --wall-clock --engine-repeats {ENGINE_REPEATS} --sim-runs "
              f"{SIM_RUNS[smoke]} --out {job_dir} {' '.join(job)}", flush=True)
        try:
            result = validate(job, job_dir, dict(gates), normalize_speed=False,
                              sim_runs=SIM_RUNS[smoke], engine_repeats=ENGINE_REPEATS)
        except ValidationInputError as error:
            report.check(f"validate {label}", f"error: {error}", False)
            continue
        try:
            gpu_model = gpu_model_errors(job, job_dir, hardware)
        except Exception as error:  # noqa: BLE001 - a failed prediction is a failed check
            report.check(f"GPU cost model on {label}", f"{type(error).__name__}: {error}",
                         False)
            gpu_model = {}
        rows.append({"job": label, "passed": result["passed"], "failures": result["failures"],
                     "metrics": result["metrics"], "gpu_model": gpu_model,
                     "preemptions": result["metrics"]["num_preemptions"]["engine"]})
        passed, verdict = validation_verdict(result["failures"])
        report.check(f"validate {label}", f"{verdict}, speedup {result['speedup'] or 0:.0f}x",
                     passed, failures=result["failures"])
        text = table(rows, model, hardware, 'fp32' if smoke else 'bf16')
        (out_dir / "fidelity.md").write_text(text)
        (out_dir / "fidelity.json").write_text(json.dumps(
            {"model": model, "hardware": hardware, "profile": str(profile_path), "jobs": rows},
            indent=1, default=str))
    preemptions = [row["preemptions"] for row in rows if "preemption" in row["job"]]
    report.check("the preemption case preempted",
                 f"{preemptions[0] if preemptions else 'no'} preemptions",
                 bool(preemptions) and preemptions[0] > 0)
    if rows:
        print("\n" + table(rows, model, hardware, 'fp32' if smoke else 'bf16'), flush=True)
        report.measurements["fidelity"] = rows
