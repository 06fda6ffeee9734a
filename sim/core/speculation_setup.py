"""Speculative decoding set up once for both backends: the speculation group's policy config
with its draft length (a token tree's size: the tokens a step verifies), the token tree's shape
(policies.speculation.drafters.TreeSpec) and, for the simulator, what the drafts cost and how
often they are accepted. The engine's `LLM(speculative_model=...)` calls the same pieces with
its own settings (engine/builder.py)."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from omegaconf import DictConfig, ListConfig, OmegaConf

from policies.speculation import max_speculative_tokens
from policies.speculation.drafters import (DEFAULT_LOOKAHEAD_GUESSES, DEFAULT_LOOKAHEAD_WINDOW,
                                           DRAFTER_KINDS, TreeSpec, drafter_kind)
from sim.core.acceptance import AcceptanceModel
from sim.core.policy_config import MODEL_CONFIG_DIR, build_policy, config_names
from sim.core.specs import ModelSpec

# Keys of the speculation group that describe the run, not the policy: popped before it is built.
SPECULATION_RUN_KEYS = ("draft_model", "acceptance_rate", "acceptance_profile", "tree",
                        "medusa_heads", "lookahead_window", "lookahead_ngram",
                        "lookahead_guesses")


@dataclass
class SpeculationSetup:
    """The speculation group of a run whose policy drafts: the policy's own config (built once
    per replica: a policy may keep state), the drafter and, for the simulator, what the drafts
    cost and how often they are accepted."""

    policy_cfg: DictConfig
    max_num_speculative_tokens: int
    draft_model: str                      # "ngram", a conf/model name or (engine) a folder
    draft_spec: ModelSpec | str | None    # sim: "ngram" or the draft model's shape
    acceptance: AcceptanceModel | None    # sim: the acceptance statistics
    # The draft model whose K/V shares the KV pool's blocks: None for ngram (no K/V), or for a
    # checkpoint folder the engine loads (its shape is not in conf/model).
    draft_kv: ModelSpec | None = None
    # Token trees (medusa, lookahead): per size the policy may choose, the depth it reaches.
    depth_per_size: list[int] | None = None
    tree: TreeSpec | None = None          # token trees: the shape the engine drafts

    def acceptance_model(self, seed) -> AcceptanceModel:
        """The acceptance statistics with a generator of their own (one per replica)."""
        return self.acceptance.reseeded(seed)

    def executor_tree(self) -> dict:
        """The token tree as a backend executor's `tree` argument (a {_target_: ...} mapping):
        its depth the deepest the policy's sizes reach."""
        fields = dataclasses.asdict(self.tree) | {"max_depth": max(self.depth_per_size)}
        return {"_target_": f"{TreeSpec.__module__}.{TreeSpec.__qualname__}",
                "_convert_": "all", **fields}


def tree_spec(draft_model: str, k: int, options: Mapping) -> TreeSpec | None:
    """The token-tree shape of drafter `draft_model` at most k deep, from `options` (the
    speculation group, or the engine's settings under the same names: medusa_heads, tree,
    lookahead_window, lookahead_ngram, lookahead_guesses); None for a chain drafter."""
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
    """The policy config with its own draft length set to k (fixed's num_speculative_tokens,
    adaptive's max_num_speculative_tokens); for a token tree k is the tokens a step verifies
    and adaptive chooses its size by the depth each reaches (`depth_per_size`)."""
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


def draft_model_spec(name: str) -> ModelSpec | str:
    """What the cost model costs the drafts with: a drafter's name (policies.speculation.
    drafters.DRAFTER_KINDS) or the draft model's spec."""
    if name in DRAFTER_KINDS:
        return name
    config_file = MODEL_CONFIG_DIR / f"{name}.yaml"
    if not config_file.is_file():
        raise ValueError(f"speculation.draft_model must be {', '.join(DRAFTER_KINDS)} or a "
                         f"conf/model name ({', '.join(config_names('model'))}) for the "
                         f"simulator; got {name!r}")
    return ModelSpec.from_config(OmegaConf.load(config_file))


def acceptance_statistics(group: DictConfig) -> AcceptanceModel:
    """The simulator's acceptance model: the measured profile when given, else i.i.d."""
    if group.get("acceptance_profile") is not None:
        return AcceptanceModel.from_file(group.acceptance_profile)
    if group.get("acceptance_rate") is None:
        raise ValueError("speculation.acceptance_rate (a probability) or "
                         "speculation.acceptance_profile (a JSON file) is required to simulate "
                         "speculative decoding")
    return AcceptanceModel.iid(group.acceptance_rate)


def speculation_setup(cfg: DictConfig) -> SpeculationSetup | None:
    """The run's speculation, checked before anything runs; None when it does not draft (no
    speculation group, or a policy whose max_num_speculative_tokens is 0: speculation=none)."""
    group = cfg.get("speculation")
    if group is None:
        return None
    policy_cfg = speculation_policy_config(group)
    max_k = max_speculative_tokens(build_policy(policy_cfg, "speculation"))
    if max_k == 0:
        return None
    draft_model = group.get("draft_model")
    if not isinstance(draft_model, str) or not draft_model:
        raise ValueError(f"speculation.draft_model must be ngram or a model name, got "
                         f"{draft_model!r}")
    depth_per_size = None
    # A token tree's k bounds the tokens a step accepts; the policy chooses how many it verifies.
    tree = tree_spec(draft_model, max_k, group)
    if tree is not None:
        depth_per_size = tree.depth_per_size()
        max_k = len(depth_per_size) - 1
        policy_cfg = sized_policy_config(policy_cfg, max_k, depth_per_size)
    if cfg.backend.get("executor") is not None:  # a real backend drafts, verifies and counts
        draft_kv = None
        if (MODEL_CONFIG_DIR / f"{draft_model}.yaml").is_file():
            draft_kv = draft_model_spec(draft_model)
        return SpeculationSetup(policy_cfg, max_k, draft_model, None, None, draft_kv,
                                depth_per_size, tree)
    draft_spec = draft_model_spec(draft_model)
    acceptance = acceptance_statistics(group)
    if drafter_kind(draft_model).acceptance == "tree_node":   # per node where it was measured
        acceptance = acceptance.for_tree(tree.medusa_paths())
    return SpeculationSetup(policy_cfg, max_k, draft_model, draft_spec, acceptance,
                            draft_spec if isinstance(draft_spec, ModelSpec) else None,
                            depth_per_size, tree)
