"""No, fixed and adaptive speculation: the number k of draft tokens a decode proposes per step.

A drafter (an n-gram lookup or a small model) proposes k tokens; the target model verifies all of
them and one more position in a single forward pass of k + 1 tokens per sequence; the accepted
prefix of the drafts plus one token (the correction, or a bonus token when all k pass) is kept.
While decoding is memory-bound the extra k tokens per sequence cost almost nothing, so each step
yields more tokens; once the batch's verification tokens make the step compute-bound they do not
come for free any more, and speculation only pays while acceptance is high.

The scheduler asks `num_speculative_tokens(num_decodes)` once per step, caps k per sequence (no
draft past the output length or the model's length, none beyond the step's token budget), and
after the step reports every speculating sequence's (proposed, accepted) to `observe`.
"""
from __future__ import annotations

from policies.validators import non_negative_int, number_in, positive_int


def max_speculative_tokens(policy) -> int:
    """A speculation policy's `max_num_speculative_tokens`, checked (0: it never drafts)."""
    max_k = getattr(policy, "max_num_speculative_tokens", None)
    if isinstance(max_k, bool) or not isinstance(max_k, int) or max_k < 0:
        raise ValueError(f"speculation.max_num_speculative_tokens must be a non-negative "
                         f"integer, got {max_k!r} ({type(policy).__name__})")
    return max_k


def expected_tokens_per_step(acceptance: list[float], k: int) -> float:
    """Tokens a sequence gains per step with k drafts: 1 + sum over j <= k of the probability
    that drafts 1..j are all accepted, where `acceptance[i]` is the probability that draft i + 1
    is accepted given that all before it were. With one rate a for every position this is
    (1 - a^(k+1)) / (1 - a)."""
    expected, all_accepted = 1.0, 1.0
    for probability in acceptance[:k]:
        all_accepted *= probability
        expected += all_accepted
    return expected


class AcceptanceCounts:
    """Per draft position i = 1..K: how often it was examined (every earlier draft accepted) and
    how often it was accepted. The same counts over the steps that start a run of acceptable
    drafts (a sequence's first speculating step, or the one after a rejected draft: "fresh"
    steps, Sequence.starts_run) describe the runs of accepted drafts: where a step starts in a
    run is known only there, and rejections cluster (a hard stretch of text rejects several steps
    in a row), so fresh and overall rates differ. `to_statistics` gives the acceptance statistics
    file's content (the format `sim.core.acceptance.AcceptanceModel.from_file` reads)."""

    COUNTS = ("position_trials", "position_accepts", "fresh_position_trials",
              "fresh_position_accepts")

    def __init__(self, max_num_speculative_tokens: int):
        self.position_trials = [0] * max_num_speculative_tokens
        self.position_accepts = [0] * max_num_speculative_tokens
        self.fresh_position_trials = [0] * max_num_speculative_tokens
        self.fresh_position_accepts = [0] * max_num_speculative_tokens

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

    def scale(self, factor: float) -> None:
        """Multiply every count by `factor` (exponential forgetting)."""
        for name in self.COUNTS:
            setattr(self, name, [count * factor for count in getattr(self, name)])

    def add(self, other: "AcceptanceCounts") -> None:
        """Add another run's counts (over as many positions) to these."""
        if len(other.position_trials) != len(self.position_trials):
            raise ValueError(f"cannot add counts over {len(other.position_trials)} positions to "
                             f"counts over {len(self.position_trials)}")
        for name in self.COUNTS:
            setattr(self, name, [a + b for a, b in zip(getattr(self, name), getattr(other, name))])

    def acceptance_rates(self) -> list[float | None]:
        """Conditional acceptance per position; None where a position was never examined."""
        return [accepts / trials if trials else None
                for trials, accepts in zip(self.position_trials, self.position_accepts)]

    def to_statistics(self, drafter: str, target: str, source: str) -> dict:
        return {"num_speculative_tokens": len(self.position_trials),
                "position_trials": list(self.position_trials),
                "position_accepts": list(self.position_accepts),
                "fresh_position_trials": list(self.fresh_position_trials),
                "fresh_position_accepts": list(self.fresh_position_accepts),
                "drafter": drafter, "target": target, "source": source}


class NoSpeculation:
    """k = 0 always: plain decoding. The scheduler then skips speculation entirely."""

    max_num_speculative_tokens = 0

    def num_speculative_tokens(self, num_decodes: int) -> int:
        return 0

    def observe(self, proposed: list[int], accepted: list[int]) -> None:
        pass


class FixedSpeculation:
    """The same k every step, whatever the batch (vLLM's `num_speculative_tokens`; 0 is plain
    decoding, so a sweep over k can start there). Counts the acceptances it observes in
    `acceptance`."""

    def __init__(self, num_speculative_tokens: int):
        non_negative_int("speculation.num_speculative_tokens", num_speculative_tokens)
        self.max_num_speculative_tokens = num_speculative_tokens
        self.acceptance = AcceptanceCounts(num_speculative_tokens)

    def num_speculative_tokens(self, num_decodes: int) -> int:
        return self.max_num_speculative_tokens

    def observe(self, proposed: list[int], accepted: list[int]) -> None:
        self.acceptance.record(proposed, accepted)


class AdaptiveSpeculation:
    """k per step from the running acceptance rate and the batch size.

    The rule: pick k in 0..max_num_speculative_tokens maximising expected tokens per unit of step
    cost,

        E(k) / cost(k, B),   E(k) = 1 + sum_{j<=k} p_1 ... p_j   (expected_tokens_per_step)
        cost(k, B) = max(1, B (k + 1) / compute_bound_tokens)
                     + B * per_sequence_cost_ratio + draft_cost_ratio * k

    with B the step's decodes and p_i the running estimate of position i's conditional
    acceptance. The cost is in units of one read of the target's weights. The linear layers are
    free to verify with until the batch's B (k + 1) tokens reach `compute_bound_tokens` (where
    the forward pass turns compute-bound: ~100 tokens for fp16 on an A100, ~200 on an H100),
    then grow with them. What verification does not change, a sequence's KV-cache read and its
    bookkeeping, is `per_sequence_cost_ratio` per decode (≈ context × KV bytes per token /
    weight bytes: ~0.02 for Llama-2-7B at 600-token contexts; 0 when contexts are short).
    Each draft step adds `draft_cost_ratio` (a draft model's decode step over the target's; ~0
    for n-gram). So k falls as the batch grows (to 0 where the KV reads are cheap, to a small k
    where they dominate and speculation amortises them) and rises with acceptance.

    With a token-tree drafter (Medusa, lookahead) k is the tokens a step verifies, not how deep
    it reaches: `depth_per_size[k]` gives the most tokens k of them can accept, and E(k) sums
    the running per-depth estimates that far.

    The estimates are exponentially decayed counts (by `decay` per step, a window of about
    1 / (1 - decay) steps) with a prior of `prior_weight` trials at `initial_acceptance_rate`; a
    position never examined takes the estimate of the one before it. With no observations (k = 0
    for a while) the estimates drift back to the prior, so speculation is tried again.
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
