"""A serving run someone measured, in memory: one row per completed request and per request its
client abandoned at its deadline (which loaded the server, so the replay sends it too), the
engine settings its file records and its source; readers build one with `make_run`."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from calibration.validate.compare import ValidationInputError


class RealRunError(ValidationInputError):
    """A run file that cannot be read or replayed: one line naming the file and the field."""


@dataclass
class RealRun:
    """Completed requests in arrival order, arrivals in seconds from the first; tpot_s is vLLM's
    per-request (e2e - ttft) / (output_len - 1), NaN for one-token outputs."""
    name: str
    source: str                   # the file and its format, for reports
    arrival_s: np.ndarray
    prompt_len: np.ndarray
    output_len: np.ndarray
    ttft_s: np.ndarray
    e2e_s: np.ndarray
    tpot_s: np.ndarray
    engine_settings: dict = field(default_factory=dict)
    stage_labels: list[str] | None = None   # an explicit stage per request, when the file has one
    itls_s: list[list[float]] | None = None
    notes: list[str] = field(default_factory=list)   # what the reader left out or assumed
    # Each prompt's chained block ids where the run's workload file gives them (prompt_blocks).
    prompt_hash_ids: list[list[int]] | None = None
    # Each request's deadline, s after its arrival (NaN: none), where the file records them.
    timeout_s: np.ndarray | None = None

    @property
    def num_requests(self) -> int:
        return int(self.arrival_s.size)


def per_request_tpot(ttft_s: np.ndarray, e2e_s: np.ndarray, output_len: np.ndarray) -> np.ndarray:
    """vLLM's per-request TPOT, (e2e - ttft) / (output_len - 1); NaN where output_len <= 1."""
    tokens_after_first = output_len.astype(np.float64) - 1.0
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(tokens_after_first > 0, (e2e_s - ttft_s) / tokens_after_first, np.nan)


def _column(values, name: str, where: str, dtype) -> np.ndarray:
    try:
        array = np.asarray(values, dtype=dtype)
    except (TypeError, ValueError):
        raise RealRunError(f"{where}: field {name!r} must hold numbers") from None
    if array.ndim != 1:
        raise RealRunError(f"{where}: field {name!r} must be a list of numbers, one per request")
    return array


def make_run(*, name: str, source: str, where: str, arrival_s, prompt_len, output_len, ttft_s,
             e2e_s, tpot_s=None, engine_settings: dict | None = None,
             stage_labels: list | None = None, itls_s: list | None = None,
             notes: list[str] | None = None, field_names: dict[str, str] | None = None,
             prompt_hash_ids: list | None = None, timeout_s=None) -> RealRun:
    """A RealRun from per-request columns, checked and sorted by arrival (stable), arrivals
    rebased to 0; `where` names the file in errors, `field_names` the file's own column names."""
    names = {"arrival_s": "arrival_s", "prompt_len": "prompt_len", "output_len": "output_len",
             "ttft_s": "ttft_s", "e2e_s": "e2e_s", "tpot_s": "tpot_s", **(field_names or {})}
    columns = {
        "arrival_s": _column(arrival_s, names["arrival_s"], where, np.float64),
        "prompt_len": _column(prompt_len, names["prompt_len"], where, np.float64),
        "output_len": _column(output_len, names["output_len"], where, np.float64),
        "ttft_s": _column(ttft_s, names["ttft_s"], where, np.float64),
        "e2e_s": _column(e2e_s, names["e2e_s"], where, np.float64),
    }
    if timeout_s is not None:
        columns["timeout_s"] = _column(timeout_s, "timeout_s", where, np.float64)
    count = columns["arrival_s"].size
    for key, values in columns.items():
        if values.size != count:
            raise RealRunError(f"{where}: field {names.get(key, key)!r} has {values.size} values "
                               f"for {count} requests")
    deadlines = columns.pop("timeout_s", None)
    # Only a request with a deadline may lack latencies: its client abandoned it.
    abandoned = (np.zeros(count, dtype=bool) if deadlines is None
                 else np.isnan(columns["e2e_s"]) & np.isfinite(deadlines))
    if count == 0 or abandoned.all():
        raise RealRunError(f"{where}: no completed requests")
    _check_values(columns, names, abandoned, deadlines, where)
    ttft, e2e = columns["ttft_s"], columns["e2e_s"]
    prompt = columns["prompt_len"].astype(np.int64)
    output = columns["output_len"].astype(np.int64)
    if tpot_s is None:
        tpot = per_request_tpot(ttft, e2e, output)
    else:
        tpot = _column(tpot_s, names["tpot_s"], where, np.float64)
        if tpot.size != count:
            raise RealRunError(f"{where}: field {names['tpot_s']!r} has {tpot.size} values for "
                               f"{count} requests")
    _check_counts(count, where, stage_labels, itls_s, prompt_hash_ids)
    order = np.argsort(columns["arrival_s"], kind="stable")
    arrival = columns["arrival_s"][order]
    return RealRun(
        name=name, source=source, arrival_s=arrival - arrival[0], prompt_len=prompt[order],
        output_len=output[order], ttft_s=ttft[order], e2e_s=e2e[order], tpot_s=tpot[order],
        engine_settings=dict(engine_settings or {}),
        stage_labels=None if stage_labels is None else [str(stage_labels[i]) for i in order],
        itls_s=None if itls_s is None else [list(itls_s[i]) for i in order],
        notes=list(notes or []),
        prompt_hash_ids=None if prompt_hash_ids is None else [list(prompt_hash_ids[i])
                                                              for i in order],
        timeout_s=None if deadlines is None else deadlines[order])


