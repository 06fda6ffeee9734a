"""From an engine's acceptance statistics file (AcceptanceCounts.to_statistics writes it) to
`AcceptanceModel`'s arguments: per-position and fresh rates, per-text log-odds shifts fitted by
maximum likelihood, and a fixed token tree's per-node rates.

    {"num_speculative_tokens": K, "position_trials": [...], "position_accepts": [...],
     "drafter": ..., "target": ..., "source": ..., optional "fresh_position_*", "sequences",
     "tree_paths", "node_trials", "node_accepts"}
"""
from __future__ import annotations

import functools
import math

import numpy as np

from policies import validators
from policies.speculation.trees import path_parents
from sim.core.json_files import read_json_object

STATISTICS_KEYS = ("num_speculative_tokens", "position_trials", "position_accepts")
FRESH_KEYS = ("fresh_position_trials", "fresh_position_accepts")
NODE_KEYS = ("node_trials", "node_accepts")
SPREAD_GRID = np.linspace(0.0, 3.0, 61)
EM_ITERATIONS = 15
# Warm-started Newton settles in a few steps, which matters since every run loads the file anew.
NEWTON_STEPS = 20
NEWTON_TOLERANCE = 1e-9
LOG_ODDS_LIMIT = 12.0   # a rate of 1 - 6e-6: a position every sequence accepted
_HERMITE_NODES, _HERMITE_WEIGHTS = np.polynomial.hermite.hermgauss(24)
# Kept off 0 and 1, since a position every sequence accepted still varies between sequences.
_RATE_CLIP = 1e-3


@functools.lru_cache(maxsize=32)
def statistics_fields(path: str, identity: tuple) -> dict:
    """AcceptanceModel's arguments from the statistics file at `path`, cached by `identity`."""
    where = f"speculation.acceptance_profile={path}"
    data = read_json_object(path, where)
    missing = [key for key in STATISTICS_KEYS if key not in data]
    if missing:
        raise ValueError(f"{where}: missing key(s) {missing}")
    num_positions = data["num_speculative_tokens"]
    validators.positive_int(f"{where}: num_speculative_tokens", num_positions)
    probabilities = _conditional_rates(data, STATISTICS_KEYS[1:], num_positions, where)
    if not probabilities:
        raise ValueError(f"{where}: position 1 was never examined (position_trials[1] = 0)")
    run_probabilities = (_conditional_rates(data, FRESH_KEYS, num_positions, where)
                         if all(key in data for key in FRESH_KEYS) else None)
    shifts = None
    if data.get("sequences") is not None and run_probabilities is not None:
        sequences = _sequence_counts(data["sequences"], num_positions, where)
        shifts, run_probabilities, _ = fit_sequence_shifts(sequences)
    node_rates = node_shifts = None
    if "tree_paths" in data:
        node_rates, node_shifts = _node_rates(data, bool(shifts), where)
    source = " / ".join(str(data[key]) for key in ("drafter", "target", "source") if key in data)
    return dict(position_probabilities=probabilities, source=source or str(path),
                run_probabilities=run_probabilities, sequence_shifts=shifts,
                node_rates=node_rates, node_shifts=node_shifts)


def shifted(rates: np.ndarray, shift) -> np.ndarray:
    """Rates with their log-odds moved by `shift` (a rate of 0 or 1 stays where it is)."""
    moved = _sigmoid(_log_odds(rates) + shift)
    return np.where((rates <= 0.0) | (rates >= 1.0), rates, moved)


def _sigmoid(log_odds: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-log_odds))


def _log_odds(rates: np.ndarray) -> np.ndarray:
    """The rates' log-odds, kept finite (_RATE_CLIP)."""
    clipped = np.clip(rates, _RATE_CLIP, 1.0 - _RATE_CLIP)
    return np.log(clipped / (1.0 - clipped))


