"""Runs NVIDIA aiconfigurator's single-point estimate for many rows in one process (JSON in, JSON
out), under the Python of the venv aiconfigurator is installed in; bench/vs_aiconfigurator.py
starts it. It imports nothing from twinserve, so that venv needs nothing else.

    /venv/bin/python bench/aiconfigurator_driver.py REQUESTS.json PREDICTIONS.json

REQUESTS.json: a list of {"id", "request": keyword arguments of
aiconfigurator.cli.api.cli_estimate (what `aiconfigurator cli estimate` calls),
"backend_version": the row's backend version or null}. PREDICTIONS.json: {"version": the installed
aiconfigurator's, "rows": {id: {"ttft_ms", "tpot_ms", "backend_version_used",
"kv_cache_warning", "quant": the quant modes it resolved, "error"}}}.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import sys


def queryable_versions(system: str, backend: str) -> set[str]:
    """The backend versions the tool accepts for `system` (it rejects any other by name)."""
    from aiconfigurator.sdk.perf_database import get_version_slots

    return set((get_version_slots(system, backend) or {}).values())


def estimate(item: dict) -> dict:
    from aiconfigurator.cli.api import cli_estimate

    request = item["request"]
    wanted = item.get("backend_version") or None
    # A version outside the tool's slots raises, so such rows run on its default (current) data.
    version = wanted if wanted in queryable_versions(request["system_name"],
                                                     request["backend_name"]) else None
    # The tool prints its report tables to stdout; keep them out of the way.
    with contextlib.redirect_stdout(sys.stderr):
        result = cli_estimate(backend_version=version, **request)
    return {"ttft_ms": float(result.ttft), "tpot_ms": float(result.tpot),
            "backend_version_used": result.backend_version,
            "kv_cache_warning": result.kv_cache_warning,
            "quant": {key: result.raw.get(key) for key in ("gemm", "kvcache", "fmha", "moe")},
            "error": None}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: aiconfigurator_driver.py REQUESTS.json PREDICTIONS.json", file=sys.stderr)
        return 2
    # Its warnings (fallback tables it loads but these dense rows never query) would bury progress.
    for package in ("aiconfigurator", "aiconfigurator_core"):
        logging.getLogger(package).setLevel(logging.ERROR)
    items = json.loads(open(argv[0]).read())
    rows = {}
    for n, item in enumerate(items, 1):
        try:
            rows[item["id"]] = estimate(item)
        except Exception as exc:  # one row's failure (OOM, missing table) must not lose the rest
            rows[item["id"]] = {"ttft_ms": None, "tpot_ms": None,
                                "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
        print(f"aiconfigurator: {n}/{len(items)} {item['id']}", file=sys.stderr, flush=True)
    with open(argv[1], "w") as out:
        json.dump({"version": importlib.metadata.version("aiconfigurator"), "rows": rows}, out,
                  indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
