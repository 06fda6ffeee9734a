"""twinserve's simulator beside NVIDIA's aiconfigurator on the measured vLLM deployments of
data/gpu/aiconfigurator/silicon_vllm.csv: each row's real mean TTFT and TPOT, both tools'
predictions and their errors, per row and summarised per group.

    python bench/vs_aiconfigurator.py                        # the default selection, cached
    python bench/vs_aiconfigurator.py --model Qwen3-32B --limit 10 --out /tmp/x.json
    python bench/vs_aiconfigurator.py --refresh --aiconfigurator /tmp/aicvenv/bin/aiconfigurator

aiconfigurator is not a dependency (it is big and pins its own packages): its predictions are
cached with each row's exact invocation, and `--refresh` recomputes them in the tool's own venv
through bench/aiconfigurator_driver.py. How it predicts a row and what each row passes it:
docs/gpu-cost-model.md. Errors are (predicted - real) / real in %.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SILICON_CSV = REPO / "data/gpu/aiconfigurator/silicon_vllm.csv"
TOOL_VERSION = "0.12.0"
CACHE = REPO / f"data/gpu/aiconfigurator/aiconfigurator-{TOOL_VERSION}-predictions.json"
DRIVER = REPO / "bench/aiconfigurator_driver.py"
INSTALL_HINT = (f"pip install aiconfigurator=={TOOL_VERSION} into a separate venv "
                f"(python -m venv /tmp/aicvenv && /tmp/aicvenv/bin/pip install "
                f"aiconfigurator=={TOOL_VERSION}) and pass --aiconfigurator "
                f"/tmp/aicvenv/bin/aiconfigurator")
# The rows' model names whose configs aiconfigurator does not ship, by the shipped name of the
# same architecture (it would otherwise download them from HuggingFace).
TOOL_MODEL_PATH = {"meta-llama/Llama-3.1-70B": "meta-llama/Meta-Llama-3.1-70B",
                   "nvidia/Llama-3.1-8B-Instruct-FP8": "meta-llama/Meta-Llama-3.1-8B"}
# A row's weight precision as aiconfigurator's gemm/moe quant mode (None: from the model config).
TOOL_QUANT_MODE = {"bf16": None, "fp8": "fp8"}


def read_rows(path: Path = SILICON_CSV) -> list:
    """The CSV's rows (calibration/silicon.py's reader)."""
    from calibration.silicon import read_silicon_rows
    return read_silicon_rows(path)


def concurrency(row) -> int:
    """Requests in flight: the closed loop's concurrency, else (a few rows) the batch size."""
    return row.concurrency or row.batch_size


def in_default_selection(row) -> bool:
    if row.mode != "agg":
        return False
    qwen = (row.model == "Qwen/Qwen3-32B" and row.system == "h100_sxm"
            and row.precision == "bf16" and row.backend_version.startswith("0.12"))
    llama_fp8 = (row.model in TOOL_MODEL_PATH and row.precision == "fp8"
                 and row.system in ("h100_sxm", "h200_sxm"))
    return qwen or llama_fp8


def group_of(row) -> str:
    version = f"vLLM {row.backend_version}" if row.backend_version else "vLLM unrecorded"
    return f"{row.model} {row.system} {row.precision} {version}"


def select_rows(rows: list, systems=None, models=None, precisions=None, limit=None) -> list:
    """The default selection, or with any filter the aggregated rows it keeps; ordered by group
    and shape."""
    if systems or models or precisions:
        chosen = [r for r in rows if r.mode == "agg"
                  and (not systems or r.system in systems)
                  and (not models or any(m.lower() in r.model.lower() for m in models))
                  and (not precisions or r.precision in precisions)]
    else:
        chosen = [r for r in rows if in_default_selection(r)]
    chosen.sort(key=lambda r: (group_of(r), r.isl, r.osl, r.tp_size, concurrency(r), r.id))
    return chosen[:limit] if limit else chosen


# --- aiconfigurator -------------------------------------------------------------------------

