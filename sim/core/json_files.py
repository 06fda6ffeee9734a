"""Reading the JSON files a run is given, with one error line naming the setting; relative paths
fall back to the repo root so the shipped files are found from any working directory."""
from __future__ import annotations

import json
from pathlib import Path


REPO_ROOT = Path(__file__).resolve().parents[2]


def read_json_object(path: str | Path, where: str, error: type[ValueError] = ValueError) -> dict:
    """The JSON object in `path`; `error(f"{where}: ...")` when it cannot be had."""
    path = Path(path).expanduser()
    if not path.is_absolute() and not path.is_file() and (REPO_ROOT / path).is_file():
        path = REPO_ROOT / path
    if not path.is_file():
        raise error(f"{where}: no such file")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as problem:
        raise error(f"{where}: not a readable JSON file ({problem})") from None
    if not isinstance(data, dict):
        raise error(f"{where}: expected a JSON object")
    return data
