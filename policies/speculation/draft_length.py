"""No, fixed and adaptive speculation: the number k of draft tokens a decode proposes per step.

Verifying k drafts is almost free while decoding is memory-bound, so speculation pays until the
batch's verification tokens make the step compute-bound.
"""
from __future__ import annotations

from policies.checks import check_policy
from policies.protocols import SpeculationPolicy
from policies.speculation.trees import node_children, path_parents
from policies.validators import non_negative_int, number_in, positive_int


def max_speculative_tokens(policy) -> int:
    """A speculation policy's `max_num_speculative_tokens` (0: it never drafts), checked."""
    check_policy(policy, SpeculationPolicy, "speculation")
    max_k = policy.max_num_speculative_tokens
    if isinstance(max_k, bool) or not isinstance(max_k, int) or max_k < 0:
        raise ValueError(f"speculation.max_num_speculative_tokens must be a non-negative "
                         f"integer, got {max_k!r} ({type(policy).__name__})")
    return max_k


def expected_tokens_per_step(acceptance: list[float], k: int) -> float:
    """Tokens a sequence gains per step with k drafts: 1 + Σ_{j<=k} P(drafts 1..j accepted),
    `acceptance[i]` being draft i + 1's acceptance given all before it passed."""
    expected, all_accepted = 1.0, 1.0
    for probability in acceptance[:k]:
        all_accepted *= probability
        expected += all_accepted
    return expected


class AcceptanceCounts:
    """Per draft position, how often it was examined and accepted, overall and over "fresh" steps
    (after a rejection), which differ because rejections cluster; with `tree_paths`, per tree node
    too, so the simulator can walk the same tree."""

    COUNTS = ("position_trials", "position_accepts", "fresh_position_trials",
              "fresh_position_accepts")
    NODE_COUNTS = ("node_trials", "node_accepts")

    def __init__(self, max_num_speculative_tokens: int,
                 tree_paths: list[tuple[int, ...]] | None = None):
        self.position_trials = [0] * max_num_speculative_tokens
        self.position_accepts = [0] * max_num_speculative_tokens
        self.fresh_position_trials = [0] * max_num_speculative_tokens
        self.fresh_position_accepts = [0] * max_num_speculative_tokens
        self.tree_paths = None if tree_paths is None else [tuple(path) for path in tree_paths]
        num_nodes = len(self.tree_paths or ())
        self.node_trials = [0] * num_nodes
        self.node_accepts = [0] * num_nodes
        self._children = None if tree_paths is None else node_children(
            path_parents(self.tree_paths))

    def cleared(self) -> "AcceptanceCounts":
        """Counts of the same shape (positions, tree), all zero."""
        return AcceptanceCounts(len(self.position_trials), self.tree_paths)

    def counts(self) -> dict[str, list]:
        """Every count list by name (the node counts only with a tree)."""
        names = self.COUNTS + (self.NODE_COUNTS if self.tree_paths is not None else ())
        return {name: list(getattr(self, name)) for name in names}

    def record(self, proposed: list[int], accepted: list[int],
               fresh: list[bool] | None = None) -> None:
        """One step's drafts: per sequence, drafts proposed and accepted, and (optionally)
        whether its previous step ended in a rejection."""
        fresh = fresh if fresh is not None else [False] * len(proposed)
        for num_proposed, num_accepted, is_fresh in zip(proposed, accepted, fresh, strict=True):
            if not 0 <= num_accepted <= num_proposed <= len(self.position_trials):
                raise ValueError(f"{num_accepted} accepted of {num_proposed} proposed drafts "
                                 f"(at most {len(self.position_trials)} per step)")
            counts = [(self.position_trials, self.position_accepts)]
            if is_fresh:
                counts.append((self.fresh_position_trials, self.fresh_position_accepts))
            for trials, accepts in counts:
                for position in range(min(num_accepted + 1, num_proposed)):
                    trials[position] += 1
                for position in range(num_accepted):
                    accepts[position] += 1

    def record_tree(self, num_nodes: list[int], accepted_paths: list[list[int]]) -> None:
        """One step's trees, per sequence: its first num_nodes of tree_paths and the accepted
        path; an empty tree counts as its first node rejected, as `record` does."""
        if self._children is None:
            raise ValueError("per-node counts need the tree (AcceptanceCounts(..., tree_paths))")
        for size, path in zip(num_nodes, accepted_paths, strict=True):
            if not 0 <= size <= len(self.tree_paths):
                raise ValueError(f"a tree of {size} nodes; this tree has {len(self.tree_paths)}")
            if size == 0:
                if path:
                    raise ValueError(f"an empty tree cannot accept the path {path}")
                self.node_trials[0] += 1
                continue
            on_path = iter(path)
            accepted = next(on_path, None)
            parent = -1
            while True:
                children = [child for child in self._children[parent + 1] if child < size]
                for child in children:
                    self.node_trials[child] += 1
                    if child == accepted:
                        break
                else:
                    break
                self.node_accepts[accepted] += 1
                parent, accepted = accepted, next(on_path, None)
            if accepted is not None or parent != (path[-1] if path else -1):
                raise ValueError(f"accepted path {path} is not a path from the root of the "
                                 f"first {size} nodes of the tree")

    def scale(self, factor: float) -> None:
        """Multiply every count by `factor` (exponential forgetting)."""
        for name, counts in self.counts().items():
            setattr(self, name, [count * factor for count in counts])

    def add(self, other: "AcceptanceCounts") -> None:
        """Add another run's counts (over as many positions, and the same tree) to these."""
        if len(other.position_trials) != len(self.position_trials):
            raise ValueError(f"cannot add counts over {len(other.position_trials)} positions to "
                             f"counts over {len(self.position_trials)}")
        if other.tree_paths != self.tree_paths:
            raise ValueError("cannot add counts over one token tree to counts over another")
        for name, counts in self.counts().items():
            setattr(self, name, [a + b for a, b in zip(counts, getattr(other, name))])

    def acceptance_rates(self) -> list[float | None]:
        """Conditional acceptance per position; None where a position was never examined."""
        return [accepts / trials if trials else None
                for trials, accepts in zip(self.position_trials, self.position_accepts)]

    def to_statistics(self, drafter: str, target: str, source: str) -> dict:
        statistics = {"num_speculative_tokens": len(self.position_trials), **self.counts()}
        if self.tree_paths is not None:
            statistics["tree_paths"] = [list(path) for path in self.tree_paths]
        return {**statistics, "drafter": drafter, "target": target, "source": source}