def tool_request(row) -> dict:
    """cli_estimate's keyword arguments for the row (all but backend_version, see the docstring)."""
    if row.precision not in TOOL_QUANT_MODE:
        raise ValueError(f"no aiconfigurator quant mode for precision {row.precision!r}")
    quant = TOOL_QUANT_MODE[row.precision]
    request = {"model_path": TOOL_MODEL_PATH.get(row.model, row.model),
               "system_name": row.system, "backend_name": "vllm", "mode": "agg",
               "isl": row.isl, "osl": row.osl, "batch_size": concurrency(row),
               "tp_size": row.tp_size, "pp_size": 1}
    if quant:
        request.update(gemm_quant_mode=quant, moe_quant_mode=quant)
    return request


def cli_command(request: dict, backend_version: str | None) -> str:
    """The `aiconfigurator cli estimate` line equivalent to one cli_estimate call."""
    flags = {"model_path": "--model-path", "system_name": "--system", "backend_name": "--backend",
             "isl": "--isl", "osl": "--osl", "batch_size": "--batch-size",
             "tp_size": "--tp-size", "pp_size": "--pp-size",
             "gemm_quant_mode": "--gemm-quant-mode", "moe_quant_mode": "--moe-quant-mode"}
    words = ["aiconfigurator", "cli", "estimate"]
    for key, flag in flags.items():
        if key in request:
            words += [flag, str(request[key])]
    if backend_version:
        words += ["--backend-version", backend_version]
    return shlex.join(words)


def python_of(executable: Path) -> Path:
    """The Python a console script (or a venv's bin/ entry) runs under."""
    if executable.name.startswith("python"):
        return executable
    first = executable.read_bytes()[:200].split(b"\n", 1)[0].decode(errors="replace")
    if first.startswith("#!") and Path(first[2:].strip().split()[0]).exists():
        return Path(first[2:].strip().split()[0])
    return executable.parent / "python"


def find_tool_python(given: str | None) -> str | None:
    """The Python that imports aiconfigurator: from `given`, this one, or PATH's executable."""
    if given:
        path = Path(given).expanduser()
        python = path / "bin/python" if path.is_dir() else python_of(path) if path.exists() \
            else None
        if python is None or not python.exists():
            raise SystemExit(f"--aiconfigurator {given}: no such executable, venv python or "
                             f"venv folder")
        return str(python)
    if importlib.util.find_spec("aiconfigurator") is not None:
        return sys.executable
    executable = shutil.which("aiconfigurator")
    return str(python_of(Path(executable))) if executable else None


def run_tool(python: str, items: list[dict]) -> dict:
    """The driver's predictions for `items`, in one process of `python`."""
    with tempfile.TemporaryDirectory(prefix="vs_aiconfigurator-") as tmp:
        requests, predictions = Path(tmp, "requests.json"), Path(tmp, "predictions.json")
        requests.write_text(json.dumps(items))
        done = subprocess.run([python, str(DRIVER), str(requests), str(predictions)])
        if done.returncode != 0 or not predictions.exists():
            raise SystemExit(f"aiconfigurator driver under {python} failed "
                             f"(exit {done.returncode}); its stderr is above")
        return json.loads(predictions.read_text())


def read_cache(path: Path) -> dict | None:
    if not path.exists():
        return None
    cache = json.loads(path.read_text())
    if not isinstance(cache.get("rows"), dict) or "version" not in cache:
        raise SystemExit(f"--cache {path}: not an aiconfigurator predictions cache "
                         f"(no 'version' and 'rows')")
    return cache


def cached_prediction(cache: dict | None, row) -> dict | None:
    """The cache's prediction for the row, or None where it has none or asked something else."""
    entry = (cache or {}).get("rows", {}).get(row.id)
    if entry is None or entry.get("request") != tool_request(row) \
            or entry.get("backend_version_requested") != (row.backend_version or None):
        return None
    return entry


def cache_entry(item: dict, prediction: dict) -> dict:
    """The cache's record of one row: what was asked, the CLI line that asks it, the answer."""
    asked = item["backend_version"]
    used = prediction.get("backend_version_used")
    return {"request": item["request"], "backend_version_requested": asked,
            "cli": cli_command(item["request"], asked if used == asked else None),
            "computed_utc": datetime.datetime.now(datetime.timezone.utc)
            .strftime("%Y-%m-%dT%H:%M:%SZ"), **prediction}


