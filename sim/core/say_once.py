"""One line on stderr once a process, since a sweep building many cost models would repeat each
fallback's notice."""
from __future__ import annotations

import sys
from collections.abc import Hashable

_SAID: set[Hashable] = set()


def say_once(line: str, key: Hashable | None = None) -> None:
    """Print `line` on stderr unless a line with the same `key` (default: the line) was said."""
    key = line if key is None else key
    if key not in _SAID:
        _SAID.add(key)
        print(line, file=sys.stderr)