def _check_values(columns: dict[str, np.ndarray], names: dict[str, str], abandoned: np.ndarray,
                  deadlines: np.ndarray | None, where: str) -> None:
    """Deadlines positive, values finite (latencies NaN only where abandoned), lengths whole
    numbers >= 1, and 0 <= TTFT <= E2E; a RealRunError naming the first request that is not."""
    if deadlines is not None:
        bad = np.flatnonzero(deadlines <= 0)
        if bad.size:
            raise RealRunError(f"{where}: field 'timeout_s' of request {bad[0]} must be a "
                               f"positive number or none, got {deadlines[bad[0]]:g}")
    for key, values in columns.items():
        may_lack = abandoned if key in ("ttft_s", "e2e_s") else np.zeros_like(abandoned)
        bad = np.flatnonzero(~np.isfinite(values) & ~may_lack)
        if bad.size:
            raise RealRunError(f"{where}: field {names[key]!r} of request {bad[0]} is not a "
                               f"finite number")
    for key in ("prompt_len", "output_len"):
        values = columns[key]
        bad = np.flatnonzero((values < 1) | (values != np.round(values)))
        if bad.size:
            raise RealRunError(f"{where}: field {names[key]!r} of request {bad[0]} must be a "
                               f"whole number >= 1, got {values[bad[0]]:g}")
    ttft, e2e = columns["ttft_s"], columns["e2e_s"]
    bad = np.flatnonzero((ttft < 0) | (e2e < ttft))
    if bad.size:
        i = bad[0]
        raise RealRunError(f"{where}: request {i} has {names['ttft_s']}={ttft[i]:g} and "
                           f"{names['e2e_s']}={e2e[i]:g}; need 0 <= TTFT <= E2E")


def _check_counts(count: int, where: str, stage_labels: list | None, itls_s: list | None,
                  prompt_hash_ids: list | None) -> None:
    if stage_labels is not None and len(stage_labels) != count:
        raise RealRunError(f"{where}: field 'stage' has {len(stage_labels)} values for {count} "
                           f"requests")
    if itls_s is not None and len(itls_s) != count:
        raise RealRunError(f"{where}: field 'itls' has {len(itls_s)} values for {count} requests")
    if prompt_hash_ids is not None and len(prompt_hash_ids) != count:
        raise RealRunError(f"{where}: {len(prompt_hash_ids)} prompts' hash_ids for {count} "
                           f"requests")