def add_tool_predictions(cache: dict | None, cache_path: Path, python: str,
                         rows: list) -> dict:
    """The cache with the tool's predictions for `rows` (run now under `python`), written back."""
    items = [{"id": r.id, "request": tool_request(r),
              "backend_version": r.backend_version or None} for r in rows]
    answer = run_tool(python, items)
    held = cache["version"] if cache else TOOL_VERSION if cache_path == CACHE else None
    if held is not None and answer["version"] != held:
        raise SystemExit(f"found aiconfigurator {answer['version']} but {cache_path} holds "
                         f"{held}'s predictions: pass --cache FILE for its own")
    cache = cache or {"tool": "aiconfigurator", "version": answer["version"], "rows": {}}
    cache["invocation"] = (
        f"pip install aiconfigurator=={answer['version']}; bench/aiconfigurator_driver.py calls "
        f"aiconfigurator.cli.api.cli_estimate(**request, backend_version=the row's where the "
        f"tool has it, else its default) in one process: what each row's 'cli' line runs")
    for item in items:
        cache["rows"][item["id"]] = cache_entry(item, answer["rows"][item["id"]])
    cache_path.write_text(json.dumps(cache, indent=1, sort_keys=True) + "\n")
    return cache


def aiconfigurator_predictions(rows: list, cache_path: Path, refresh: bool,
                               tool: str | None) -> tuple[dict, list[str]]:
    """{row id: cache entry} for the rows aiconfigurator predicts, and lines saying where they
    came from. Computes (and caches) the rows the cache lacks when the tool is found."""
    cache = read_cache(cache_path)
    supported = [r for r in rows if r.precision in TOOL_QUANT_MODE]
    missing = supported if refresh else [r for r in supported
                                         if cached_prediction(cache, r) is None]
    python = find_tool_python(tool) if missing else None
    if missing and python is None and (refresh or cache is None):
        raise SystemExit(f"aiconfigurator is not installed and there is no cache at "
                         f"{cache_path}: {INSTALL_HINT}" if cache is None else
                         f"--refresh needs aiconfigurator: {INSTALL_HINT}")
    notes = []
    if missing and python is None:
        notes.append(f"aiconfigurator: {len(missing)} rows not in the cache and the tool is not "
                     f"installed ({INSTALL_HINT})")
    elif missing:
        cache = add_tool_predictions(cache, cache_path, python, missing)
        notes.append(f"aiconfigurator {cache['version']}: computed {len(missing)} rows now with "
                     f"{python}, saved to {cache_path}")
    predictions = {r.id: entry for r in supported
                   if (entry := cached_prediction(cache, r)) is not None}
    if cache is not None:
        from_cache = len(predictions) - (len(missing) if python else 0)
        notes.insert(0, f"aiconfigurator {cache['version']}: {from_cache} rows from the cache "
                        f"{cache_path} (--refresh recomputes them with the tool)")
        versions = Counter((e["backend_version_requested"] or "unrecorded",
                            e.get("backend_version_used")) for e in predictions.values()
                           if not e.get("error"))
        notes.append("aiconfigurator vLLM tables: " + ", ".join(
            f"rows' {asked} -> {used} ({n})" for (asked, used), n in sorted(versions.items())))
        refused = sum(1 for e in predictions.values() if e.get("error"))
        if refused:
            notes.append(f"aiconfigurator: refused {refused} rows (the reason after each)")
    unsupported = len(rows) - len(supported)
    if unsupported:
        notes.append(f"aiconfigurator: {unsupported} rows of a precision with no quant mode here "
                     f"(only {', '.join(TOOL_QUANT_MODE)})")
    return predictions, notes


# --- twinserve ------------------------------------------------------------------------------