class NoSpeculation:
    """k = 0 always: plain decoding."""

    max_num_speculative_tokens = 0

    def num_speculative_tokens(self, num_decodes: int) -> int:
        return 0

    def observe(self, proposed: list[int], accepted: list[int]) -> None:
        pass


class FixedSpeculation:
    """The same k every step (vLLM's `num_speculative_tokens`); 0 is plain decoding, so a sweep
    over k can start there."""

    def __init__(self, num_speculative_tokens: int):
        non_negative_int("speculation.num_speculative_tokens", num_speculative_tokens)
        self.max_num_speculative_tokens = num_speculative_tokens
        self.acceptance = AcceptanceCounts(num_speculative_tokens)

    def num_speculative_tokens(self, num_decodes: int) -> int:
        return self.max_num_speculative_tokens

    def observe(self, proposed: list[int], accepted: list[int]) -> None:
        self.acceptance.record(proposed, accepted)


class AdaptiveSpeculation:
    """k per step maximising E(k) / cost(k, B), B the step's decodes, cost in reads of the
    target's weights:

        cost(k, B) = max(1, B (k + 1) / compute_bound_tokens)
                     + B * per_sequence_cost_ratio + draft_cost_ratio * k

    Acceptance estimates are decayed counts with a prior, so after a stretch of k = 0 they drift
    back to the prior and speculation is tried again. With a tree drafter k is the tokens
    verified and `depth_per_size[k]` the most it can accept.
    """

    def __init__(self, max_num_speculative_tokens: int, compute_bound_tokens: float = 128,
                 per_sequence_cost_ratio: float = 0.02, draft_cost_ratio: float = 0.05,
                 initial_acceptance_rate: float = 0.7, prior_weight: float = 10.0,
                 decay: float = 0.99, depth_per_size: list[int] | None = None):
        positive_int("speculation.max_num_speculative_tokens", max_num_speculative_tokens)
        self.max_num_speculative_tokens = max_num_speculative_tokens
        if depth_per_size is not None and (
                len(depth_per_size) != max_num_speculative_tokens + 1
                or any(not 0 <= depth <= size for size, depth in enumerate(depth_per_size))):
            raise ValueError(f"speculation.depth_per_size must give, for each size 0.."
                             f"{max_num_speculative_tokens}, a depth of at most that size; got "
                             f"{depth_per_size!r}")
        self.depth_per_size = depth_per_size
        inf = float("inf")
        self.compute_bound_tokens = float(number_in(
            "speculation.compute_bound_tokens", compute_bound_tokens, 0, inf, low_open=True))
        self.per_sequence_cost_ratio = float(number_in(
            "speculation.per_sequence_cost_ratio", per_sequence_cost_ratio, 0, inf))
        self.draft_cost_ratio = float(number_in("speculation.draft_cost_ratio",
                                                draft_cost_ratio, 0, inf))
        self.initial_acceptance_rate = float(number_in(
            "speculation.initial_acceptance_rate", initial_acceptance_rate, 0, 1))
        self.prior_weight = float(number_in("speculation.prior_weight", prior_weight, 0, inf,
                                            low_open=True))
        self.decay = float(number_in("speculation.decay", decay, 0, 1, low_open=True))
        self._counts = AcceptanceCounts(max(depth_per_size) if depth_per_size
                                        else max_num_speculative_tokens)

    def acceptance_estimates(self) -> list[float]:
        """The running conditional acceptance estimate of each draft position."""
        estimates = []
        prior = self.initial_acceptance_rate
        for trials, accepts in zip(self._counts.position_trials, self._counts.position_accepts):
            estimate = (accepts + self.prior_weight * prior) / (trials + self.prior_weight)
            estimates.append(estimate)
            prior = estimate  # an unexamined position is as good as the one before it
        return estimates

    def step_cost(self, k: int, num_decodes: int) -> float:
        """cost(k, B) of the class docstring, in reads of the target's weights."""
        return (max(1.0, num_decodes * (k + 1) / self.compute_bound_tokens)
                + num_decodes * self.per_sequence_cost_ratio + self.draft_cost_ratio * k)

    def num_speculative_tokens(self, num_decodes: int) -> int:
        non_negative_int("num_decodes", num_decodes)
        if num_decodes == 0:
            return 0
        acceptance = self.acceptance_estimates()
        best_k, best_value = 0, 1.0 / self.step_cost(0, num_decodes)
        for k in range(1, self.max_num_speculative_tokens + 1):
            depth = k if self.depth_per_size is None else self.depth_per_size[k]
            value = expected_tokens_per_step(acceptance, depth) / self.step_cost(k, num_decodes)
            if value > best_value:
                best_k, best_value = k, value
        return best_k

    def observe(self, proposed: list[int], accepted: list[int]) -> None:
        self._counts.scale(self.decay)
        if self.depth_per_size is not None:   # sizes verified -> depths reachable
            proposed = [self.depth_per_size[size] for size in proposed]
        self._counts.record(proposed, accepted)
