"""Replay NVIDIA's measured vLLM deployments (data/gpu/aiconfigurator/silicon_vllm.csv) through
the simulator: each row one `vllm serve` deployment measured by a closed-loop client at a fixed
input and output length and concurrency, as simulator overrides (`silicon_overrides`). How the
rows were measured and why the metrics match: docs/validation-results.md, "NVIDIA's vLLM rows".

    rows = select_rows(read_silicon_rows(), system="h100_sxm", model="Qwen/Qwen3-32B",
                       precision="bf16")
    report = compare_rows(rows)          # per row real / sim / error, and the summary
"""
from __future__ import annotations

import csv
import math
import time
from dataclasses import dataclass
from pathlib import Path

from calibration.realrun.settings import v1_default_overrides
from sim.cost.gpu.vllm_tables import runs_v1_engine

REPO_ROOT = Path(__file__).resolve().parents[1]
SILICON_CSV = REPO_ROOT / "data" / "gpu" / "aiconfigurator" / "silicon_vllm.csv"

# HF model -> conf/model. Llama-3.1-70B is Llama-3-70B's shape (layers, widths, heads, vocab);
# only its RoPE scaling and context length differ, which cost nothing per step.
MODELS = {
    "Qwen/Qwen3-32B": ("model=qwen3-32b",),
    "meta-llama/Llama-3.1-70B": ("model=llama-3-70b", "model.max_model_len=131072"),
    "nvidia/Llama-3.1-8B-Instruct-FP8": ("model=llama-3.1-8b",),
}
# aiconfigurator system -> conf/hardware.
HARDWARE = {"h100_sxm": "h100-80gb", "h200_sxm": "h200"}
# The engine settings a row's server ran with, which the file does not record: "aiconfigurator"
# (its generator's --max-num-seqs <batch_size> --max-num-batched-tokens <batch_size + isl + 1500>,
# which the low-concurrency TTFTs fit) or "vllm-serve" (vLLM V1's defaults on a >= 70 GiB GPU).
ENGINE_SETTINGS = ("aiconfigurator", "vllm-serve")
DEFAULT_ENGINE_SETTINGS = "aiconfigurator"
VLLM_SERVE_BATCH_DEFAULTS = {"max_num_batched_tokens": 8192, "max_num_seqs": 1024}
# aiconfigurator's generator: max_num_tokens = max_batch_size + isl + this.
AIC_TOKEN_HEADROOM = 1500
PRECISIONS = ("bf16", "fp8")
# A finished request's successor arrives over HTTP after the engine began its next step; the
# value hardly matters, but a zero would let a request make the very next step.
CLIENT_ROUND_TRIP_S = 0.002
# Requests per row = waves x concurrency: aiconfigurator's deployment guide benchmarks with
# `concurrency * 10` requests (docs/validation-results.md weighs 10 against 20).
DEFAULT_WAVES = 10
# Overrides whose value differs from row to row: set on a composed config, so that rows of one
# deployment share one Hydra compose.
_ROW_KEYS = ("cluster.tensor_parallel_size", "scheduler.max_num_batched_tokens",
             "scheduler.max_num_seqs", "workload.concurrency", "workload.num_requests",
             "workload.input_len", "workload.output_len")

_COLUMNS = ("id", "backend", "backend_version", "model_path", "system", "precision", "mode",
            "isl", "osl", "batch_size", "tp_size", "pp_size", "silicon_ttft_ms", "silicon_tpot_ms",
            "silicon_concurrency")


class SiliconDataError(ValueError):
    """A silicon CSV that cannot be read: one line naming the file and the column."""


class SkippedRow(ValueError):
    """A row the simulator cannot replay; the message says why."""


@dataclass(frozen=True)
class SiliconRow:
    """One measured deployment; precision "bf16" where the file leaves it empty, None where it
    leaves concurrency, tp_size or pp_size empty."""

    id: str
    model: str               # the HF name (model_path)
    system: str              # aiconfigurator's GPU system name (h100_sxm, ...)
    precision: str
    mode: str                # agg | disagg
    backend_version: str
    isl: int
    osl: int
    concurrency: int | None
    batch_size: int | None   # aiconfigurator's max batch size of the deployment
    tp_size: int | None
    pp_size: int | None
    ttft_ms: float
    tpot_ms: float


