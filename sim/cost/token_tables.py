"""Per-token-count tables: a cost precomputed for every token count up to TABLE_TOKENS as a plain
list (a step looks it up in O(1)), extended linearly beyond."""
from __future__ import annotations

import numpy as np

TABLE_TOKENS = 8192


def per_token_table(values_from_one: np.ndarray) -> tuple[list[float], float]:
    """[0, v(1), ..., v(N)] as a list, and the slope that extends it past N (its upper half's)."""
    n = len(values_from_one)
    slope = float(values_from_one[-1] - values_from_one[n // 2 - 1]) / (n - n // 2)
    return [0.0] + values_from_one.tolist(), slope
