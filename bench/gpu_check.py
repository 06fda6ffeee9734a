"""The check for a lent GPU, in one command (bash bench/gpu_check.sh runs it). Its steps
(bench/gpu_check_steps/), most important answer first: the engine's greedy outputs against HF
generate on the Triton kernels, speculative decoding against the target alone, the simulator
against the engine on a Llama-2-7B-shaped model, bandwidth and throughput gates, and every kernel
configuration against the loop oracle. Each step runs in its own process under its budget, and
gpu_check.json is rewritten after every row, so that a step cut off still returns what it learned.

    python bench/gpu_check.py [--out DIR]   # every step (DIR/gpu_check.json; default gpu_check_out)
    python bench/gpu_check.py --smoke       # every step end to end at toy sizes on CPU, Triton
                                            # through its interpreter: checks this script, not
                                            # the GPU (goals.SMOKE_GOALS)
    python bench/gpu_check.py --compile     # no GPU needed: compile every kernel variant the
                                            # engine's warm-up compiles, for sm_90; registers
                                            # and spills (what the interpreter cannot tell)
    python bench/gpu_check.py --step NAME   # one step in this process (what the driver runs)
    python bench/gpu_check.py --only NAME.. # some steps (for a rerun; never exits 0)

Exit status (EXIT_* below): 0 every step passed; 1 a check failed (a goal missed too), or a step
crashed, ran out of its budget or could not run; 2 the environment cannot run the check (a GPU
is there but torch cannot use it, triton or a dependency is missing or the wrong version,
TRITON_INTERPRET is set): one line names what is missing and the command that installs it; 3 no
GPU here, nothing checked. --compile: 0 without spills, 1 with.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

EXIT_OK, EXIT_FAILED, EXIT_ENVIRONMENT, EXIT_NO_GPU = 0, 1, 2, 3
# The whole check on an H100 or H200, within one 10-minute device call with the machine's
# start, the wheels' install (about 30 s) and a margin beside it.
TOTAL_BUDGET_S = 520


@dataclass(frozen=True)
class Step:
    name: str
    estimate_s: int        # expected on an H100/H200, Triton's cache cold
    budget_s: int          # its share of TOTAL_BUDGET_S (unused time carries to the next)
    title: str


STEPS = (  # the most important answers first
    Step("engine", 50, 65, "engine greedy outputs vs HF generate (Triton kernels, CUDA graphs; "
                           "mixed LoRA adapters vs HF + PEFT; tiny-moe)"),
    Step("speculative", 50, 75, "speculative decoding (draft model, n-gram, Medusa, lookahead)"),
    Step("fidelity", 160, 195, "Llama-2-7B-shaped: profile, validation grid, GPU cost model"),
    Step("bandwidth", 20, 35, "decode attention bandwidth vs device copy bandwidth (gated)"),
    Step("throughput", 20, 35, "engine output tok/s vs HF generate (gated)"),
    Step("kernels", 97, 115, "kernel configurations and the multi-LoRA kernel vs "
                             "kernels/naive.py"),
)
SMOKE_BUDGET_S = 300
assert sum(step.budget_s for step in STEPS) <= TOTAL_BUDGET_S


# ---------------------------------------------------------------------------------------------
# The environment


def gpu_present() -> bool:
    """Whether nvidia-smi sees a GPU: the question before whether torch can use it."""
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        result = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0 and "GPU" in result.stdout


def pinned_requirement(package: str) -> str:
    """The project's requirement on `package`, as pyproject.toml writes it."""
    text = (REPO / "pyproject.toml").read_text()
    match = re.search(rf'"({re.escape(package)}[<>=!~][^";]*)', text)
    return match.group(1) if match else package


def _version_tuple(text: str) -> tuple:
    return tuple(int(part) for part in re.findall(r"\d+", text.split("+")[0])[:3])


