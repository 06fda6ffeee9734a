"""Sampling parameters, shaped like vLLM's: checked when built, as vLLM's are, so a bad value is
one line naming its argument at the call that made it."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from policies import validators


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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

    def __post_init__(self):
        error = self.error()
        if error is not None:
            raise ValueError(error)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def error(self) -> str | None:
        """Why these parameters are invalid, or None. Checked when they are built and again per
        request at generate time (a field changed since fails that request alone)."""
        try:
            validators.non_negative_number("temperature", self.temperature)
            # Rules of their own (-1 turns top-k off; any integer seeds), so no shared validator.
            if not _is_int(self.top_k) or self.top_k < -1:
                raise ValueError(f"top_k must be -1 (off) or a non-negative integer, got "
                                 f"{self.top_k!r}")
            validators.number_in("top_p", self.top_p, 0, 1, low_open=True)
            validators.positive_int("max_tokens", self.max_tokens)
            validators.positive_int("n", self.n)
            if self.seed is not None and not _is_int(self.seed):
                raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
            validators.boolean("ignore_eos", self.ignore_eos)
        except ValueError as error:
            return str(error)
        return None


def as_sampling_params(value, name: str = "sampling_params") -> SamplingParams:
    """A SamplingParams as is, or one built from a dict of its fields ({"max_tokens": 3}); a
    ValueError naming `name` for anything else or a field it does not have."""
    if isinstance(value, SamplingParams):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a SamplingParams or a dict of its fields, got "
                         f"{type(value).__name__}")
    known = [field.name for field in fields(SamplingParams)]
    unknown = sorted(str(key) for key in value if key not in known)
    if unknown:
        raise ValueError(f"{name}: SamplingParams has no field {', '.join(unknown)}; its fields: "
                         f"{', '.join(known)}")
    return SamplingParams(**value)
