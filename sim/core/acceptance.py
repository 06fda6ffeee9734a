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
the steps that start a run of acceptable drafts: a sequence's first, and each one right after
a rejection), the
model is a renewal process instead: each sequence walks through runs of acceptable draft
positions ended by one the target rejects, run lengths drawn from those fresh per-position
rates (the last one repeated past the measured positions). A step of k accepts min(k, what is
left of the run); if the whole run fits, the rejected position ends the step, else the bonus
token takes one more position of it. With greedy decoding this is exactly how the engine's
acceptances arise (a draft is acceptable at a position of the text or not, whatever k is).

Texts differ: some requests' drafts are accepted far more often than others' (one hard window
of source kept a sequence running alone for the last 13-18 steps of the engine's batch-4 runs,
where the simulator's sequences, all drawn alike, finished together). When the file also has
`sequences`, the same counts (fresh and over every step) for each of several sequences
measured alone (`[{"fresh_position_trials": [...], "fresh_position_accepts": [...],
"position_trials": [...], "position_accepts": [...]}, ...]`), each simulated
sequence takes the log-odds shift of one of those texts, drawn at random when it first
speculates: each text's posterior mean shift under a model fitted to them by maximum likelihood
(`fit_sequence_shifts`: shifts z ~ N(0, spread²) around the fresh rates of a text with z = 0).
Drawing the texts' own shifts, not a normal one, keeps their skew: a few very easy texts (the
drafts never rejected) and no hard tail the texts did not show (a normal spread fitted to them,
0.8, gave the simulator stragglers the engine never had: batch-16 throughput −27 %).

