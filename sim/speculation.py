"""The simulator's acceptance model: how many of a sequence's k draft tokens the target accepts.

Draft position i (1-based) is accepted with conditional probability p_i, given that every draft
before it was; the first rejection ends the run. The probabilities are one rate for every position
(i.i.d.) or measured on the engine: an acceptance statistics file

    {"num_speculative_tokens": K, "position_trials": [t_1..t_K], "position_accepts": [a_1..a_K],
     "drafter": "...", "target": "...", "source": "how it was measured"}

where t_i counts the times position i was examined and a_i how often it was accepted, so
p_i = a_i / t_i. A position past the measured ones takes the last measured probability.

Counts are drawn, not averaged: each step draws every speculating sequence's count at random
from a seeded generator, one numpy call per step.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from sim.json_files import read_json_object

STATISTICS_KEYS = ("num_speculative_tokens", "position_trials", "position_accepts")


def _check_probability(value, where: str) -> float:
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or not 0 <= value <= 1):
        raise ValueError(f"{where} must be a probability in [0, 1], got {value!r}")
    return float(value)


class AcceptanceModel:
    """Draws accepted-draft counts from per-position conditional acceptance probabilities."""

    def __init__(self, position_probabilities: list[float], seed=0, source: str = ""):
        if not position_probabilities:
            raise ValueError("an acceptance model needs at least one position probability")
        self.position_probabilities = [
            _check_probability(p, f"acceptance probability of draft position {i + 1}")
            for i, p in enumerate(position_probabilities)]
        self.source = source
        self._rng = np.random.default_rng(seed)
        self._probabilities = np.asarray(self.position_probabilities)

    @classmethod
    def iid(cls, acceptance_rate: float, seed=0) -> "AcceptanceModel":
        """Every draft accepted with the same probability, independently."""
        rate = _check_probability(acceptance_rate, "speculation.acceptance_rate")
        return cls([rate], seed, source=f"i.i.d. acceptance rate {rate:g}")

    @classmethod
    def from_file(cls, path: str | Path, seed=0) -> "AcceptanceModel":
        """Read an acceptance statistics file (the module docstring's format)."""
        where = f"speculation.acceptance_profile={path}"
        data = read_json_object(path, where)
        missing = [key for key in STATISTICS_KEYS if key not in data]
        if missing:
            raise ValueError(f"{where}: missing key(s) {missing}")
        num_positions = data["num_speculative_tokens"]
        trials, accepts = data["position_trials"], data["position_accepts"]
        if isinstance(num_positions, bool) or not isinstance(num_positions, int) or num_positions < 1:
            raise ValueError(f"{where}: num_speculative_tokens must be a positive integer, got "
                             f"{num_positions!r}")
        for name, counts in (("position_trials", trials), ("position_accepts", accepts)):
            if (not isinstance(counts, list) or len(counts) != num_positions
                    or any(isinstance(c, bool) or not isinstance(c, (int, float)) or c < 0
                           for c in counts)):
                raise ValueError(f"{where}: {name} must be a list of {num_positions} "
                                 f"non-negative counts, got {counts!r}")
        probabilities = []
        for position, (num_trials, num_accepts) in enumerate(zip(trials, accepts), start=1):
            if num_trials == 0:
                break  # never examined: this and later positions take the last measured one
            probabilities.append(_check_probability(
                num_accepts / num_trials,
                f"{where}: position_accepts[{position}] / position_trials[{position}]"))
        if not probabilities:
            raise ValueError(f"{where}: position 1 was never examined (position_trials[1] = 0)")
        source = " / ".join(str(data[key]) for key in ("drafter", "target", "source") if key in data)
        return cls(probabilities, seed, source=source or str(path))

    def probabilities(self, num_positions: int) -> np.ndarray:
        """p_1..p_num_positions, the last measured one repeated past the measured positions."""
        measured = self._probabilities
        if num_positions <= measured.size:
            return measured[:num_positions]
        return np.concatenate([measured, np.full(num_positions - measured.size, measured[-1])])

    def mean_accepted(self, k: int) -> float:
        """Expected accepted drafts of k: sum over j <= k of p_1 ... p_j."""
        return float(np.cumprod(self.probabilities(k)).sum())

    def draw(self, spec_lens: list[int]) -> list[int]:
        """Accepted drafts (0..k) for each sequence proposing k = spec_lens[i]."""
        if not spec_lens:
            return []
        lengths = np.asarray(spec_lens)
        max_len = int(lengths.max())
        accepted = self._rng.random((lengths.size, max_len)) < self.probabilities(max_len)
        # A draft counts only while it and every draft before it were accepted, and only up to
        # the sequence's own k.
        accepted &= np.arange(max_len) < lengths[:, None]
        return np.cumprod(accepted, axis=1).sum(axis=1).tolist()
