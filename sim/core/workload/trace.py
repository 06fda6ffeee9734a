"""The `trace` workload kind: arrival times and lengths replayed from a file, and the CSV parser
behind it. Formats (`workload.format`, or told apart by the file: a JSONL file is Mooncake, a
CSV by its header): the Azure LLM traces 2023 and 2024 `TIMESTAMP,ContextTokens,GeneratedTokens`,
BurstGPT `Timestamp,...,Request tokens,Response tokens,...`, plain
`arrival_time,prompt_len,output_len` (`arrival_s`, a `--real` CSV's name, also reads as
`arrival_time`), and Mooncake (mooncake.py: prompts as 512-token blocks of
content ids, turned into token ids). A CSV may carry the prompts themselves (a `prompt_token_ids`
column of space-separated ids) and each request's `priority`, `tenant`, `slo_ttft_ms`,
`slo_tpot_ms`, `session_id`, `timeout_s` (an empty cell: the default)."""
from __future__ import annotations

import csv
import math
import re
import sys
import warnings
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from sim.core.column_aliases import unify_columns
from sim.core.workload.fields import DEFAULT_TENANT, Fields, RequestArrays, Streams, parse_common
from sim.core.workload.mooncake import hash_ids_token_ids, read_mooncake

TRACE_FIELDS = ("kind", "trace_path", "format", "time_scale", "max_requests", "n",
                "with_token_ids", "shared_prefix_len", "timeout_s")
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
# BurstGPT's time (seconds), prompt and output columns; its Model, Total tokens and Log Type
# columns are not needed.
BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")
PLAIN_COLUMNS = ("arrival_time", "prompt_len", "output_len")
# Each CSV schema's (time, prompt length, output length) columns, in the order auto-detection
# tries them (detect_csv_schema).
CSV_SCHEMAS = {"azure": AZURE_COLUMNS, "burstgpt": BURSTGPT_COLUMNS, "plain": PLAIN_COLUMNS}
TRACE_FORMATS = ("auto", *CSV_SCHEMAS, "mooncake")
TOKEN_IDS_COLUMN = "prompt_token_ids"  # optional: the prompts themselves, space-separated ids
# Optional per-request metadata columns; an empty cell (or a missing column) is Request's default.
METADATA_COLUMNS = ("priority", "tenant", "slo_ttft_ms", "slo_tpot_ms", "session_id", "lora_id",
                    "timeout_s")

# A relative trace_path is looked up in the working directory, then here (the repo root), so the
# default config works whether or not Hydra changed the working directory.
REPO_ROOT = Path(__file__).resolve().parents[3]


def sample_trace(fields: Fields, vocab_size: int | None, streams: Streams) -> RequestArrays:
    """The trace's requests in arrival order (a stable sort: ties keep file order), the first
    `max_requests` of them, arrival times scaled by `time_scale`; nothing is drawn. A Mooncake
    trace's prompts are always token ids (its hash_ids' content, so it needs `vocab_size`)."""
    fields.reject_unknown(TRACE_FIELDS)
    trace_path = resolve_trace_path(fields.string("trace_path"))
    trace_format = fields.choice("format", TRACE_FORMATS, default="auto")
    time_scale = fields.number("time_scale", default=1.0, greater_than=0.0)
    max_requests = fields.integer("max_requests", default=None, minimum=1)
    n, token_spec = parse_common(fields, vocab_size)

    hash_ids = None
    if trace_format == "mooncake" or (trace_format == "auto" and is_jsonl(trace_path)):
        if vocab_size is None:
            raise ValueError(f"{fields.name('trace_path')}: the Mooncake trace {trace_path} "
                             f"gives prompts as content (hash_ids), which needs a vocab_size: "
                             f"call build_workload(cfg, seed=..., vocab_size=...)")
        arrival_times, prompt_lens, output_lens, hash_ids, trace_metadata = (
            read_mooncake(trace_path))
        trace_token_ids = None
    else:
        arrival_times, prompt_lens, output_lens, trace_token_ids, trace_metadata = (
            read_trace(trace_path, trace_format))
    order = np.argsort(arrival_times, kind="stable")[:max_requests]
    arrival_times = arrival_times[order] * time_scale
    prompt_lens, output_lens = prompt_lens[order], output_lens[order]
    metadata = {name: [values[i] for i in order.tolist()]
                for name, values in trace_metadata.items()}
    token_ids = None
    if hash_ids is not None or trace_token_ids is not None:
        if token_spec is not None and token_spec[1]:
            raise ValueError(f"{fields.name('shared_prefix_len')}: trace {trace_path} has "
                             f"its own prompt_token_ids")
        if hash_ids is not None:
            # Only the kept requests' ids are built: a slice of a long trace is quick.
            token_ids = hash_ids_token_ids([hash_ids[i] for i in order.tolist()],
                                           prompt_lens.tolist(), int(vocab_size))
        else:
            _check_vocabulary(trace_token_ids, vocab_size, trace_path)
            token_ids = [trace_token_ids[i] for i in order.tolist()]
    return RequestArrays(arrival_times, prompt_lens, output_lens, n, token_spec,
                         token_ids=token_ids, metadata=metadata)


