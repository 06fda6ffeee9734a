"""Readers of measured serving runs into a RealRun, one per format (docs/calibration.md, "Real
runs"): LLMServingSim's `vllm_requests.jsonl` (with its vllm_meta.json, config.json and workload
file beside it), `vllm bench serve --save-detailed` and twinserve-bench JSON, and a plain CSV.
`read_run(path)` picks the reader by the path; bad fields raise RealRunError naming the file and
the field."""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np

from calibration.realrun.prompt_blocks import (find_workload_file, sharing_note,
                                               workload_hash_ids)
from calibration.realrun.run import RealRun, RealRunError, make_run
from sim.core.column_aliases import unify_columns

LLMSERVINGSIM_REQUESTS = "vllm_requests.jsonl"
CSV_REQUIRED = ("arrival_s", "prompt_len", "output_len", "ttft_s", "e2e_s")
CSV_OPTIONAL = ("tpot_s", "stage")
# vLLM added per-request send times to its detailed JSON in PR #32667 (January 2026).
NO_START_TIMES = ("has no 'start_times' (vLLM's bench serve records per-request send times "
                  "only since PR #32667, January 2026); add a 'start_times' list (s, one per "
                  "request) to the JSON, or write the run as a CSV with an arrival_s column")


def read_run(path: str | Path) -> RealRun:
    """The run at `path`: a folder holding vllm_requests.jsonl, or a .jsonl, .json or .csv."""
    path = Path(path)
    if path.is_dir():
        requests = path / LLMSERVINGSIM_REQUESTS
        if not requests.is_file():
            raise RealRunError(f"{path}: a run folder must hold {LLMSERVINGSIM_REQUESTS}")
        return read_llmservingsim(requests)
    if not path.is_file():
        raise RealRunError(f"{path}: no such run file or folder")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return read_llmservingsim(path)
    if suffix == ".json":
        return read_bench_json(path)
    if suffix == ".csv":
        return read_csv_run(path)
    raise RealRunError(f"{path}: unknown run format {suffix or '(no suffix)'}; expected a folder "
                       f"with {LLMSERVINGSIM_REQUESTS}, .jsonl, .json (vllm bench serve "
                       f"--save-detailed, twinserve-bench) or .csv")


def _load_json(path: Path):
    try:
        return json.loads(path.read_text())
    except OSError as error:
        raise RealRunError(f"{path}: cannot read: {error.strerror or error}") from None
    except json.JSONDecodeError as error:
        raise RealRunError(f"{path}: not JSON ({error.msg} at line {error.lineno})") from None


# ---- LLMServingSim ------------------------------------------------------------------------------

