"""The simulator's speculative decoding, set up once per run: the shared settings
(runtime/speculation.py) plus what the drafts cost and how often they are accepted."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from policies.speculation import max_speculative_tokens
from policies.speculation.drafters import DRAFTER_KINDS, TreeSpec, drafter_kind
from runtime.policy_config import MODEL_CONFIG_DIR, build_policy, config_names
from runtime.specs import ModelSpec
from runtime.speculation import sized_policy_config, speculation_policy_config, tree_spec
from sim.core.acceptance import AcceptanceModel


@dataclass
class SpeculationSetup:
    """The speculation of a run whose policy drafts; the policy is built per replica from
    `policy_cfg`, since a policy may keep state."""

    policy_cfg: DictConfig
    max_num_speculative_tokens: int
    draft_model: str                      # "ngram", a conf/model name or (engine) a folder
    draft_spec: ModelSpec | str | None    # sim: "ngram" or the draft model's shape
    acceptance: AcceptanceModel | None    # sim: the acceptance statistics
    draft_kv: ModelSpec | None = None     # shares the KV pool's blocks; None: ngram, a folder
    depth_per_size: list[int] | None = None
    tree: TreeSpec | None = None          # token trees: the shape the engine drafts

    def acceptance_model(self, seed) -> AcceptanceModel:
        """The acceptance statistics with a generator of their own (one per replica)."""
        return self.acceptance.reseeded(seed)

    def executor_tree(self) -> dict:
        """The token tree as a backend executor's `tree` argument."""
        fields = dataclasses.asdict(self.tree) | {"max_depth": max(self.depth_per_size)}
        return {"_target_": f"{TreeSpec.__module__}.{TreeSpec.__qualname__}",
                "_convert_": "all", **fields}


def draft_model_spec(name: str) -> ModelSpec | str:
    """What the cost model costs the drafts with: a drafter's name or the draft model's spec."""
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
    """The run's speculation, checked before anything runs; None when it does not draft."""
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