def satisfies(version: str, requirement: str) -> bool:
    """version against a requirement of >=, <, <=, == bounds (what pyproject.toml uses)."""
    for op, bound in re.findall(r"(>=|<=|==|<|>)\s*([\w.]+)", requirement):
        have, want = _version_tuple(version), _version_tuple(bound)
        if not {">=": have >= want, "<=": have <= want, "==": have == want,
                "<": have < want, ">": have > want}[op]:
            return False
    return True


INSTALL_HINT = ("bash bench/gpu_check.sh --install [--wheels DIR] (a venv with the CUDA build "
                "and the project; DIR: local wheels, for a machine without network)")


def environment_problem(smoke: bool) -> tuple[int, str] | None:
    """(exit status, one line) when this environment cannot run the check, else None."""
    if not smoke and not gpu_present():
        return EXIT_NO_GPU, "no GPU here, nothing checked (nvidia-smi finds none)"
    if not smoke and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return EXIT_ENVIRONMENT, ("TRITON_INTERPRET is set: the kernels would run in Triton's "
                                  "interpreter, not on the GPU; unset it (env -u "
                                  "TRITON_INTERPRET bash bench/gpu_check.sh)")
    try:
        import torch
    except ImportError as error:
        return EXIT_ENVIRONMENT, (f"torch does not import ({error}): install a CUDA build, "
                                  f"pip install torch --index-url "
                                  f"https://download.pytorch.org/whl/cu130, or {INSTALL_HINT}")
    if not smoke:
        if torch.version.cuda is None:
            return EXIT_ENVIRONMENT, (f"torch {torch.__version__} is a CPU build and cannot use "
                                      f"the GPU: pip install torch --index-url "
                                      f"https://download.pytorch.org/whl/cu130, or {INSTALL_HINT}")
        if not torch.cuda.is_available():
            return EXIT_ENVIRONMENT, (f"torch {torch.__version__} (CUDA {torch.version.cuda}) "
                                      f"cannot use the GPU nvidia-smi lists (driver too old for "
                                      f"this CUDA, or CUDA_VISIBLE_DEVICES hides it): install "
                                      f"the torch build for the driver's CUDA version, or "
                                      f"{INSTALL_HINT}")
    try:
        import triton
    except ImportError as error:
        return EXIT_ENVIRONMENT, (f"triton does not import ({error}): pip install triton "
                                  f"(it comes with a CUDA build of torch), or {INSTALL_HINT}")
    from importlib import metadata
    for package in ("transformers", "peft"):  # peft: the multi-LoRA checks' reference
        requirement = pinned_requirement(package)
        try:
            version = metadata.version(package)
        except metadata.PackageNotFoundError:
            version = None
        if version is None or not satisfies(version, requirement):
            found = f"{package} {version}" if version else f"no {package}"
            return EXIT_ENVIRONMENT, (f"{found}; the project needs {requirement}: pip install "
                                      f"'{requirement}', or {INSTALL_HINT}")
    missing = []
    for module, package in (("simpy", "simpy"), ("hydra", "hydra-core"),
                            ("omegaconf", "omegaconf"), ("numpy", "numpy"), ("tqdm", "tqdm"),
                            ("rich", "rich"), ("matplotlib", "matplotlib")):
        try:
            __import__(module)
        except ImportError:
            missing.append(package)
    if missing:
        return EXIT_ENVIRONMENT, (f"missing {', '.join(missing)}: pip install -e . (the "
                                  f"project's dependencies), or {INSTALL_HINT}")
    del triton
    return None


