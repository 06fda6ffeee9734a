"""Drawing accepted-draft counts: `AcceptanceModel`.

With fresh (run) rates each sequence walks through runs of acceptable positions, since under
greedy decoding a draft is acceptable at a position of the text whatever k is; per-text shifts
are the measured texts' own, which keeps their skew.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from policies import validators
from policies.speculation.trees import node_children, path_parents
from sim.core.acceptance.fitting import shifted, statistics_fields

# Stands for a run that never ends (a fresh rate of 1).
ENDLESS_RUN = 1 << 40


class AcceptanceModel:
    """Draws accepted-draft counts per position, in runs (`run_probabilities`), or node by node
    of a fixed tree (`for_tree`), from a seeded generator."""

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
        # seq_id -> acceptable positions left in its run; absent: a new run at its next step.
        self._left_in_run: dict[int, int] = {}
        self.node_shifts = [float(validators.finite_number(
            f"the acceptance model's node_shifts[{index}]", shift))
            for index, shift in enumerate(node_shifts or ())]
        if self.node_shifts and len(self.node_shifts) != len(self.sequence_shifts):
            raise ValueError(f"{len(self.node_shifts)} node shifts for "
                             f"{len(self.sequence_shifts)} texts (sequence_shifts)")
        # seq_id -> the measured text it reads like, drawn when it first speculates.
        self._texts: dict[int, int] = {}
        self.node_rates = {tuple(path): float(validators.probability(
            f"acceptance probability of tree node {list(path)}", rate))
            for path, rate in (node_rates or {}).items()}
        self.tree = None if tree is None else [tuple(path) for path in tree]
        if self.tree is not None:
            self._children = node_children(path_parents(self.tree))
            # NaN: never examined, so the per-depth rates take over.
            self._tree_rates = np.array([self.node_rates.get(path, np.nan) for path in self.tree])
            self._shifted_tree_rates: dict[float, np.ndarray] = {}

    def reseeded(self, seed) -> "AcceptanceModel":
        """The same model with a generator (and run state) of its own."""
        return AcceptanceModel(self.position_probabilities, seed, self.source,
                               self.run_probabilities, self.sequence_shifts, self.node_rates,
                               self.tree, self.node_shifts)

    def for_tree(self, paths: list[tuple[int, ...]]) -> "AcceptanceModel":
        """This model drawing a fixed tree's steps node by node, or per depth without per-node
        statistics; `source` says which."""
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
        """Read an acceptance statistics file, its fits cached by path, size and time of change
        since every simulator run loads it anew."""
        try:
            stat = Path(path).stat()
            identity = (str(Path(path).resolve()), stat.st_mtime_ns, stat.st_size)
        except OSError:
            identity = (str(path), None, None)   # read_json_object names what is wrong
        return cls(seed=seed, **statistics_fields(str(path), identity))

    def probabilities(self, num_positions: int) -> np.ndarray:
        """p_1..p_num_positions, the last measured one repeated past the measured positions."""
        measured = self._probabilities
        if num_positions <= measured.size:
            return measured[:num_positions]
        return np.concatenate([measured, np.full(num_positions - measured.size, measured[-1])])

    def mean_accepted(self, k: int) -> float:
        """Expected accepted drafts of k drawn independently per step (runs differ)."""
        return float(np.cumprod(self.probabilities(k)).sum())

    def draw(self, spec_lens: dict[int, int], fresh_each_step: bool = False) -> list[int]:
        """Accepted drafts for each sequence proposing k = spec_lens[seq_id]; `fresh_each_step`
        for token trees, since a new tree every step carries no run into the next."""
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
            probabilities = shifted(probabilities[None, :], shifts[:, None])
        accepted = self._rng.random((lengths.size, max_len)) < probabilities
        # A draft counts only while it and every draft before it were accepted, and only up to
        # the sequence's own k.
        accepted &= np.arange(max_len) < lengths[:, None]
        return np.cumprod(accepted, axis=1).sum(axis=1).tolist()

    def draw_tree(self, sizes: dict[int, int]) -> list[int]:
        """The depth a walk from the root reaches for each sequence verifying the first
        sizes[seq_id] nodes of the tree."""
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
                shifted(self._tree_rates, node_shift) if node_shift else self._tree_rates)
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
        """Accepted positions after `depth`, up to `reach`, from the per-depth rates."""
        measured = (self._run_probabilities if self._run_probabilities is not None
                    else self._probabilities)
        rates = measured[np.minimum(np.arange(depth, reach), measured.size - 1)]
        if shift:
            rates = shifted(rates, shift)
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
        """Acceptable positions before the next rejected one, from the shifted fresh rates."""
        rates = self._run_probabilities
        if shift:
            rates = shifted(rates, shift)
        rejected = np.flatnonzero(self._rng.random(rates.size) >= rates)
        if rejected.size:
            return int(rejected[0])
        tail = float(rates[-1])
        if tail >= 1.0:
            return ENDLESS_RUN
        return rates.size + int(self._rng.geometric(1.0 - tail)) - 1


def _noted(source: str, note: str) -> str:
    return f"{source}; {note}" if source else note

