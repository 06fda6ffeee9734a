"""Speculation settings both backends read the same way: the policy config with its draft length,
and the token tree's shape."""
from __future__ import annotations

from collections.abc import Mapping

from omegaconf import DictConfig, ListConfig, OmegaConf

from policies.speculation.drafters import (DEFAULT_LOOKAHEAD_GUESSES, DEFAULT_LOOKAHEAD_WINDOW,
                                           TreeSpec, drafter_kind)

# Keys of the speculation group that describe the run, not the policy: popped before it is built.
SPECULATION_RUN_KEYS = ("draft_model", "acceptance_rate", "acceptance_profile", "tree",
                        "medusa_heads", "lookahead_window", "lookahead_ngram",
                        "lookahead_guesses")



def tree_spec(draft_model: str, k: int, options: Mapping) -> TreeSpec | None:
    """The token-tree shape of drafter `draft_model` at most k deep; None for a chain drafter."""
    if not drafter_kind(draft_model).tree:
        return None
    tree = options.get("tree")
    if isinstance(tree, ListConfig):
        tree = OmegaConf.to_container(tree)
    window = options.get("lookahead_window", DEFAULT_LOOKAHEAD_WINDOW)
    guesses = options.get("lookahead_guesses", DEFAULT_LOOKAHEAD_GUESSES)
    return TreeSpec(draft_model, k, options.get("medusa_heads"), tree, window,
                    options.get("lookahead_ngram"), guesses)


def sized_policy_config(policy_cfg: DictConfig, k: int,
                        depth_per_size: list[int] | None = None) -> DictConfig:
    """The policy config with its draft length set to k; for a token tree k is the tokens a step
    verifies."""
    policy_cfg = policy_cfg.copy()
    if "num_speculative_tokens" in policy_cfg:
        policy_cfg.num_speculative_tokens = k
    elif "max_num_speculative_tokens" in policy_cfg:
        policy_cfg.max_num_speculative_tokens = k
        if depth_per_size is not None:
            policy_cfg.depth_per_size = depth_per_size
    return policy_cfg


def speculation_policy_config(group: DictConfig) -> DictConfig:
    """A speculation group's policy config: the group less the keys that describe the run."""
    return OmegaConf.masked_copy(group, [key for key in group if key not in SPECULATION_RUN_KEYS])