def twinserve_predictions(rows: list) -> tuple[dict, list[str]]:
    """{row id: (TTFT ms, TPOT ms)} from calibration/silicon.py's simulator runs, and notes."""
    try:
        from calibration.silicon import compare_rows
    except ModuleNotFoundError as exc:
        if exc.name != "calibration.silicon":
            raise
        return {}, ["twinserve: not run (calibration/silicon.py's compare_rows is not merged)"]
    result = compare_rows(rows, on_row=lambda done: print(
        f"twinserve: {done['id']} {done['wall_s']:.1f} s", file=sys.stderr, flush=True))
    notes = [f"twinserve: the simulator on {len(result['rows'])} rows "
             f"(calibration.silicon.compare_rows, {result['summary']['wall_s']:.0f} s)"]
    reasons = Counter(skip["reason"] for skip in result["skipped"])
    notes += [f"twinserve: skipped {n} rows: {reason}" for reason, n in reasons.items()]
    return {r["id"]: (r["sim_ttft_ms"], r["sim_tpot_ms"]) for r in result["rows"]}, notes


# --- errors and the table -------------------------------------------------------------------

def error_pct(predicted: float | None, real: float) -> float | None:
    return None if predicted is None else 100.0 * (predicted - real) / real


def row_record(row, aic: dict | None, twin: tuple | None) -> dict:
    aic_ttft, aic_tpot = (aic["ttft_ms"], aic["tpot_ms"]) if aic else (None, None)
    twin_ttft, twin_tpot = twin or (None, None)
    return {"id": row.id, "group": group_of(row), "isl": row.isl, "osl": row.osl,
            "concurrency": concurrency(row), "tp": row.tp_size,
            "real_ttft_ms": row.ttft_ms, "real_tpot_ms": row.tpot_ms,
            "aiconfigurator_ttft_ms": aic_ttft, "aiconfigurator_tpot_ms": aic_tpot,
            "aiconfigurator_ttft_err_pct": error_pct(aic_ttft, row.ttft_ms),
            "aiconfigurator_tpot_err_pct": error_pct(aic_tpot, row.tpot_ms),
            "aiconfigurator_error": aic.get("error") if aic else None,
            "twinserve_ttft_ms": twin_ttft, "twinserve_tpot_ms": twin_tpot,
            "twinserve_ttft_err_pct": error_pct(twin_ttft, row.ttft_ms),
            "twinserve_tpot_err_pct": error_pct(twin_tpot, row.tpot_ms)}


TOOLS = ("aiconfigurator", "twinserve")


def summarise(records: list[dict]) -> dict:
    """Per tool and metric: rows predicted, mean and worst |error| %, and the worst row's id."""
    summary = {}
    for tool in TOOLS:
        for metric in ("ttft", "tpot"):
            errors = [(abs(r[f"{tool}_{metric}_err_pct"]), r["id"]) for r in records
                      if r[f"{tool}_{metric}_err_pct"] is not None]
            worst = max(errors, default=(None, None))
            summary[f"{tool}_{metric}"] = {
                "n": len(errors),
                "mean_abs_err_pct": sum(e for e, _ in errors) / len(errors) if errors else None,
                "worst_abs_err_pct": worst[0], "worst_id": worst[1]}
    return summary


def summarise_groups(records: list[dict]) -> dict[str, dict]:
    """Per group: each tool over the rows it predicted, and under "same_rows" both tools over
    the rows both predicted (a fair comparison where one tool refuses or skips rows)."""
    groups = {}
    for record in records:
        groups.setdefault(record["group"], []).append(record)
    return {name: {**summarise(members), "same_rows": summarise(
        [r for r in members if all(r[f"{tool}_{metric}_err_pct"] is not None
                                   for tool in TOOLS for metric in ("ttft", "tpot"))])}
            for name, members in groups.items()}


def _ms(value: float | None) -> str:
    return f"{value:9.1f}" if value is not None else f"{'-':>9}"


def _pct(value: float | None) -> str:
    return f"{value:+7.1f}%" if value is not None else f"{'':>8}"