def read_llmservingsim(path: Path) -> RealRun:
    """LLMServingSim's vllm_requests.jsonl: TTFT = first_token_ts - queued_ts, E2E =
    last_token_ts - queued_ts, arrival = queued_ts (the engine's own clock)."""
    fields = ("input_toks", "output_toks", "queued_ts", "first_token_ts", "last_token_ts")
    rows, records = [], []
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        raise RealRunError(f"{path}: cannot read: {error.strerror or error}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise RealRunError(f"{path}: line {number} is not JSON ({error.msg})") from None
        missing = [name for name in fields if record.get(name) is None]
        if missing:
            raise RealRunError(f"{path}: line {number} lacks field {missing[0]!r}")
        rows.append([record[name] for name in fields])
        records.append(record)
    if not rows:
        raise RealRunError(f"{path}: no requests")
    try:
        table = np.asarray(rows, dtype=np.float64)
    except (TypeError, ValueError):
        bad = next(name for name in fields for row in rows
                   if not isinstance(row[fields.index(name)], (int, float)))
        raise RealRunError(f"{path}: field {bad!r} must be a number") from None
    prompt, output, queued, first, last = table.T
    settings, notes = llmservingsim_settings(path.parent)
    hash_ids = llmservingsim_hash_ids(path, records, notes)
    return make_run(
        name=f"{path.parent.parent.name}/{path.parent.name}",
        source=f"{path} (LLMServingSim per-request JSONL)", where=str(path),
        arrival_s=queued, prompt_len=prompt, output_len=output, ttft_s=first - queued,
        e2e_s=last - queued, engine_settings=settings, notes=notes, prompt_hash_ids=hash_ids,
        field_names={"arrival_s": "queued_ts", "prompt_len": "input_toks",
                     "output_len": "output_toks", "ttft_s": "first_token_ts - queued_ts",
                     "e2e_s": "last_token_ts - queued_ts"})


def llmservingsim_hash_ids(path: Path, records: list[dict],
                           notes: list[str]) -> list[list[int]] | None:
    """The prompts' hash ids from the workload file vllm_meta.json's dataset_path names, where
    it is found (prompt_blocks.py), a line on which is added to `notes`; else None."""
    meta_path = path.parent / "vllm_meta.json"
    dataset_path = _load_json(meta_path).get("dataset_path") if meta_path.is_file() else None
    if not dataset_path:
        return None
    workload = find_workload_file(path.parent, dataset_path)
    if workload is None:
        notes.append(f"workload file {Path(str(dataset_path)).name} (vllm_meta.json "
                     f"dataset_path) not found beside the run: prompts share no prefix")
        return None
    hash_ids = workload_hash_ids(workload, records, path)
    notes.append(sharing_note(workload, hash_ids, [r["input_toks"] for r in records]))
    return hash_ids


def llmservingsim_settings(folder: Path) -> tuple[dict, list[str]]:
    """Engine settings from vllm_meta.json (engine_kwargs, kv_cache, hardware, the resolved
    scheduler config) and LLMServingSim's config.json beside it, each where recorded."""
    settings: dict = {}
    notes: list[str] = []
    meta_path = folder / "vllm_meta.json"
    if meta_path.is_file():
        meta = _load_json(meta_path)
        engine = meta.get("engine_kwargs") or {}
        kv_cache = meta.get("kv_cache") or {}
        hardware = meta.get("hardware") or {}
        scheduler = (meta.get("resolved_config") or {}).get("scheduler_config") or {}
        candidates = {
            "model": engine.get("model") or meta.get("model"),
            "tensor_parallel_size": engine.get("tensor_parallel_size"),
            "data_parallel_size": engine.get("data_parallel_size"),
            "enable_expert_parallel": engine.get("enable_expert_parallel"),
            "max_num_seqs": scheduler.get("max_num_seqs", engine.get("max_num_seqs")),
            "max_num_batched_tokens": scheduler.get("max_num_batched_tokens",
                                                    engine.get("max_num_batched_tokens")),
            "enable_chunked_prefill": scheduler.get("enable_chunked_prefill"),
            "block_size": kv_cache.get("block_size"),
            "num_gpu_blocks": kv_cache.get("num_gpu_blocks"),
            "enable_prefix_caching": kv_cache.get("enable_prefix_caching"),
            "gpu_memory_utilization": kv_cache.get("gpu_memory_utilization"),
            "hardware": hardware.get("device_name"),
            "device_memory_bytes": hardware.get("device_total_memory_bytes"),
            "vllm_version": meta.get("vllm_version"),
        }
        settings.update({key: value for key, value in candidates.items() if value is not None})
    cluster_path = folder / "config.json"
    if cluster_path.is_file():
        instances = [instance for node in (_load_json(cluster_path).get("nodes") or [])
                     for instance in (node.get("instances") or [])]
        if instances:
            instance = instances[0]
            memory = instance.get("npu_mem") or {}
            for key, value in (("hardware", instance.get("hardware")),
                               ("model", instance.get("model_name")),
                               ("tensor_parallel_size", instance.get("tp_size")),
                               ("gpu_memory_utilization", memory.get("mem_util"))):
                if value is not None and key not in settings:
                    settings[key] = value
    if not meta_path.is_file():
        notes.append("no vllm_meta.json beside the run: engine settings from the command line")
    return settings, notes


# ---- vllm bench serve / twinserve-bench ---------------------------------------------------------

def _per_request(result: dict, key: str, path: Path, count: int | None) -> list:
    values = result.get(key)
    if not isinstance(values, list):
        raise RealRunError(f"{path}: field {key!r} is missing or not a list (save the run with "
                           f"--save-result --save-detailed)")
    if count is not None and len(values) != count:
        raise RealRunError(f"{path}: field {key!r} has {len(values)} values for {count} requests")
    return values


def read_bench_json(path: Path) -> RealRun:
    """`vllm bench serve --save-result --save-detailed` JSON or twinserve-bench's. E2E from e2els,
    latencies, or ttft + sum(itls) (equal for a streamed response); failed requests are left out,
    abandoned ones kept with NaN latencies, as the replay sends them with the same deadlines."""
    result = _load_json(path)
    if not isinstance(result, dict):
        raise RealRunError(f"{path}: expected a JSON object (a vllm bench serve result)")
    prompt = _per_request(result, "input_lens", path, None)
    count = len(prompt)
    output = _per_request(result, "output_lens", path, count)
    ttft = _per_request(result, "ttfts", path, count)
    if "start_times" not in result:
        raise RealRunError(f"{path}: {NO_START_TIMES}")
    start = _per_request(result, "start_times", path, count)
    itls = _per_request(result, "itls", path, count) if "itls" in result else None
    e2e_key = next((key for key in ("e2els", "latencies") if key in result), None)
    if e2e_key is not None:
        e2e = _per_request(result, e2e_key, path, count)
    elif itls is not None:
        e2e = [None if t is None or gaps is None else t + math.fsum(gaps)
               for t, gaps in zip(ttft, itls)]
    else:
        raise RealRunError(f"{path}: no per-request end-to-end latency: needs field 'e2els', "
                           f"'latencies' or 'itls'")
    errors = result.get("errors")
    failed = ([i for i, error in enumerate(errors) if error]
              if isinstance(errors, list) and len(errors) == count else [])
    keep = [i for i in range(count) if i not in set(failed)]
    notes = []
    if failed:
        notes.append(f"{len(failed)} failed requests left out (their 'errors' entry is set)")
    stages = result.get("stages")
    settings = result.get("engine_settings") or {}
    if not isinstance(settings, dict):
        raise RealRunError(f"{path}: field 'engine_settings' must be an object")
    settings = dict(settings)
    if "model" not in settings and result.get("model_id"):
        settings["model"] = result["model_id"]
    deadlines = ([math.nan if value is None else value
                  for value in _per_request(result, "timeout_s", path, count)]
                 if "timeout_s" in result else [math.nan] * count)
    abandoned_times = (_per_request(result, "abandoned_times", path, count)
                       if "abandoned_times" in result else [None] * count)
    abandoned = {i for i, when in enumerate(abandoned_times) if when is not None}
    if abandoned:
        notes.append(f"{len(abandoned)} requests abandoned at their timeout_s: replayed with "
                     f"their deadlines, their latencies left out")
        # The file holds placeholders (vLLM's 0 and 0.0): the length asked for, no latencies.
        expected = _per_request(result, "expected_output_lens", path, count)
        output = [expected[i] if i in abandoned else n for i, n in enumerate(output)]
        ttft = [math.nan if i in abandoned else t for i, t in enumerate(ttft)]
        e2e = [math.nan if i in abandoned else t for i, t in enumerate(e2e)]
    pick = lambda values: [values[i] for i in keep]   # noqa: E731
    deadlines = _numbers(pick(deadlines), "timeout_s", path)
    fmt = "twinserve-bench" if "engine_settings" in result else "vllm bench serve detailed"
    return make_run(
        name=path.stem, source=f"{path} ({fmt} JSON)", where=str(path),
        arrival_s=_numbers(pick(start), "start_times", path),
        prompt_len=_numbers(pick(prompt), "input_lens", path),
        output_len=_numbers(pick(output), "output_lens", path),
        ttft_s=_numbers(pick(ttft), "ttfts", path),
        e2e_s=_numbers(pick(e2e), e2e_key or "itls", path),
        engine_settings=settings, notes=notes,
        stage_labels=pick(_per_request(result, "stages", path, count)) if stages is not None
        else None,
        itls_s=pick(itls) if itls is not None else None,
        timeout_s=deadlines if np.isfinite(deadlines).any() else None,
        field_names={"arrival_s": "start_times", "prompt_len": "input_lens",
                     "output_len": "output_lens", "ttft_s": "ttfts", "e2e_s": e2e_key or "itls"})


def _numbers(values: list, key: str, path: Path) -> np.ndarray:
    for index, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RealRunError(f"{path}: field {key!r} of request {index} must be a number, got "
                               f"{value!r}")
    return np.asarray(values, dtype=np.float64)


# ---- CSV ----------------------------------------------------------------------------------------

def read_csv_run(path: Path) -> RealRun:
    """A CSV with a header: arrival_s (or arrival_time), prompt_len, output_len, ttft_s, e2e_s,
    optional tpot_s and stage; the engine settings come from the command line."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as file:
            reader = csv.reader(file)
            header = [name.strip() for name in next(reader, [])]
            rows, line_numbers = [], []
            for row in reader:
                if any(cell.strip() for cell in row):
                    rows.append(row)
                    line_numbers.append(reader.line_num)
    except OSError as error:
        raise RealRunError(f"{path}: cannot read: {error.strerror or error}") from None
    try:
        header = unify_columns(header, rows, line_numbers, CSV_REQUIRED, str(path))
    except ValueError as error:
        raise RealRunError(str(error)) from None
    missing = [name for name in CSV_REQUIRED if name not in header]
    if missing:
        raise RealRunError(f"{path}: missing column {missing[0]!r}; a CSV run has columns "
                           f"{', '.join(CSV_REQUIRED)} (optional {', '.join(CSV_OPTIONAL)})")
    if not rows:
        raise RealRunError(f"{path}: no data rows")
    columns: dict[str, list[float]] = {name: [] for name in CSV_REQUIRED}
    has_tpot = "tpot_s" in header
    if has_tpot:
        columns["tpot_s"] = []
    for line, cells in zip(line_numbers, rows):
        row = dict(zip(header, cells))
        for name in columns:
            cell = (row.get(name) or "").strip()
            try:
                columns[name].append(float(cell) if cell or name != "tpot_s" else math.nan)
            except ValueError:
                raise RealRunError(f"{path}: line {line}: column {name!r} must be a number, got "
                                   f"{cell!r}") from None
    stage = header.index("stage") if "stage" in header else None
    stages = (None if stage is None else
              [(cells[stage] if stage < len(cells) else "").strip() for cells in rows])
    return make_run(name=path.stem, source=f"{path} (CSV run)", where=str(path),
                    stage_labels=stages, **columns)