def _cell(record: dict, column: str, where: str, kind):
    text = record[column].strip()
    if text == "" and kind is not float:
        return None
    try:
        value = kind(text)
    except ValueError:
        raise SiliconDataError(f"{where}: column {column}: {text!r} is not "
                               f"{'an integer' if kind is int else 'a number'}") from None
    if kind is float and not (math.isfinite(value) and value > 0):
        raise SiliconDataError(f"{where}: column {column}: {text!r} is not a positive number")
    if kind is int and value < 1:
        raise SiliconDataError(f"{where}: column {column}: {text!r} is not >= 1")
    return value


def read_silicon_rows(path: str | Path | None = None) -> list[SiliconRow]:
    """Every row of the silicon CSV in file order; SiliconDataError names the file, line and
    column of anything malformed."""
    path = Path(path) if path is not None else SILICON_CSV
    try:
        file = open(path, newline="")
    except OSError as error:
        raise SiliconDataError(f"{path}: {error.strerror}") from None
    with file:
        reader = csv.DictReader(file)
        missing = [column for column in _COLUMNS if column not in (reader.fieldnames or ())]
        if missing:
            raise SiliconDataError(f"{path}: no column {missing[0]}")
        rows = []
        for record in reader:
            where = f"{path}:{reader.line_num}"
            short = [column for column in _COLUMNS if record.get(column) is None]
            if short:
                raise SiliconDataError(f"{where}: column {short[0]}: the line has too few cells")
            ints = {column: _cell(record, column, where, int)
                    for column in ("isl", "osl", "silicon_concurrency", "batch_size", "tp_size",
                                   "pp_size")}
            for column in ("isl", "osl"):
                if ints[column] is None:
                    raise SiliconDataError(f"{where}: column {column}: empty")
            rows.append(SiliconRow(
                id=record["id"], model=record["model_path"], system=record["system"],
                precision=record["precision"].strip() or "bf16", mode=record["mode"],
                backend_version=record["backend_version"].strip(),
                isl=ints["isl"], osl=ints["osl"], concurrency=ints["silicon_concurrency"],
                batch_size=ints["batch_size"],
                tp_size=ints["tp_size"], pp_size=ints["pp_size"],
                ttft_ms=_cell(record, "silicon_ttft_ms", where, float),
                tpot_ms=_cell(record, "silicon_tpot_ms", where, float)))
    return rows


def select_rows(rows: list[SiliconRow], *, system: str | None = None, model: str | None = None,
                precision: str | None = None, mode: str | None = "agg",
                limit: int | None = None) -> list[SiliconRow]:
    """The rows that match every filter given (None: any), at most `limit` of them."""
    kept = [row for row in rows
            if (system is None or row.system == system)
            and (model is None or row.model == model)
            and (precision is None or row.precision == precision)
            and (mode is None or row.mode == mode)]
    return kept if limit is None else kept[:limit]


def skip_reason(row: SiliconRow) -> str | None:
    """Why the simulator cannot replay `row` (None: it can)."""
    if row.mode != "agg":
        return f"mode {row.mode}: only aggregated (agg) deployments replay"
    if row.model not in MODELS:
        return f"model {row.model} has no conf/model entry"
    if row.system not in HARDWARE:
        return f"system {row.system} has no conf/hardware entry"
    if row.precision not in PRECISIONS:
        return f"precision {row.precision} is not modelled (only {', '.join(PRECISIONS)})"
    if row.tp_size is None or row.concurrency is None:
        return "no tp_size" if row.tp_size is None else "no silicon_concurrency"
    if (row.pp_size or 1) > 1:
        return f"pp_size {row.pp_size}: pipeline-parallel rows are not replayed"
    return None


