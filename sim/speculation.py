"""The simulator's acceptance model: how many of a sequence's k draft tokens the target accepts.

Draft position i (1-based) is accepted with conditional probability p_i, given that every draft
before it was; the first rejection ends the run. The probabilities are one rate for every position
(i.i.d.) or measured on the engine: an acceptance statistics file

    {"num_speculative_tokens": K, "position_trials": [t_1..t_K], "position_accepts": [a_1..a_K],
     "drafter": "...", "target": "...", "source": "how it was measured"}

where t_i counts the times position i was examined and a_i how often it was accepted, so
p_i = a_i / t_i. A position past the measured ones takes the last measured probability.

Rejections cluster: a stretch of text the draft gets wrong rejects several steps in a row, so
each step drawing independently under-predicts acceptance at some k and over-predicts at others.
When the file also has `fresh_position_trials` / `fresh_position_accepts` (the same counts over
the steps that start right after a rejection, where a run of acceptable drafts starts), the
model is a renewal process instead: each sequence walks through runs of acceptable draft
positions ended by one the target rejects, run lengths drawn from those fresh per-position
rates (the last one repeated past the measured positions). A step of k accepts min(k, what is
left of the run); if the whole run fits, the rejected position ends the step, else the bonus
token takes one more position of it. With greedy decoding this is exactly how the engine's
acceptances arise (a draft is acceptable at a position of the text or not, whatever k is).

Counts are drawn, not averaged: from a seeded generator, i.i.d. in one numpy call per step, or
one run length per run.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from sim.json_files import read_json_object

STATISTICS_KEYS = ("num_speculative_tokens", "position_trials", "position_accepts")
FRESH_KEYS = ("fresh_position_trials", "fresh_position_accepts")
# A run whose every position is acceptable (a fresh rate of 1) never ends; this stands for it.
ENDLESS_RUN = 1 << 40


def _check_probability(value, where: str) -> float:
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or not 0 <= value <= 1):
        raise ValueError(f"{where} must be a probability in [0, 1], got {value!r}")
    return float(value)


class AcceptanceModel:
    """Draws accepted-draft counts from per-position conditional acceptance probabilities, or,
    with `run_probabilities` (the fresh per-position rates), from runs of acceptable drafts."""

    def __init__(self, position_probabilities: list[float], seed=0, source: str = "",
                 run_probabilities: list[float] | None = None):
        if not position_probabilities:
            raise ValueError("an acceptance model needs at least one position probability")
        self.position_probabilities = [
            _check_probability(p, f"acceptance probability of draft position {i + 1}")
            for i, p in enumerate(position_probabilities)]
        self.run_probabilities = None if not run_probabilities else [
            _check_probability(p, f"fresh acceptance probability of draft position {i + 1}")
            for i, p in enumerate(run_probabilities)]
        self.source = source
        self._rng = np.random.default_rng(seed)
        self._probabilities = np.asarray(self.position_probabilities)
        self._run_probabilities = (None if self.run_probabilities is None
                                   else np.asarray(self.run_probabilities))
        # Runs: seq_id -> acceptable positions left before the next rejected one (absent: the
        # sequence starts a new run at its next step).
        self._left_in_run: dict[int, int] = {}

    def reseeded(self, seed) -> "AcceptanceModel":
        """The same model with a generator (and run state) of its own."""
        return AcceptanceModel(self.position_probabilities, seed, self.source,
                               self.run_probabilities)

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
        if isinstance(num_positions, bool) or not isinstance(num_positions, int) or num_positions < 1:
            raise ValueError(f"{where}: num_speculative_tokens must be a positive integer, got "
                             f"{num_positions!r}")
        probabilities = _conditional_rates(data, STATISTICS_KEYS[1:], num_positions, where)
        if not probabilities:
            raise ValueError(f"{where}: position 1 was never examined (position_trials[1] = 0)")
        run_probabilities = (_conditional_rates(data, FRESH_KEYS, num_positions, where)
                             if all(key in data for key in FRESH_KEYS) else None)
        source = " / ".join(str(data[key]) for key in ("drafter", "target", "source") if key in data)
        return cls(probabilities, seed, source=source or str(path),
                   run_probabilities=run_probabilities)

    def probabilities(self, num_positions: int) -> np.ndarray:
        """p_1..p_num_positions, the last measured one repeated past the measured positions."""
        measured = self._probabilities
        if num_positions <= measured.size:
            return measured[:num_positions]
        return np.concatenate([measured, np.full(num_positions - measured.size, measured[-1])])

    def mean_accepted(self, k: int) -> float:
        """Expected accepted drafts of k drawn independently per step: sum over j <= k of
        p_1 ... p_j (runs, when the model has them, differ from this)."""
        return float(np.cumprod(self.probabilities(k)).sum())

    def draw(self, spec_lens: dict[int, int]) -> list[int]:
        """Accepted drafts (0..k) for each sequence proposing k = spec_lens[seq_id], in the
        mapping's order."""
        if not spec_lens:
            return []
        if self._run_probabilities is not None:
            return [self._draw_in_run(seq_id, k) for seq_id, k in spec_lens.items()]
        lengths = np.fromiter(spec_lens.values(), dtype=np.int64, count=len(spec_lens))
        max_len = int(lengths.max())
        accepted = self._rng.random((lengths.size, max_len)) < self.probabilities(max_len)
        # A draft counts only while it and every draft before it were accepted, and only up to
        # the sequence's own k.
        accepted &= np.arange(max_len) < lengths[:, None]
        return np.cumprod(accepted, axis=1).sum(axis=1).tolist()

    def _draw_in_run(self, seq_id: int, k: int) -> int:
        left = self._left_in_run.pop(seq_id, None)
        if left is None:
            left = self._run_length()
        if left > k:    # all k accepted; the bonus token takes the run's next position
            self._left_in_run[seq_id] = left - k - 1
            return k
        return left     # the rejected position ends the run (and the step, or is the bonus's)

    def _run_length(self) -> int:
        """Acceptable positions before the next rejected one, from the fresh rates."""
        rates = self._run_probabilities
        rejected = np.flatnonzero(self._rng.random(rates.size) >= rates)
        if rejected.size:
            return int(rejected[0])
        tail = float(rates[-1])
        if tail >= 1.0:
            return ENDLESS_RUN
        return rates.size + int(self._rng.geometric(1.0 - tail)) - 1


def _conditional_rates(data: dict, keys: tuple[str, str], num_positions: int,
                       where: str) -> list[float]:
    """accepts / trials per position, up to the first position never examined."""
    trials, accepts = (data[key] for key in keys)
    for name, counts in zip(keys, (trials, accepts)):
        if (not isinstance(counts, list) or len(counts) != num_positions
                or any(isinstance(c, bool) or not isinstance(c, (int, float)) or c < 0
                       for c in counts)):
            raise ValueError(f"{where}: {name} must be a list of {num_positions} non-negative "
                             f"counts, got {counts!r}")
    rates = []
    for position, (num_trials, num_accepts) in enumerate(zip(trials, accepts), start=1):
        if num_trials == 0:
            break
        rates.append(_check_probability(num_accepts / num_trials,
                                        f"{where}: {keys[1]}[{position}] / {keys[0]}[{position}]"))
    return rates
