"""The GPU cost model's engine terms: the time a step costs beyond its kernels, per vLLM
version (data/gpu/engine_terms.json), and a twinserve-calibrate profile's fitted terms."""
from __future__ import annotations

import functools
import json
from pathlib import Path

from sim.core.json_files import read_json_object
from sim.gpu.vllm_tables import DEFAULT_ENGINE_VERSION, nearest_version

# The terms a twinserve-calibrate profile may set on the GPU cost model.
FITTABLE_TERMS = ("step_overhead_s", "per_sequence_overhead_s",
                  "eager_launch_overhead_s_per_layer", "workstation_bandwidth_efficiency")


ENGINE_TERMS_FILE = Path(__file__).resolve().parents[2] / "data" / "gpu" / "engine_terms.json"


@functools.lru_cache(maxsize=None)
def _engine_terms_by_version() -> dict:
    return json.loads(ENGINE_TERMS_FILE.read_text())["versions"]


def engine_terms(engine_version: str | None) -> tuple[dict[str, float], str]:
    """The engine terms fitted for the vLLM version nearest `engine_version` (None: the default
    version), and a line saying which (data/gpu/engine_terms.json says what each was fitted on)."""
    by_version = _engine_terms_by_version()
    asked = DEFAULT_ENGINE_VERSION if engine_version is None else str(engine_version)
    used = nearest_version(asked, list(by_version))
    return by_version[used], f"vLLM {used} engine terms (data/gpu/engine_terms.json)"


def read_terms_file(path: str, key: str) -> dict[str, float]:
    """The fitted terms of a twinserve-calibrate profile ({"terms": {name: value}}); a term this
    cost model does not take is an error, not silently dropped."""
    where = f"{key}={path}"
    terms = read_json_object(path, where).get("terms")
    if not isinstance(terms, dict) or not all(
            isinstance(value, (int, float)) for value in terms.values()):
        raise ValueError(f"{where}: not a twinserve-calibrate profile (a JSON object with "
                         f"numeric 'terms')")
    unknown = [name for name in terms if name not in FITTABLE_TERMS]
    if unknown:
        settings = " ".join(f"{name}={terms[name]!r}" for name in unknown)
        raise ValueError(f"{where}: {', '.join(unknown)} not a term of the GPU cost model "
                         f"({', '.join(FITTABLE_TERMS)}); give it on the command line instead: "
                         f"{settings}")
    return {name: float(value) for name, value in terms.items()}