def is_jsonl(path: Path) -> bool:
    """Whether a trace file is JSON lines (a Mooncake trace): its suffix, else its first
    non-blank character is `{`."""
    if path.suffix.lower() == ".jsonl":
        return True
    try:
        with open(path, encoding="utf-8-sig", errors="replace") as file:
            for line in file:
                if line.strip():
                    return line.lstrip().startswith("{")
    except OSError:
        pass  # read_trace names the error
    return False


def resolve_trace_path(trace_path: str | Path) -> Path:
    """An absolute path as is; a relative one against the working directory, then the repo root."""
    path = Path(trace_path).expanduser()
    candidates = [path] if path.is_absolute() else [Path.cwd() / path, REPO_ROOT / path]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    tried = " or ".join(str(candidate) for candidate in candidates)
    raise ValueError(f"workload.trace_path: no trace file at {tried}")


def read_trace(path: str | Path, trace_format: str = "auto") -> tuple[
        np.ndarray, np.ndarray, np.ndarray, list[list[int]] | None, dict[str, list]]:
    """A CSV trace in file order: (arrival_time s from the earliest row, prompt_len, output_len)
    arrays, the prompts' token ids (None without a `prompt_token_ids` column), and the values of
    each METADATA_COLUMNS column it has, by column. The formats: the module docstring."""
    path = Path(path)
    header, rows, line_numbers = _read_csv_rows(path)
    header = unify_columns(header, rows, line_numbers, PLAIN_COLUMNS, f"trace {path}")
    schema = trace_format if trace_format != "auto" else detect_csv_schema(header)
    columns = CSV_SCHEMAS[schema]
    _check_columns(header, columns, trace_format, path)
    if schema == "burstgpt":
        rows, line_numbers = _drop_failed_requests(rows, line_numbers, header, path)
    if not rows:
        raise ValueError(f"trace {path}: no data rows")
    time_column, prompt_column, output_column = _length_columns(header, columns, rows,
                                                                line_numbers, path)
    arrival_times = _parse_times(time_column, columns[0], line_numbers, path)
    prompt_lens = _parse_lengths(prompt_column, columns[1], line_numbers, path)
    output_lens = _parse_lengths(output_column, columns[2], line_numbers, path)
    token_ids = None
    if TOKEN_IDS_COLUMN in header:
        token_ids = _token_ids_column(header.index(TOKEN_IDS_COLUMN), rows, prompt_lens,
                                      line_numbers, path)
    metadata = {name: _parse_metadata(_cells(rows, header.index(name)), name, line_numbers, path)
                for name in METADATA_COLUMNS if name in header}
    return arrival_times, prompt_lens, output_lens, token_ids, metadata


def _read_csv_rows(path: Path) -> tuple[list[str], list[list[str]], list[int]]:
    """The header, the non-blank rows and their line numbers."""
    try:
        # utf-8-sig drops a byte-order mark that would otherwise stick to the first column name.
        with open(path, newline="", encoding="utf-8-sig") as file:
            reader = csv.reader(file)
            header = [name.strip() for name in next(reader, [])]
            rows, line_numbers = [], []
            for row in reader:
                if row:
                    rows.append(row)
                    line_numbers.append(reader.line_num)
    except OSError as error:
        raise ValueError(f"trace {path}: cannot read: {error.strerror or error}") from None
    return header, rows, line_numbers


def _check_columns(header: list[str], columns: tuple[str, ...], trace_format: str,
                   path: Path) -> None:
    missing = [name for name in columns if name not in header]
    if missing:
        expected = "; expected " + " or ".join(
            f"{', '.join(names)} ({name})" for name, names in CSV_SCHEMAS.items()
            if trace_format in ("auto", name))
        raise ValueError(
            f"trace {path}: missing column(s) {', '.join(missing)}; found "
            f"{', '.join(header) or 'no header'}{expected}")