def scheduler_settings(row: SiliconRow, engine_settings: str) -> dict[str, int]:
    """max_num_batched_tokens and max_num_seqs of `row`'s server under `engine_settings`."""
    if engine_settings == "vllm-serve":
        return dict(VLLM_SERVE_BATCH_DEFAULTS)
    if engine_settings != "aiconfigurator":
        raise ValueError(f"engine settings must be one of {', '.join(ENGINE_SETTINGS)}; got "
                         f"{engine_settings!r}")
    batch = row.batch_size or row.concurrency
    return {"max_num_batched_tokens": batch + row.isl + AIC_TOKEN_HEADROOM, "max_num_seqs": batch}


def silicon_overrides(row: SiliconRow, waves: int = DEFAULT_WAVES,
                      engine_settings: str = DEFAULT_ENGINE_SETTINGS) -> list[str]:
    """The simulator overrides that replay `row`; SkippedRow (why) for a row that cannot."""
    reason = skip_reason(row)
    if reason is not None:
        raise SkippedRow(f"{row.id}: {reason}")
    limits = scheduler_settings(row, engine_settings)
    overrides = [*MODELS[row.model], f"hardware={HARDWARE[row.system]}",
                 f"cluster.tensor_parallel_size={row.tp_size}", "scheduler=chunked_prefill",
                 f"scheduler.max_num_batched_tokens={limits['max_num_batched_tokens']}",
                 f"scheduler.max_num_seqs={limits['max_num_seqs']}", "workload=closed_loop",
                 f"workload.concurrency={row.concurrency}",
                 f"workload.num_requests={waves * row.concurrency}",
                 f"workload.input_len={row.isl}", f"workload.output_len={row.osl}"]
    overrides.append(f"cluster.frontend_latency_s={CLIENT_ROUND_TRIP_S}")
    if runs_v1_engine(row.backend_version or None):
        # The rows record no server flags: V1's defaults, prompts with ids for its prefix cache.
        overrides += [*v1_default_overrides(), "workload.with_token_ids=true"]
    if row.backend_version:
        overrides.append(f"cost_model.engine_version={row.backend_version}")
    if row.precision != "bf16":
        overrides.append(f"model.quantization={row.precision}")
    return overrides


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def row_config(overrides: list[str]):
    """The config of conf/ plus `overrides`: the row-varying values (_ROW_KEYS) set on a config
    composed from the others, which is cached, unless a later override sets the same key."""
    from omegaconf import OmegaConf

    from calibration.realrun.replay import compose_config

    last = {_override_key(override): index for index, override in enumerate(overrides)}
    row_values = {}
    deployment = []
    for index, override in enumerate(overrides):
        key = _override_key(override)
        value = override.split("=", 1)[1] if "=" in override else ""
        # (anything but a plain integer goes through Hydra, which names what is wrong with it)
        if key in _ROW_KEYS and last[key] == index and value.isdigit() \
                and not override.startswith(("+", "~")):
            row_values[key] = int(value)
        else:
            deployment.append(override)
    config = compose_config(deployment)
    for key, value in row_values.items():
        OmegaConf.update(config, key, value, merge=True)
    return config


def predict_row(row: SiliconRow, overrides: list[str] | tuple[str, ...] = (),
                waves: int = DEFAULT_WAVES,
                engine_settings: str = DEFAULT_ENGINE_SETTINGS) -> dict:
    """The simulator's mean TTFT and mean TPOT (ms) of `row`'s benchmark, what it ran (its
    overrides, requests) and its wall time; `overrides` come after the row's and win."""
    from sim.core.experiment import run_experiment

    all_overrides = ["progress=false", *silicon_overrides(row, waves, engine_settings),
                     *overrides]
    config = row_config(all_overrides)
    start = time.perf_counter()
    result = run_experiment(config, plots=False)
    wall_s = time.perf_counter() - start
    summary = result.summary
    return {"id": row.id, "sim_ttft_ms": summary["mean_ttft_ms"],
            "sim_tpot_ms": summary["mean_tpot_ms"], "num_requests": summary["num_requests"],
            "num_preemptions": summary["num_preemptions"], "overrides": all_overrides,
            "wall_s": wall_s}


def error_pct(sim: float, real: float) -> float:
    """The signed error of `sim` against `real`, in % of `real`."""
    return (sim - real) / real * 100.0