def environment_summary() -> dict:
    import torch
    import transformers
    import triton
    summary = {"python": sys.version.split()[0], "torch": torch.__version__,
               "cuda": torch.version.cuda, "triton": triton.__version__,
               "transformers": transformers.__version__}
    if torch.cuda.is_available():
        summary["device"] = torch.cuda.get_device_name(0)
        summary["device_memory_gib"] = round(
            torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    else:
        summary["device"] = "CPU (Triton interpreter)"
    return summary



# ---------------------------------------------------------------------------------------------
# The driver: each step in its own process, under its budget


STEP_FUNCTIONS = {"engine": "engine.step_engine", "speculative": "speculative.step_speculative",
                  "fidelity": "fidelity.step_fidelity", "bandwidth": "speed.step_bandwidth",
                  "throughput": "speed.step_throughput", "kernels": "kernels.step_kernels"}


def step_function(name: str):
    """The step's function, importing its module alone."""
    import importlib
    module, function = STEP_FUNCTIONS[name].split(".")
    return getattr(importlib.import_module(f"gpu_check_steps.{module}"), function)


def write_step_result(result_path: Path, status: str, error, report) -> None:
    result_path.write_text(json.dumps({"status": status, "error": error, "rows": report.rows,
                                       "measurements": report.measurements}, default=str))


def run_step_here(name: str, smoke: bool, out_dir: Path, work_dir: Path,
                  result_path: Path) -> int:
    """One step in this process; its rows go to result_path (JSON), rewritten after each row
    so that a step killed at its budget keeps the rows before."""
    import torch

    from gpu_check_steps.common import StepReport
    torch.manual_seed(0)
    if smoke:
        torch.set_num_threads(1)
    report = StepReport(on_row=lambda r: write_step_result(result_path, "running", None, r))
    error = None
    try:
        if name == "fidelity":
            step_function(name)(report, smoke, out_dir, work_dir)
        else:
            step_function(name)(report, smoke)
    except Exception as exc:  # noqa: BLE001 - a crash is the step's result, with its reason
        import traceback
        traceback.print_exc()
        error = f"{type(exc).__name__}: {exc}"
    status = "crashed" if error else ("passed" if report.ok else "failed")
    write_step_result(result_path, status, error, report)
    return EXIT_OK if status == "passed" else EXIT_FAILED


def run_step_process(step: Step, smoke: bool, out_dir: Path, budget_s: float,
                     work_dir: Path | None = None) -> dict:
    """Runs one step in a child process (its output streams through), killed when it overruns
    its budget; returns its result: status passed / failed / crashed / timed out, with the rows
    it wrote before."""
    result_path = out_dir / f".step-{step.name}.json"
    result_path.unlink(missing_ok=True)
    args = [sys.executable, str(Path(__file__).resolve()), "--step", step.name,
            "--out", str(out_dir), "--work", str(work_dir or out_dir / "work")] + \
        (["--smoke"] if smoke else [])
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if smoke:  # before anything imports triton (transformers does): Triton's interpreter
        env["TRITON_INTERPRET"] = "1"
    started = time.perf_counter()
    child = subprocess.Popen(args, cwd=REPO, env=env, start_new_session=True)
    try:
        child.wait(timeout=budget_s)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)  # the step and anything it started
        child.wait()
    elapsed = time.perf_counter() - started
    result = {"status": "crashed", "rows": [], "error": None}
    if result_path.is_file():
        result = json.loads(result_path.read_text())
        result_path.unlink()
    if result["status"] in ("running", "crashed") and result["error"] is None:
        timed_out = elapsed >= budget_s
        result.update(status="timed out" if timed_out else "crashed",
                      error=(f"over its budget of {budget_s:.0f} s" if timed_out else
                             f"exit {child.returncode} without a result"))
    result.update(name=step.name, title=step.title, seconds=round(elapsed, 1),
                  budget_s=round(budget_s))
    return result


def step_budget(steps, elapsed_s: float, done: int, smoke: bool) -> float:
    """The next step's budget: on a GPU its own plus whatever the steps before left unused."""
    if smoke:
        return SMOKE_BUDGET_S
    return sum(step.budget_s for step in steps[:done + 1]) - elapsed_s