def print_report(records: list[dict], groups: dict[str, dict]) -> None:
    header = (f"{'isl':>5} {'osl':>5} {'conc':>4} {'tp':>2} | {'TTFT real':>9} {'aic':>9} "
              f"{'err':>8} {'twin':>9} {'err':>8} | {'TPOT real':>9} {'aic':>9} {'err':>8} "
              f"{'twin':>9} {'err':>8} | id")
    for name in groups:
        print(f"\n== {name}")
        print(header)
        for r in (r for r in records if r["group"] == name):
            print(f"{r['isl']:>5} {r['osl']:>5} {r['concurrency']:>4} {r['tp']:>2} | "
                  f"{_ms(r['real_ttft_ms'])} {_ms(r['aiconfigurator_ttft_ms'])} "
                  f"{_pct(r['aiconfigurator_ttft_err_pct'])} {_ms(r['twinserve_ttft_ms'])} "
                  f"{_pct(r['twinserve_ttft_err_pct'])} | {_ms(r['real_tpot_ms'])} "
                  f"{_ms(r['aiconfigurator_tpot_ms'])} {_pct(r['aiconfigurator_tpot_err_pct'])} "
                  f"{_ms(r['twinserve_tpot_ms'])} {_pct(r['twinserve_tpot_err_pct'])} | {r['id']}"
                  + (f"  [aiconfigurator: {r['aiconfigurator_error'].split('. ')[0]}]"
                     if r["aiconfigurator_error"] else ""))
    print("\nmean / worst |error| % per group over the rows each tool predicted "
          "(*: over the rows both predicted)")
    print(f"{'group':<58} {'tool':<16} {'n':>3} {'TTFT mean':>9} {'worst':>7} "
          f"{'TPOT mean':>9} {'worst':>7}")
    for name, summary in groups.items():
        lines = [(tool, tool, summary) for tool in TOOLS]
        if summary["same_rows"]["twinserve_tpot"]["n"]:
            lines += [(f"{tool}*", tool, summary["same_rows"]) for tool in TOOLS]
        for label, tool, of in lines:
            ttft, tpot = of[f"{tool}_ttft"], of[f"{tool}_tpot"]
            print(f"{name:<58} {label:<16} {tpot['n']:>3} "
                  + " ".join(f"{_fmt(s['mean_abs_err_pct'], 9)} {_fmt(s['worst_abs_err_pct'], 7)}"
                             for s in (ttft, tpot)))


def _fmt(value: float | None, width: int) -> str:
    return f"{value:{width}.1f}" if value is not None else f"{'-':>{width}}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--system", action="append", help="only this system (repeatable), "
                                                          "e.g. h100_sxm")
    parser.add_argument("--model", action="append",
                        help="only models whose name contains this (repeatable)")
    parser.add_argument("--precision", action="append", help="only this precision (repeatable): "
                                                             "bf16, fp8, ...")
    parser.add_argument("--limit", type=int, help="at most this many rows")
    parser.add_argument("--csv", type=Path, default=SILICON_CSV, help="the measured rows")
    parser.add_argument("--aiconfigurator", metavar="PATH",
                        help="aiconfigurator's executable, its venv's python or the venv folder")
    parser.add_argument("--cache", type=Path, default=CACHE,
                        help="aiconfigurator's cached predictions (JSON)")
    parser.add_argument("--refresh", action="store_true",
                        help="recompute the selected rows' aiconfigurator predictions")
    parser.add_argument("--out", type=Path, help="write rows and summaries to this JSON file")
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be at least 1")
    if args.aiconfigurator:
        find_tool_python(args.aiconfigurator)          # a wrong path is an error even when unused

    rows = select_rows(read_rows(args.csv), args.system, args.model, args.precision, args.limit)
    if not rows:
        raise SystemExit("no aggregated rows match --system/--model/--precision")
    aic, aic_notes = aiconfigurator_predictions(rows, args.cache, args.refresh,
                                                args.aiconfigurator)
    twin, twin_notes = twinserve_predictions(rows)
    records = [row_record(r, aic.get(r.id), twin.get(r.id)) for r in rows]
    groups = summarise_groups(records)
    print("\n".join(aic_notes + twin_notes))
    print_report(records, groups)
    if args.out:
        args.out.write_text(json.dumps({"notes": aic_notes + twin_notes, "rows": records,
                                        "groups": groups}, indent=1) + "\n")
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