def fit_sequence_shifts(sequences: list[tuple[np.ndarray, np.ndarray, float, float]]
                        ) -> tuple[list[float], list[float], float]:
    """(posterior mean shift per sequence, fresh rates, spread) maximising the likelihood of
    `sequences` under a per-sequence log-odds shift z ~ N(0, spread²): the spread by grid, the
    rates by EM, each likelihood integrated over z by Gauss-Hermite. Fewer than two sequences:
    no shifts and the pooled rates."""
    trials = np.array([fresh_trials for fresh_trials, _, _, _ in sequences], dtype=np.float64)
    accepts = np.array([fresh_accepts for _, fresh_accepts, _, _ in sequences], dtype=np.float64)
    examined = np.flatnonzero(trials.sum(axis=0))
    if not examined.size:
        raise ValueError("no sequence examined a draft position")
    trials, accepts = trials[:, :examined[-1] + 1], accepts[:, :examined[-1] + 1]
    pooled = accepts.sum(axis=0) / trials.sum(axis=0)
    if len(sequences) < 2:
        return [], pooled.tolist(), 0.0
    # A step that continues a run goes past the measured positions, where the last rate holds.
    trials[:, -1] += [tail_trials for _, _, tail_trials, _ in sequences]
    accepts[:, -1] += [tail_accepts for _, _, _, tail_accepts in sequences]
    log_odds = _log_odds(pooled)
    best = (-math.inf, 0.0, log_odds)
    for spread in SPREAD_GRID:
        shifts = math.sqrt(2.0) * spread * _HERMITE_NODES
        for _ in range(EM_ITERATIONS):
            _, weights = _shifted_likelihood(log_odds, shifts, trials, accepts)
            log_odds = _solve_log_odds(log_odds, shifts, weights, trials, accepts)
        likelihood, _ = _shifted_likelihood(log_odds, shifts, trials, accepts)
        if likelihood > best[0] + 1e-9:
            best = (likelihood, float(spread), log_odds.copy())
    _, spread, log_odds = best
    nodes = math.sqrt(2.0) * spread * _HERMITE_NODES
    _, weights = _shifted_likelihood(log_odds, nodes, trials, accepts)
    return (weights @ nodes).tolist(), _sigmoid(log_odds).tolist(), spread


def _shifted_likelihood(log_odds, shifts, trials, accepts) -> tuple[float, np.ndarray]:
    """(log likelihood of every sequence, integrated over its shift; each sequence's posterior
    weights over the quadrature nodes [sequences, nodes])."""
    rates = _sigmoid(log_odds[None, :] + shifts[:, None])      # [nodes, K]
    rates = np.clip(rates, 1e-12, 1.0 - 1e-12)
    log_given = accepts @ np.log(rates).T + (trials - accepts) @ np.log1p(-rates).T
    log_given += np.log(_HERMITE_WEIGHTS / math.sqrt(math.pi))[None, :]
    peak = log_given.max(axis=1, keepdims=True)
    joint = np.exp(log_given - peak)
    total = joint.sum(axis=1, keepdims=True)
    return float((peak + np.log(total)).sum()), joint / total


def _solve_log_odds(log_odds, shifts, weights, trials, accepts) -> np.ndarray:
    """EM's M step: per position, the log-odds where the expected accepts equal the accepts."""
    node_trials = weights.T @ trials                                          # [nodes, K]
    target = accepts.sum(axis=0)
    solved = log_odds.copy()
    for _ in range(NEWTON_STEPS):
        rates = _sigmoid(solved[None, :] + shifts[:, None])
        expected = (node_trials * rates).sum(axis=0)
        slope = (node_trials * rates * (1.0 - rates)).sum(axis=0)
        step = np.clip((target - expected) / np.maximum(slope, 1e-12), -2.0, 2.0)
        solved = np.clip(solved + step, -LOG_ODDS_LIMIT, LOG_ODDS_LIMIT)
        if np.abs(step).max() < NEWTON_TOLERANCE:
            break
    return solved


