"""A run's output files: summary.json, requests.csv, steps.csv and the PNG plots, or a streamed
run's rows as it drops them (`StreamedOutputs`). summary.json is written last and each file whole
or not at all, so that a folder with summary.json holds the run's other files.
"""
from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from policies.types import Request
from sim.core.energy.meter import EnergyMeter
from runtime.metrics import STEP_COLUMNS, MetricsCollector, request_latencies_s
from runtime.metrics.statistics import ms_or_none

REQUEST_COLUMNS: tuple[str, ...] = (
    "request_id", "replica_id", "arrival_time", "prompt_len", "output_len", "n",
    "num_output_tokens", "first_scheduled_time", "first_token_time", "finish_time",
    "ttft_ms", "tpot_ms", "e2el_ms", "num_preemptions", "rejected_reason",
    "priority", "tenant", "slo_ttft_ms", "slo_tpot_ms", "predicted_output_len",
    "prefill_replica_id", "kv_handoff_time", "kv_transfer_start_time", "kv_transfer_end_time",
    "kv_transfer_bytes", "session_id", "turn", "lora_id", "timeout_s", "abandoned_time",
)


def request_rows(requests: list[Request]) -> list[tuple]:
    """One tuple per request, in REQUEST_COLUMNS order; None (an empty CSV cell) where a value
    does not exist, e.g. the TTFT of a rejected request."""
    rows = []
    for request in requests:
        ttft, tpot, e2el = request_latencies_s(request)
        rows.append((
            request.request_id, request.replica_id, request.arrival_time, request.prompt_len,
            request.output_len, request.n, request.num_output_tokens,
            request.first_scheduled_time, request.first_token_time, request.finish_time,
            ms_or_none(ttft), ms_or_none(tpot), ms_or_none(e2el), request.num_preemptions, request.rejected_reason,
            request.priority, request.tenant, request.slo_ttft_ms, request.slo_tpot_ms,
            request.predicted_output_len, request.prefill_replica_id, request.kv_handoff_time,
            request.kv_transfer_start_time, request.kv_transfer_end_time,
            request.kv_transfer_bytes, request.session_id, request.turn, request.lora_id,
            request.timeout_s, request.abandoned_time,
        ))
    return rows


@contextmanager
def atomic_file(path: Path) -> Iterator[TextIO]:
    """A text file that appears at `path` only once the block finishes (written under a temporary
    name and renamed), so that a process killed mid-write never leaves a truncated one."""
    path = Path(path)
    temporary = _temporary_path(path)
    try:
        with open(temporary, "w", newline="") as file:
            yield file
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def _temporary_path(path: Path) -> Path:
    """Where `path` is written before it is renamed into place."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


class StreamedOutputs:
    """A streamed run's requests.csv and steps.csv, written a chunk of rows at a time under
    temporary names and renamed into place by `finish`, which writes summary.json last."""

    def __init__(self, out_dir: Path):
        out_dir.mkdir(parents=True, exist_ok=True)
        self.out_dir = out_dir
        self._files = {}
        self._writers = {}
        for name, columns in (("requests.csv", REQUEST_COLUMNS), ("steps.csv", STEP_COLUMNS)):
            file = open(_temporary_path(out_dir / name), "w", newline="")
            self._files[name], self._writers[name] = file, csv.writer(file)
            self._writers[name].writerow(columns)

    def write_requests(self, requests: list[Request]) -> None:
        self._writers["requests.csv"].writerows(request_rows(requests))

    def write_steps(self, rows: list[tuple]) -> None:
        self._writers["steps.csv"].writerows(rows)

    def finish(self, summary: dict) -> list[Path]:
        """Put the CSVs in place, then summary.json; returns the paths written."""
        summary_text = json.dumps(summary, indent=2, allow_nan=False) + "\n"
        paths = []
        for name, file in self._files.items():
            file.close()
            os.replace(_temporary_path(self.out_dir / name), self.out_dir / name)
            paths.append(self.out_dir / name)
        summary_path = self.out_dir / "summary.json"
        with atomic_file(summary_path) as file:
            file.write(summary_text)
        return [summary_path, *paths]


def _write_csv(path: Path, columns: tuple[str, ...], rows: list[tuple]) -> Path:
    """A CSV file of `rows` under a header of `columns`."""
    with atomic_file(path) as file:
        writer = csv.writer(file)
        writer.writerow(columns)
        writer.writerows(rows)
    return path


def write_run_outputs(out_dir: Path, metrics: MetricsCollector, requests: list[Request],
                      summary: dict, plots: bool = True,
                      energy_meters: Mapping[int, EnergyMeter | None] | None = None) -> list[Path]:
    """Write summary.json, requests.csv, steps.csv and (unless plots=False) the PNG plots into
    out_dir; returns the paths written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # allow_nan=False: fail loudly here rather than write JSON other tools cannot parse.
    summary_text = json.dumps(summary, indent=2, allow_nan=False) + "\n"
    requests_path = _write_csv(out_dir / "requests.csv", REQUEST_COLUMNS,
                               request_rows(requests))
    steps_path = _write_csv(out_dir / "steps.csv", STEP_COLUMNS, metrics.step_rows)
    plot_paths = []
    if plots:
        # Imported here so that runs that never plot never import matplotlib.
        from sim.tools.plots import kv_block_capacities, write_plots
        plot_paths = write_plots(out_dir, requests, metrics.step_rows, STEP_COLUMNS,
                                 metrics.replica_labels, kv_block_capacities(summary),
                                 energy_meters, summary)
    # Last: the report takes a job with summary.json for a finished one.
    summary_path = out_dir / "summary.json"
    with atomic_file(summary_path) as file:
        file.write(summary_text)
    return [summary_path, requests_path, steps_path, *plot_paths]