def _length_columns(header: list[str], columns: tuple[str, ...], rows: list[list[str]],
                    line_numbers: list[int], path: Path) -> list[list[str]]:
    """The time, prompt and output columns' stripped cells; a row too short is an error."""
    indices = [header.index(name) for name in columns]
    for row_number, (row, line) in enumerate(zip(rows, line_numbers), start=1):
        if len(row) <= max(indices):
            raise ValueError(f"trace {path}: row {row_number} (line {line}) has {len(row)} "
                             f"field(s), expected {len(header)}")
    return [[row[index].strip() for row in rows] for index in indices]


def _token_ids_column(index: int, rows: list[list[str]], prompt_lens: np.ndarray,
                      line_numbers: list[int], path: Path) -> list[list[int]]:
    return [_parse_token_ids(row[index] if index < len(row) else "", prompt_len,
                             f"row {number} (line {line})", path)
            for number, (row, prompt_len, line) in enumerate(
                zip(rows, prompt_lens.tolist(), line_numbers), start=1)]


def _cells(rows: list[list[str]], index: int) -> list[str]:
    """One column's stripped cells, empty where a row is too short."""
    return [row[index].strip() if index < len(row) else "" for row in rows]


def detect_csv_schema(header: list[str]) -> str:
    """The CSV_SCHEMAS name a header is: the first schema it has all the columns of, else the
    first it has any of (whose missing columns the caller names), else plain."""
    present = set(header)
    for name, columns in CSV_SCHEMAS.items():
        if present.issuperset(columns):
            return name
    return next((name for name, columns in CSV_SCHEMAS.items() if present & set(columns)),
                "plain")


def _drop_failed_requests(rows: list[list[str]], line_numbers: list[int], header: list[str],
                          path: Path) -> tuple[list[list[str]], list[int]]:
    """BurstGPT logs failed requests with 0 request or response tokens: nothing to replay."""
    indices = [header.index(name) for name in BURSTGPT_COLUMNS[1:]]
    kept = [(row, line) for row, line in zip(rows, line_numbers)
            if not any(index < len(row) and _is_zero(row[index]) for index in indices)]
    if len(kept) < len(rows):
        print(f"twinserve: trace {path}: skipped {len(rows) - len(kept):,} BurstGPT row(s) with 0 "
              f"{' or '.join(BURSTGPT_COLUMNS[1:])} (failed requests)", file=sys.stderr)
    return [row for row, _ in kept], [line for _, line in kept]


def _is_zero(cell: str) -> bool:
    try:
        return float(cell) == 0
    except ValueError:
        return False


def _parse_metadata(cells: list[str], column: str, line_numbers: list[int], path: Path) -> list:
    """One METADATA_COLUMNS column's values; an empty cell gives Request's default."""
    if column == "tenant":
        return [cell or DEFAULT_TENANT for cell in cells]
    if column == "session_id":
        # Integers when every id is one, so they compare and sort like generated sessions' ids.
        if all(not cell or re.fullmatch(r"[+-]?\d+", cell) for cell in cells):
            return [int(cell) if cell else None for cell in cells]
        return [cell or None for cell in cells]
    values: list = []
    for index, cell in enumerate(cells):
        if not cell:
            values.append(0 if column == "priority" else None)
            continue
        try:
            number = float(cell)
        except ValueError:
            number = math.nan
        if column == "priority":
            if not number.is_integer():  # NaN and inf are not integers either
                raise _bad_row_error(path, line_numbers, index, column, "an integer", cell)
            values.append(int(number))
        elif column == "lora_id":
            if not (number.is_integer() and number >= 0):
                raise _bad_row_error(path, line_numbers, index, column,
                                     "an adapter index (an integer >= 0) or empty", cell)
            values.append(int(number))
        else:
            if not (math.isfinite(number) and number > 0):
                unit = "seconds" if column == "timeout_s" else "ms"
                raise _bad_row_error(path, line_numbers, index, column,
                                     f"a positive number of {unit} or empty", cell)
            values.append(number)
    return values


