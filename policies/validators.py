"""Argument checks shared by both backends: each raises a ValueError naming the argument as the
user wrote it, and returns the value."""
from __future__ import annotations

import math


def _is_number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def non_negative_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def positive_number(name: str, value) -> float:
    if not _is_number(value) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return value


def non_negative_number(name: str, value) -> float:
    if not _is_number(value) or not value >= 0:
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    return value


def finite_number(name: str, value) -> float:
    """A number that is neither infinite nor NaN."""
    if not _is_number(value) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return value


def number_in(name: str, value, low: float, high: float, *, low_open: bool = False,
              high_open: bool = False) -> float:
    """A number in the interval from low to high, each end closed unless said open."""
    inside = _is_number(value) and not math.isnan(value) and (
        (value > low if low_open else value >= low)
        and (value < high if high_open else value <= high))
    if not inside:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ValueError(f"{name} must be a number in {interval}, got {value!r}")
    return value


def fraction(name: str, value) -> float:
    """A share of something that must leave some of it: [0, 1)."""
    return number_in(name, value, 0, 1, high_open=True)


def probability(name: str, value) -> float:
    """A probability: a number in [0, 1]."""
    if not _is_number(value) or not 0 <= value <= 1:
        raise ValueError(f"{name} must be a probability in [0, 1], got {value!r}")
    return value


def boolean(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value