A fixed token tree (Medusa's paths of head ranks; a step verifies the first that many) is also
measured per node when the file has `tree_paths` (the tree, a list of paths), `node_trials` and
`node_accepts` (per node: the times it was examined, i.e. it was in the step's tree, its parent
on the accepted path and no earlier sibling on it, and the times it was accepted); each entry of
`sequences` may have the two node counts too. `for_tree(paths)` then walks the run's tree
(`draw_tree`): from the root, each examined child is accepted with its node's rate, the first
accepted one taking the walk a level down; the accepted length is the depth reached. A node the
statistics never examined (or a tree the statistics do not have) hands the rest of the walk to
the per-depth rates, and `source` says so. With sequence shifts and per-sequence node counts,
each text also has a shift of the nodes' log-odds, fitted to the texts' node counts as the
fresh rates' shifts are (`fit_sequence_shifts`, the node rates those of a text with shift 0),
and a simulated sequence takes both shifts of the text it draws; without per-sequence node
counts the nodes' rates are the pooled ones and take the fresh rates' shifts. Lookahead's tree
changes every step: it stays per depth.

Counts are drawn, not averaged: from a seeded generator, i.i.d. in one numpy call per step, or
one run length per run.
"""
from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np

from policies import validators
from policies.speculation.trees import node_children, path_parents
from sim.core.json_files import read_json_object

STATISTICS_KEYS = ("num_speculative_tokens", "position_trials", "position_accepts")
FRESH_KEYS = ("fresh_position_trials", "fresh_position_accepts")
NODE_KEYS = ("node_trials", "node_accepts")
# The spreads fit_sequence_shifts chooses from (SD of a sequence's log-odds shift), and the
# Gauss-Hermite nodes that integrate each sequence's likelihood over its unknown shift.
SPREAD_GRID = np.linspace(0.0, 3.0, 61)
EM_ITERATIONS = 15
# The M step's Newton iterations, at most, and the log-odds step that ends them early (warm
# started from the last iteration's, they settle in a few: a simulator run loads the file anew).
NEWTON_STEPS = 20
NEWTON_TOLERANCE = 1e-9
LOG_ODDS_LIMIT = 12.0   # a rate of 1 - 6e-6: a position every sequence accepted
_HERMITE_NODES, _HERMITE_WEIGHTS = np.polynomial.hermite.hermgauss(24)
# Rates are kept off 0 and 1 before their log-odds are taken (a position every sequence
# accepted still varies between sequences).
_RATE_CLIP = 1e-3
# A run whose every position is acceptable (a fresh rate of 1) never ends; this stands for it.
ENDLESS_RUN = 1 << 40


class AcceptanceModel:
    """Draws accepted-draft counts from per-position conditional acceptance probabilities, or,
    with `run_probabilities` (the fresh per-position rates), from runs of acceptable drafts; with
    `node_rates` (a fixed tree's measured nodes, by path) and `tree` (the run's tree, set by
    `for_tree`), by walking the tree node by node."""

    def __init__(self, position_probabilities: list[float], seed=0, source: str = "",
                 run_probabilities: list[float] | None = None,
                 sequence_shifts: list[float] | None = None,
                 node_rates: dict[tuple[int, ...], float] | None = None,
                 tree: list[tuple[int, ...]] | None = None,
                 node_shifts: list[float] | None = None):
        if not position_probabilities:
            raise ValueError("an acceptance model needs at least one position probability")
        self.position_probabilities = [
            float(validators.probability(f"acceptance probability of draft position {i + 1}", p))
            for i, p in enumerate(position_probabilities)]
        self.run_probabilities = None if not run_probabilities else [
            float(validators.probability(
                f"fresh acceptance probability of draft position {i + 1}", p))
            for i, p in enumerate(run_probabilities)]
        self.source = source
        self._seed = seed
        self._rng = np.random.default_rng(seed)
        self._probabilities = np.asarray(self.position_probabilities)
        self._run_probabilities = (None if self.run_probabilities is None
                                   else np.asarray(self.run_probabilities))
        self.sequence_shifts = [
            float(validators.finite_number(
                f"the acceptance model's sequence_shifts[{index}]", shift))
            for index, shift in enumerate(sequence_shifts or ())]
        # Runs: seq_id -> acceptable positions left before the next rejected one (absent: the
        # sequence starts a new run at its next step).
        self._left_in_run: dict[int, int] = {}
        # Per measured text (sequence_shifts' texts), its shift of the tree nodes' log-odds.
        self.node_shifts = [float(validators.finite_number(
            f"the acceptance model's node_shifts[{index}]", shift))
            for index, shift in enumerate(node_shifts or ())]
        if self.node_shifts and len(self.node_shifts) != len(self.sequence_shifts):
            raise ValueError(f"{len(self.node_shifts)} node shifts for "
                             f"{len(self.sequence_shifts)} texts (sequence_shifts)")
        # seq_id -> the measured text (an index into sequence_shifts) the sequence reads like,
        # drawn when it first speculates.
        self._texts: dict[int, int] = {}
        self.node_rates = {tuple(path): float(validators.probability(
            f"acceptance probability of tree node {list(path)}", rate))
            for path, rate in (node_rates or {}).items()}
        self.tree = None if tree is None else [tuple(path) for path in tree]
        if self.tree is not None:
            self._children = node_children(path_parents(self.tree))
            # Per node, its measured rate (NaN: never examined, the per-depth rates take over).
            self._tree_rates = np.array([self.node_rates.get(path, np.nan) for path in self.tree])
            self._shifted_tree_rates: dict[float, np.ndarray] = {}

    def reseeded(self, seed) -> "AcceptanceModel":
        """The same model with a generator (and run state) of its own."""
        return AcceptanceModel(self.position_probabilities, seed, self.source,
                               self.run_probabilities, self.sequence_shifts, self.node_rates,
                               self.tree, self.node_shifts)

    def for_tree(self, paths: list[tuple[int, ...]]) -> "AcceptanceModel":
        """This model drawing a fixed tree's steps node by node (`draw_tree`; a step verifies the
        first that many of `paths`), or, without per-node statistics, unchanged (per depth);
        `source` says which, and how many nodes fall back to the per-depth rates."""
        paths = [tuple(path) for path in paths]
        if not self.node_rates:
            return AcceptanceModel(self.position_probabilities, self._seed, _noted(
                self.source, "per depth (the statistics have no per-node counts)"),
                self.run_probabilities, self.sequence_shifts)
        unmeasured = sum(path not in self.node_rates for path in paths)
        note = (f"per node, {unmeasured} of {len(paths)} tree nodes never examined in the "
                f"statistics (per depth from there)" if unmeasured else
                f"per node ({len(paths)} tree nodes)")
        return AcceptanceModel(self.position_probabilities, self._seed,
                               _noted(self.source, note), self.run_probabilities,
                               self.sequence_shifts, self.node_rates, paths, self.node_shifts)

    @classmethod
    def iid(cls, acceptance_rate: float, seed=0) -> "AcceptanceModel":
        """Every draft accepted with the same probability, independently."""
        rate = float(validators.probability("speculation.acceptance_rate", acceptance_rate))
        return cls([rate], seed, source=f"i.i.d. acceptance rate {rate:g}")

    @classmethod
    def from_file(cls, path: str | Path, seed=0) -> "AcceptanceModel":
        """Read an acceptance statistics file (the module docstring's format). The fits are
        kept per file (its path, size and time of change): a simulator run loads it anew."""
        try:
            stat = Path(path).stat()
            identity = (str(Path(path).resolve()), stat.st_mtime_ns, stat.st_size)
        except OSError:
            identity = (str(path), None, None)   # read_json_object names what is wrong
        return cls(seed=seed, **_statistics_fields(str(path), identity))

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

    def draw(self, spec_lens: dict[int, int], fresh_each_step: bool = False) -> list[int]:
        """Accepted drafts (0..k) for each sequence proposing k = spec_lens[seq_id], in the
        mapping's order. With `fresh_each_step` (token trees: every step proposes a new tree
        from the heads or the n-gram pool, so no run of acceptable positions carries into the
        next step; the engine counts every tree step as fresh) each step starts a new run."""
        if not spec_lens:
            return []
        if self._run_probabilities is not None:
            return [self._draw_in_run(seq_id, k, fresh_each_step)
                    for seq_id, k in spec_lens.items()]
        lengths = np.fromiter(spec_lens.values(), dtype=np.int64, count=len(spec_lens))
        max_len = int(lengths.max())
        probabilities = self.probabilities(max_len)
        if self.sequence_shifts:
            shifts = np.array([self._shift(seq_id) for seq_id in spec_lens])
            probabilities = _shifted(probabilities[None, :], shifts[:, None])
        accepted = self._rng.random((lengths.size, max_len)) < probabilities
        # A draft counts only while it and every draft before it were accepted, and only up to
        # the sequence's own k.
        accepted &= np.arange(max_len) < lengths[:, None]
        return np.cumprod(accepted, axis=1).sum(axis=1).tolist()

    def draw_tree(self, sizes: dict[int, int]) -> list[int]:
        """Accepted tokens for each sequence verifying the first sizes[seq_id] nodes of the tree
        (`for_tree`), in the mapping's order: the depth a walk from the root reaches, each
        examined child accepted with its node's rate (the sequence's shift applied)."""
        if self.tree is None:
            raise ValueError("draw_tree needs a tree with per-node rates (for_tree)")
        return [self._walk_tree(seq_id, size) for seq_id, size in sizes.items()]

    def _walk_tree(self, seq_id: int, size: int) -> int:
        if not 1 <= size <= len(self.tree):
            raise ValueError(f"a step verifies 1..{len(self.tree)} nodes of this tree, got {size}")
        text = self._text(seq_id) if self.sequence_shifts else None
        shift = 0.0 if text is None else self.sequence_shifts[text]
        node_shift = self.node_shifts[text] if text is not None and self.node_shifts else shift
        rates = self._shifted_tree_rates.get(node_shift)
        if rates is None:
            rates = self._shifted_tree_rates[node_shift] = (
                _shifted(self._tree_rates, node_shift) if node_shift else self._tree_rates)
        node, depth = -1, 0
        while True:
            for child in self._children[node + 1]:
                if child >= size:
                    continue
                if np.isnan(rates[child]):   # never examined: per depth below `node`
                    return depth + self._depth_run(depth, self._reach(node, size), shift)
                if self._rng.random() < rates[child]:
                    node, depth = child, depth + 1
                    break
            else:
                return depth

    def _reach(self, node: int, size: int) -> int:
        """The depth of the deepest of the first `size` nodes at or below `node` (-1: root)."""
        if node < 0:
            return max(len(path) for path in self.tree[:size])
        prefix = self.tree[node]
        return max(len(path) for path in self.tree[:size] if path[:len(prefix)] == prefix)

    def _depth_run(self, depth: int, reach: int, shift: float) -> int:
        """Accepted positions after `depth`, up to `reach`, from the per-depth rates (the fresh
        ones when the model has runs: every tree step starts one)."""
        measured = (self._run_probabilities if self._run_probabilities is not None
                    else self._probabilities)
        rates = measured[np.minimum(np.arange(depth, reach), measured.size - 1)]
        if shift:
            rates = _shifted(rates, shift)
        rejected = np.flatnonzero(self._rng.random(rates.size) >= rates)
        return int(rejected[0]) if rejected.size else rates.size

    def _draw_in_run(self, seq_id: int, k: int, fresh: bool = False) -> int:
        left = self._left_in_run.pop(seq_id, None)
        if left is None or fresh:
            left = self._run_length(self._shift(seq_id) if self.sequence_shifts else 0.0)
        if left > k:    # all k accepted; the bonus token takes the run's next position
            if not fresh:
                self._left_in_run[seq_id] = left - k - 1
            return k
        return left     # the rejected position ends the run (and the step, or is the bonus's)

    def _shift(self, seq_id: int) -> float:
        return self.sequence_shifts[self._text(seq_id)]

    def _text(self, seq_id: int) -> int:
        text = self._texts.get(seq_id)
        if text is None:
            text = self._texts[seq_id] = int(self._rng.integers(len(self.sequence_shifts)))
        return text

    def _run_length(self, shift: float = 0.0) -> int:
        """Acceptable positions before the next rejected one, from the fresh rates (their
        log-odds shifted by `shift`)."""
        rates = self._run_probabilities
        if shift:
            rates = _shifted(rates, shift)
        rejected = np.flatnonzero(self._rng.random(rates.size) >= rates)
        if rejected.size:
            return int(rejected[0])
        tail = float(rates[-1])
        if tail >= 1.0:
            return ENDLESS_RUN
        return rates.size + int(self._rng.geometric(1.0 - tail)) - 1


@functools.lru_cache(maxsize=32)
def _statistics_fields(path: str, identity: tuple) -> dict:
    """AcceptanceModel's arguments from the statistics file at `path` (`identity` keys the
    cache)."""
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


def _noted(source: str, note: str) -> str:
    return f"{source}; {note}" if source else note


def _shifted(rates: np.ndarray, shift) -> np.ndarray:
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
    """(each sequence's posterior mean shift, fresh rates, spread) of the runs model with a
    per-sequence shift z ~ N(0, spread²) of the rates' log-odds that make `sequences` most
    likely: the spread by a grid over SPREAD_GRID, the rates (those of a sequence with z = 0,
    higher than the pooled ones where the rates are high) by EM for each spread. Each sequence
    is (fresh trials and accepts per position, trials and accepts of its other steps): in the
    runs model a step that does not start a run continues one past the measured positions,
    where the last fresh rate holds, so those count at that rate (a sequence that never rejects
    a draft shows its ease there). Each sequence's likelihood is integrated over its unknown
    shift (Gauss-Hermite). Fewer than two sequences: no shifts and the pooled rates."""
    trials = np.array([fresh_trials for fresh_trials, _, _, _ in sequences], dtype=np.float64)
    accepts = np.array([fresh_accepts for _, fresh_accepts, _, _ in sequences], dtype=np.float64)
    examined = np.flatnonzero(trials.sum(axis=0))
    if not examined.size:
        raise ValueError("no sequence examined a draft position")
    trials, accepts = trials[:, :examined[-1] + 1], accepts[:, :examined[-1] + 1]
    pooled = accepts.sum(axis=0) / trials.sum(axis=0)
    if len(sequences) < 2:
        return [], pooled.tolist(), 0.0
    # The continuation counts at the last position's rate: the same column.
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
    """EM's M step: per position, the log-odds where the expected accepts (over each
    sequence's posterior on its shift) equal the accepts, by Newton steps."""
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
    """The file's `sequences`: per sequence, (fresh trials, fresh accepts) per position and the
    trials and accepts of its other steps (its position counts less its fresh ones)."""
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
    """Each examined tree node's rate, by path, and with `per_text` (the model has sequence
    shifts) and per-sequence node counts, each text's shift of the nodes' log-odds: the same
    fit as the fresh rates' (fit_sequence_shifts) over the nodes, the rates those of a text with
    shift 0. Otherwise accepts / trials, and no shifts of their own."""
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