def compare_rows(rows: list[SiliconRow], overrides: list[str] | tuple[str, ...] = (),
                 waves: int = DEFAULT_WAVES, engine_settings: str = DEFAULT_ENGINE_SETTINGS,
                 on_row=None) -> dict:
    """Every replayable row of `rows`, real against simulated ({"rows", "skipped", "summary"});
    `on_row(result)` is called after each row."""
    start = time.perf_counter()
    results, skipped = [], []
    for row in rows:
        reason = skip_reason(row)
        if reason is not None:
            skipped.append({"id": row.id, "reason": reason})
            continue
        predicted = predict_row(row, overrides, waves, engine_settings)
        result = {"id": row.id, "model": row.model, "system": row.system,
                  "precision": row.precision, "backend_version": row.backend_version,
                  "isl": row.isl, "osl": row.osl, "concurrency": row.concurrency,
                  "tp_size": row.tp_size,
                  "real_ttft_ms": row.ttft_ms, "sim_ttft_ms": predicted["sim_ttft_ms"],
                  "ttft_error_pct": error_pct(predicted["sim_ttft_ms"], row.ttft_ms),
                  "real_tpot_ms": row.tpot_ms, "sim_tpot_ms": predicted["sim_tpot_ms"],
                  "tpot_error_pct": error_pct(predicted["sim_tpot_ms"], row.tpot_ms),
                  **{key: predicted[key] for key in ("num_requests", "num_preemptions",
                                                     "wall_s", "overrides")}}
        results.append(result)
        if on_row is not None:
            on_row(result)
    summary = {"num_rows": len(results), "num_skipped": len(skipped),
               "wall_s": time.perf_counter() - start}
    for metric in ("ttft", "tpot"):
        errors = [abs(result[f"{metric}_error_pct"]) for result in results]
        summary[f"mean_abs_{metric}_error_pct"] = sum(errors) / len(errors) if errors else None
        summary[f"worst_abs_{metric}_error_pct"] = max(errors) if errors else None
    return {"waves": waves, "engine_settings": engine_settings, "overrides": list(overrides),
            "rows": results, "skipped": skipped, "summary": summary}


TABLE_COLUMNS = ("row", "isl", "osl", "conc", "tp", "real TTFT", "sim TTFT", "err %",
                 "real TPOT", "sim TPOT", "err %")


def table_lines(report: dict) -> list[str]:
    """compare_rows' report as text: a line per row (TTFT and TPOT in ms, signed errors), then
    the summary line."""
    rows = [TABLE_COLUMNS] + [
        (result["id"], str(result["isl"]), str(result["osl"]), str(result["concurrency"]),
         str(result["tp_size"]), f"{result['real_ttft_ms']:.1f}", f"{result['sim_ttft_ms']:.1f}",
         f"{result['ttft_error_pct']:+.1f}", f"{result['real_tpot_ms']:.2f}",
         f"{result['sim_tpot_ms']:.2f}", f"{result['tpot_error_pct']:+.1f}")
        for result in report["rows"]]
    widths = [max(len(row[column]) for row in rows) for column in range(len(TABLE_COLUMNS))]
    lines = ["  ".join(cell.ljust(width) if column == 0 else cell.rjust(width)
                       for column, (cell, width) in enumerate(zip(row, widths)))
             for row in rows]
    return lines + [summary_line(report)]


def summary_line(report: dict) -> str:
    summary = report["summary"]
    if not summary["num_rows"]:
        return f"no row replayed ({summary['num_skipped']} skipped)"
    return (f"{summary['num_rows']} rows ({summary['num_skipped']} skipped), {report['waves']} "
            f"waves, engine settings {report['engine_settings']}: |TTFT error| mean "
            f"{summary['mean_abs_ttft_error_pct']:.1f} %, worst "
            f"{summary['worst_abs_ttft_error_pct']:.1f} %; |TPOT error| mean "
            f"{summary['mean_abs_tpot_error_pct']:.1f} %, worst "
            f"{summary['worst_abs_tpot_error_pct']:.1f} %; {summary['wall_s']:.1f} s")