def _parse_token_ids(text: str, prompt_len: int, where: str, path: Path) -> list[int]:
    try:
        token_ids = [int(token) for token in text.split()]
    except ValueError:
        raise ValueError(f"trace {path}: {where}: {TOKEN_IDS_COLUMN} must be space-separated "
                         f"integers, got {text[:40]!r}") from None
    if len(token_ids) != prompt_len:
        raise ValueError(f"trace {path}: {where}: {len(token_ids)} {TOKEN_IDS_COLUMN} for a "
                         f"prompt_len of {prompt_len}")
    return token_ids


def _check_vocabulary(token_ids: list[list[int]], vocab_size: int | None, path: Path) -> None:
    """Every id within the model's vocabulary (when the caller gives it)."""
    if vocab_size is None:
        return
    for row, ids in enumerate(token_ids, start=1):
        if ids and (min(ids) < 0 or max(ids) >= vocab_size):
            raise ValueError(f"trace {path}: row {row}: {TOKEN_IDS_COLUMN} outside the "
                             f"model's vocabulary [0, {vocab_size})")


def _bad_row_error(path: Path, line_numbers: list[int], index: int, column: str, what: str,
                   value: str) -> ValueError:
    return ValueError(f"trace {path}: row {index + 1} (line {line_numbers[index]}): {column} "
                      f"must be {what}, got {value!r}")


def _parse_lengths(values: list[str], column: str, line_numbers: list[int],
                   path: Path) -> np.ndarray:
    try:
        lengths = np.array(values, dtype=np.float64)
    except ValueError:
        lengths = None
    if lengths is None:  # find the culprit only on the error path
        for index, value in enumerate(values):
            try:
                float(value)
            except ValueError:
                raise _bad_row_error(path, line_numbers, index, column, "a positive integer",
                                     value) from None
    # NaN and inf fail these checks too.
    bad = ~np.isfinite(lengths) | (lengths < 1) | (lengths != np.floor(lengths))
    if bad.any():
        index = int(np.argmax(bad))
        raise _bad_row_error(path, line_numbers, index, column, "a positive integer", values[index])
    return lengths.astype(np.int64)


# Python's datetime.fromisoformat reads at most 6 fractional digits; the Azure trace has 7.
_EXTRA_FRACTION_DIGITS = re.compile(r"(\.\d{6})\d+")
_TIMEZONE_SUFFIX = re.compile(r"(Z|[+-]\d\d:?\d\d)$")


def _parse_times(values: list[str], column: str, line_numbers: list[int],
                 path: Path) -> np.ndarray:
    """Seconds relative to the earliest value; numeric seconds or ISO datetimes."""
    try:
        seconds = np.array(values, dtype=np.float64)
    except ValueError:
        seconds = _parse_datetimes(values, column, line_numbers, path)
    bad = ~np.isfinite(seconds)
    if bad.any():
        index = int(np.argmax(bad))
        raise _bad_row_error(path, line_numbers, index, column, "a finite time", values[index])
    return seconds - seconds.min()


def _parse_datetimes(values: list[str], column: str, line_numbers: list[int],
                     path: Path) -> np.ndarray:
    """Seconds since the earliest of some datetime strings (naive ones taken as UTC)."""
    # Fast path: numpy parses naive ISO datetimes with up to 9 fractional digits, vectorised.
    # It warns about (and we then refuse) timezone offsets; one offset shared by every value
    # (Azure 2024's "+00:00") cancels out of the differences, so it is cut first. Mixed offsets
    # take the slow path.
    offsets = {match.group(0) if (match := _TIMEZONE_SUFFIX.search(value)) else ""
               for value in values}
    if len(offsets) == 1:
        offset = offsets.pop()
        naive = [value[:-len(offset)] for value in values] if offset else values
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                stamps = np.array(naive, dtype="datetime64[ns]")
            return (stamps - stamps.min()).astype(np.int64) / 1e9
        except (ValueError, Warning):
            pass
    # Slow path: one row at a time, dropping fractional digits past the 6th (sub-microsecond).
    stamps = []
    for index, value in enumerate(values):
        try:
            stamp = datetime.fromisoformat(_EXTRA_FRACTION_DIGITS.sub(r"\1", value))
        except ValueError:
            raise _bad_row_error(path, line_numbers, index, column,
                                 "a datetime like 2023-11-16 18:17:03.9799600 or seconds",
                                 value) from None
        stamps.append(stamp if stamp.tzinfo else stamp.replace(tzinfo=timezone.utc))
    earliest = min(stamps)
    # Differences of datetimes are exact to the microsecond, unlike epoch seconds as floats.
    return np.array([(stamp - earliest).total_seconds() for stamp in stamps])
