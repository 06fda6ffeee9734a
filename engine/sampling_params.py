"""Sampling parameters, shaped like vLLM's."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SamplingParams:
    temperature: float = 1.0   # 0: greedy
    top_k: int = -1            # -1 or 0: all tokens
    top_p: float = 1.0         # in (0, 1]
    max_tokens: int = 16
    ignore_eos: bool = False
    n: int = 1
    # Sample j of a request uses seed + j, so n samples equal n requests with seeds seed..seed+n-1.
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def error(self) -> str | None:
        """Why these parameters are invalid, or None. Checked per request at generate time, so
        one bad request fails alone."""
        def is_int(value):
            return isinstance(value, int) and not isinstance(value, bool)

        def is_number(value):
            return isinstance(value, (int, float)) and not isinstance(value, bool)

        if not is_number(self.temperature) or self.temperature < 0:
            return f"temperature must be a number >= 0, got {self.temperature!r}"
        if not is_int(self.top_k) or self.top_k < -1:
            return f"top_k must be -1 (off) or a non-negative integer, got {self.top_k!r}"
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            return f"top_p must be in (0, 1], got {self.top_p!r}"
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            return f"max_tokens must be a positive integer, got {self.max_tokens!r}"
        if not is_int(self.n) or self.n < 1:
            return f"n must be a positive integer, got {self.n!r}"
        if self.seed is not None and not is_int(self.seed):
            return f"seed must be an integer or None, got {self.seed!r}"
        if not isinstance(self.ignore_eos, bool):
            return f"ignore_eos must be true or false, got {self.ignore_eos!r}"
        return None
