"""Reading the JSON files a run is given (profiles, acceptance statistics): one clear error that
names the setting for a missing file, bad JSON or something other than an object."""
from __future__ import annotations

import json
from pathlib import Path


def read_json_object(path: str | Path, where: str, error: type[ValueError] = ValueError) -> dict:
    """The JSON object in `path`; `error(f"{where}: ...")` when it cannot be had."""
    path = Path(path)
    if not path.is_file():
        raise error(f"{where}: no such file")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as problem:
        raise error(f"{where}: not a readable JSON file ({problem})") from None
    if not isinstance(data, dict):
        raise error(f"{where}: expected a JSON object")
    return data
