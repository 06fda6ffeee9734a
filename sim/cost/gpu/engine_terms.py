"""The GPU cost model's engine terms: the time a step costs beyond its kernels, per vLLM
version (data/gpu/engine_terms.json)."""
from __future__ import annotations

import functools
import json
from pathlib import Path

from sim.cost.gpu.vllm_tables import DEFAULT_ENGINE_VERSION, nearest_version

ENGINE_TERMS_FILE = Path(__file__).resolve().parents[3] / "data" / "gpu" / "engine_terms.json"


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