def _sequence_counts(sequences, num_positions: int, where: str):
    """The file's `sequences`: per sequence, fresh counts per position and its other steps'."""
    if not isinstance(sequences, list):
        raise ValueError(f"{where}: sequences must be a list of per-sequence counts")
    keys = (*FRESH_KEYS, *STATISTICS_KEYS[1:])
    counts = []
    for index, entry in enumerate(sequences):
        name = f"{where}: sequences[{index}]"
        if not isinstance(entry, dict) or not all(key in entry for key in keys):
            raise ValueError(f"{name} must have {list(keys)}")
        _conditional_rates(entry, FRESH_KEYS, num_positions, name)
        _conditional_rates(entry, STATISTICS_KEYS[1:], num_positions, name)
        fresh_trials, fresh_accepts, all_trials, all_accepts = (
            np.asarray(entry[key], dtype=np.float64) for key in keys)
        if (fresh_accepts > fresh_trials).any() or (all_accepts > all_trials).any():
            raise ValueError(f"{name} accepts more drafts than it examined")
        if (fresh_trials > all_trials).any() or (fresh_accepts > all_accepts).any():
            raise ValueError(f"{name}: its fresh counts exceed its counts over every step")
        counts.append((fresh_trials, fresh_accepts, float((all_trials - fresh_trials).sum()),
                       float((all_accepts - fresh_accepts).sum())))
    return counts


def _node_rates(data: dict, per_text: bool, where: str
                ) -> tuple[dict[tuple[int, ...], float], list[float] | None]:
    """Each examined tree node's rate by path, and with `per_text` each text's shift of the
    nodes' log-odds, fitted as the fresh rates are."""
    paths = data["tree_paths"]
    if (not isinstance(paths, list) or not paths or any(
            not isinstance(path, list) or not path or any(
                isinstance(rank, bool) or not isinstance(rank, int) or rank < 0 for rank in path)
            for path in paths)):
        raise ValueError(f"{where}: tree_paths must be a list of paths of non-negative ranks "
                         f"([[0], [0, 0], [1]]), got {paths!r}")
    paths = [tuple(path) for path in paths]
    try:
        path_parents(paths)
    except ValueError as error:
        raise ValueError(f"{where}: tree_paths: {error}") from None
    missing = [key for key in NODE_KEYS if key not in data]
    if missing:
        raise ValueError(f"{where}: tree_paths needs {list(NODE_KEYS)}; missing {missing}")
    trials, accepts = (np.asarray(_counts(data, key, len(paths), where), dtype=np.float64)
                       for key in NODE_KEYS)
    if (accepts > trials).any():
        raise ValueError(f"{where}: node_accepts exceed node_trials at a node")
    rates = {path: float(a / t) for path, t, a in zip(paths, trials, accepts) if t > 0}
    sequences = data.get("sequences") or []
    if not (per_text and all(isinstance(entry, dict) and all(key in entry for key in NODE_KEYS)
                             for entry in sequences)):
        return rates, None
    sequence_trials, sequence_accepts = (np.array(
        [_counts(entry, key, len(paths), f"{where}: sequences[{index}]")
         for index, entry in enumerate(sequences)], dtype=np.float64) for key in NODE_KEYS)
    if (sequence_accepts > sequence_trials).any():
        raise ValueError(f"{where}: a sequence's node_accepts exceed its node_trials")
    examined = np.flatnonzero(sequence_trials.sum(axis=0))
    if not examined.size:
        return rates, None
    shifts, fitted, _ = fit_sequence_shifts(
        [(node_trials[examined], node_accepts[examined], 0.0, 0.0)
         for node_trials, node_accepts in zip(sequence_trials, sequence_accepts)])
    rates.update({paths[node]: rate for node, rate in zip(examined, fitted)})
    return rates, shifts


def _counts(data: dict, key: str, length: int, where: str) -> list:
    """data[key], checked to be `length` non-negative counts."""
    counts = data[key]
    if (not isinstance(counts, list) or len(counts) != length
            or any(isinstance(c, bool) or not isinstance(c, (int, float)) or c < 0
                   for c in counts)):
        raise ValueError(f"{where}: {key} must be a list of {length} non-negative "
                         f"counts, got {counts!r}")
    return counts


def _conditional_rates(data: dict, keys: tuple[str, str], num_positions: int,
                       where: str) -> list[float]:
    """accepts / trials per position, up to the first position never examined."""
    trials, accepts = (_counts(data, key, num_positions, where) for key in keys)
    rates = []
    for position, (num_trials, num_accepts) in enumerate(zip(trials, accepts), start=1):
        if num_trials == 0:
            break
        rates.append(float(validators.probability(
            f"{where}: {keys[1]}[{position}] / {keys[0]}[{position}]", num_accepts / num_trials)))
    return rates