def run_all(smoke: bool, out_dir: Path, only: list[str] | None = None,
            work_dir: Path | None = None) -> int:
    problem = environment_problem(smoke)
    if problem is not None:
        status, line = problem
        print(f"gpu_check: {line}", flush=True)
        return status
    out_dir.mkdir(parents=True, exist_ok=True)
    # Profiles and validation runs go beside, not into, the output folder: a lent machine
    # returns at most 8 files from it.
    temporary = work_dir is None
    work_dir = work_dir or Path(tempfile.mkdtemp(prefix="gpu_check_work_"))
    results_path = out_dir / "gpu_check.json"
    started = time.perf_counter()
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                   timespec="seconds"),
               "git_commit": git_commit(), "smoke": smoke,
               "environment": environment_summary(), "steps": []}
    env = results["environment"]
    print(f"## twinserve GPU check: {env['device']}, torch {env['torch']} (CUDA {env['cuda']}), "
          f"triton {env['triton']}, transformers {env['transformers']}", flush=True)
    steps = [step for step in STEPS if only is None or step.name in only]
    print(f"estimate on an H100/H200: {sum(s.estimate_s for s in steps)} s "
          f"({', '.join(f'{s.name} ~{s.estimate_s} s' for s in steps)}); budget "
          f"{sum(s.budget_s for s in steps)} s; work folder {work_dir}", flush=True)
    for done, step in enumerate(steps):
        budget = step_budget(steps, time.perf_counter() - started, done, smoke)
        print(f"\n### {step.name}: {step.title} (estimate ~{step.estimate_s} s on a GPU, "
              f"budget {budget:.0f} s)\n", flush=True)
        print("| check | value | ok |\n|---|---|---|", flush=True)
        result = run_step_process(step, smoke, out_dir, max(budget, 1.0), work_dir)
        results["steps"].append(result)
        results["seconds"] = round(time.perf_counter() - started, 1)
        results_path.write_text(json.dumps(results, indent=1, default=str))
        line = f"{step.name}: {result['status']} in {result['seconds']} s"
        print(f"\n{line}" + (f" ({result['error']})" if result.get("error") else ""),
              flush=True)
    if temporary:
        shutil.rmtree(work_dir, ignore_errors=True)
    failed = [r["name"] for r in results["steps"] if r["status"] != "passed"]
    results["status"] = "failed" if failed else "passed"
    results_path.write_text(json.dumps(results, indent=1, default=str))
    print(f"\ngpu_check: {'FAILED: ' + ', '.join(failed) if failed else 'all steps passed'} "
          f"({results['seconds']} s); results in {results_path}", flush=True)
    return EXIT_FAILED if failed else EXIT_OK


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                              capture_output=True, text=True, timeout=10).stdout.strip() or None
    except OSError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="toy sizes on CPU through Triton's interpreter (checks the script)")
    parser.add_argument("--compile", action="store_true",
                        help="no GPU: compile the kernels for sm_90 and report registers/spills")
    parser.add_argument("--out", type=Path, default=Path("gpu_check_out"),
                        help="folder of the results (gpu_check.json, fidelity.md/json, the "
                             "profile)")
    parser.add_argument("--work", type=Path, default=None,
                        help="folder of the profile and validation runs (default: a new "
                             "temporary folder)")
    names = [step.name for step in STEPS]
    parser.add_argument("--step", choices=names, help="run one step in this process")
    parser.add_argument("--only", nargs="+", choices=names, metavar="STEP",
                        help=f"run only these steps (of {', '.join(names)}); the check then "
                             f"still fails, as any step that does not run leaves it unchecked")
    args = parser.parse_args(argv)
    if args.compile:
        from gpu_check_steps.compile import compile_report
        return compile_report()
    out_dir = args.out.resolve()
    work_dir = args.work.resolve() if args.work else None
    if args.step:
        out_dir.mkdir(parents=True, exist_ok=True)
        work_dir = work_dir or out_dir / "work"
        work_dir.mkdir(parents=True, exist_ok=True)
        return run_step_here(args.step, args.smoke, out_dir, work_dir,
                             out_dir / f".step-{args.step}.json")
    status = run_all(args.smoke, out_dir, args.only, work_dir)
    if args.only and status == EXIT_OK and set(args.only) != set(names):
        print(f"gpu_check: steps {sorted(set(names) - set(args.only))} did not run: not a "
              f"complete check", flush=True)
        return EXIT_FAILED
    return status


if __name__ == "__main__":
    sys.exit(main())
