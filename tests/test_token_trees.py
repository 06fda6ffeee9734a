"""Token trees on the engine: tree verification with K/V compaction, Medusa heads and lookahead
decoding (engine/token_tree.py, engine/medusa.py, engine/lookahead.py).

- The tree's own arithmetic: depths, ancestor masks, the tree_mask entries the kernels read, the
  longest accepted path, the compaction moves, Medusa's tree shapes, lookahead's window mask.
- Greedy output is token-identical to plain decoding, and no block is leaked or kept past a
  sequence's tokens, for three tree drafters: n-gram drafts hidden among decoy branches (the
  accepted path is rarely the first nodes, so its K/V must move), Medusa (seeded random heads)
  and lookahead; under continuous batching, block size 1, chunked prefill, preemption by
  recompute and by swap, with the fixed and the adaptive policy, and for n > 1.
- Sampling: Medusa's typical acceptance draws every sample from its own generator (n = 3 equals
  three separately seeded requests); lookahead refuses sampling with a clear error.

The trained tiny target (models/tiny-pair) makes the outputs predictable enough that trees are
accepted, so the compaction and bonus paths all run.
"""
from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.drafters import DrafterDefaults, DraftProposal, NgramDrafter
from engine.lookahead import LookaheadDrafter
from engine.token_tree import TokenTree, compaction_moves, greedy_accepts
from kernels import tree_mask_entry
from policies.speculation.drafters import DrafterKind
from policies.speculation.trees import tree_paths

from factories import token_ids
from test_speculative_engine import (GREEDY, SCENARIOS, TARGET, check_blocks_after_each_step,
                                     text_prompts)


# ---- the tree itself ------------------------------------------------------------------------

def test_tree_from_parents():
    tree = TokenTree.from_parents([10, 11, 12, 13, 14], [-1, -1, 0, 2, 1])
    assert tree.depths == [1, 1, 2, 3, 2]
    assert tree.sees == [0b1, 0b10, 0b101, 0b1101, 0b10010]
    assert tree.depth == 3 and len(tree) == 5
    # Node i sits i + 1 positions after the root: node 3 hides node 1 (2 before it), node 4
    # hides nodes 0, 2, 3 (4, 2, 1 before it).
    assert tree.mask_entries() == [-1, -1, tree_mask_entry([1]), tree_mask_entry([1]),
                                   tree_mask_entry([2]), tree_mask_entry([1, 2, 4])]
    assert TokenTree.chain([5, 6, 7]).mask_entries() == [-1] * 4
    with pytest.raises(ValueError, match="must be -1 .* or an earlier node"):
        TokenTree.from_parents([1, 2], [-1, 1])


def test_accepted_path_is_the_longest_accepted_branch():
    tree = TokenTree.from_parents([10, 11, 12, 13, 14, 15], [-1, -1, 0, 1, 3, 2])
    assert tree.accepted_path([True, True, True, True, True, False]) == [1, 3, 4]
    assert tree.accepted_path([True, True, True, False, True, True]) == [0, 2, 5]
    assert tree.accepted_path([True, True, False, False, False, False]) == [0]  # first on ties
    assert tree.accepted_path([False, False, True, True, True, True]) == []     # no root child
    # Greedy: a node passes where its token is the argmax after its parent (rows: root first).
    assert greedy_accepts(tree, [11, 7, 13, 7, 14, 7, 7]) == [False, True, False, True, True,
                                                              False]


def test_compaction_moves_the_path_behind_the_root():
    # Block size 4, the root at position 6 (block 8, offset 2): nodes at positions 7, 8, ...
    table = [5, 8, 3, 9]
    moves = compaction_moves(table, 4, 6, [1, 4, 5])
    # node 1 (position 8 = block 3 slot 0) -> position 7; node 4 (11) -> 8; node 5 (12) -> 9.
    assert moves == [(12, 35), (15, 12), (36, 13)]
    assert compaction_moves(table, 4, 6, [0, 1]) == []   # already in place


def test_medusa_tree_shapes():
    assert tree_paths([2, 2], num_heads=4, max_depth=3) == [(0,), (0, 0), (1,), (0, 1), (1, 0),
                                                            (1, 1)]
    assert tree_paths([[0], [1], [0, 0], [0, 0, 0]], 4, max_depth=2) == [(0,), (1,), (0, 0)]
    assert len(tree_paths(None, num_heads=2, max_depth=5)) == 3 + 3 * 2
    with pytest.raises(ValueError, match="comes before its prefix"):
        tree_paths([[0, 0], [0]], 4, 4)
    with pytest.raises(ValueError, match="list of paths of ranks"):
        tree_paths("wide", 4, 4)


def test_lookahead_window_sees_a_contiguous_run():
    """Window token (i, j) sees row 0's tokens 0..j and column j above it: positions root + 1
    .. root + 1 + i + j, every one once; guesses are chains after the root."""
    drafter = LookaheadDrafter(window=3, ngram=3, guesses=2)

    class Seq:
        seq_id, status = 0, None
        request = type("R", (), {"prompt_token_ids": [1, 2, 3]})()
        token_ids = staticmethod(lambda: [1, 2, 3])

    state = drafter._state(Seq)
    state.add_ngram((3, 7, 8))
    tree = drafter._tree(Seq, size=12)
    assert len(tree) == 3 * 2 + 1 * 2    # one guess in the pool for token 3
    for node in range(6):
        seen = [other for other in range(len(tree)) if (tree.sees[node] >> other) & 1]
        assert sorted(tree.depths[other] for other in seen) == list(range(1, tree.depths[node]
                                                                          + 1))
        assert tree.parents[node] is None
    assert tree.tokens[6:] == [7, 8] and tree.parents[6:] == [-1, 6] and tree.depth == 2


# ---- greedy identity --------------------------------------------------------------------------

class DecoyTreeDrafter(DrafterDefaults):
    """N-gram drafts as one branch of a tree of random decoys: the accepted path's nodes are
    rarely the first ones, so its K/V has to move."""

    kind = DrafterKind("decoy_tree", tree=True, acceptance="tree_depth", draft_cost="lookup")

    def __init__(self, seed: int = 0):
        self.ngram = NgramDrafter()
        self.rng = random.Random(seed)

    def step(self, plan, speculating):
        trees = []
        for spec, chain in zip(speculating, self.ngram.step(plan, speculating).tokens):
            tokens, parents, last = [], [], -1
            while len(tokens) < spec.num_drafts and (chain or self.rng.random() < 0.5):
                if chain and self.rng.random() < 0.6:
                    tokens.append(chain.pop(0))
                    parents.append(last)
                    last = len(tokens) - 1
                else:
                    tokens.append(self.rng.randrange(256))
                    parents.append(self.rng.randrange(-1, len(tokens) - 1))
            trees.append(TokenTree.from_parents(tokens, parents))
        return DraftProposal([tree.tokens for tree in trees], trees=trees)


@pytest.fixture(scope="module")
def prompts():
    return text_prompts()


@pytest.fixture(scope="module")
def expected(prompts):
    return token_ids(LLM(TARGET, num_gpu_blocks=256).generate(prompts, GREEDY, use_tqdm=False))


def run_checked(llm, prompts):
    check_blocks_after_each_step(llm)
    outputs = token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    kv_cache = llm.scheduler.kv_cache
    assert kv_cache.num_free_blocks() == kv_cache.num_blocks   # no block leaked
    return outputs


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_decoy_trees_compact_the_accepted_path(scenario, prompts, expected):
    llm = LLM(TARGET, speculative_model="ngram", num_speculative_tokens=6,
              **SCENARIOS[scenario])
    llm.executor.drafter = DecoyTreeDrafter()
    assert run_checked(llm, prompts) == expected
    stats = llm.executor.acceptance_stats
    assert stats.position_accepts[2] > 0     # paths three deep were accepted
    if scenario in ("recompute", "swap"):
        assert llm.last_stats.num_preemptions > 0


@pytest.mark.parametrize("method", ["medusa", "lookahead"])
@pytest.mark.parametrize("scenario, policy", [("continuous", "fixed"), ("block_size_1", "fixed"),
                                              ("chunked_prefill", "fixed"),
                                              ("recompute", "fixed"), ("swap", "adaptive")])
def test_greedy_tree_output_is_the_targets(method, scenario, policy, prompts, expected):
    llm = LLM(TARGET, speculative_model=method, num_speculative_tokens=4, speculation=policy,
              **SCENARIOS[scenario])
    assert run_checked(llm, prompts) == expected
    stats = llm.executor.acceptance_stats
    assert len(stats.position_trials) == 4   # per depth, at most k
    assert 0 < stats.position_accepts[0] < stats.position_trials[0]
    assert llm.last_stats.num_accepted_tokens == sum(stats.position_accepts)
    if scenario in ("recompute", "swap"):
        assert llm.last_stats.num_preemptions > 0


@pytest.mark.parametrize("method", ["medusa", "lookahead"])
def test_greedy_samples_of_one_request_are_the_targets(method, prompts, expected):
    llm = LLM(TARGET, speculative_model=method, num_speculative_tokens=3, num_gpu_blocks=256)
    params = SamplingParams(n=2, temperature=0, max_tokens=len(expected[4]), ignore_eos=True)
    outputs = llm.generate([prompts[4], prompts[2]], params, use_tqdm=False)
    assert [c.token_ids for c in outputs[0].outputs] == [expected[4]] * 2
    assert [c.token_ids for c in outputs[1].outputs] == [expected[2]] * 2


def test_medusa_tree_shape_and_size(prompts, expected):
    """A tree given as paths; the policy's size is its node count, k bounds its depth."""
    tree = [[0], [1], [0, 0], [0, 1], [0, 0, 0], [0, 0, 0, 0]]
    llm = LLM(TARGET, speculative_model="medusa", num_speculative_tokens=3,
              speculation_tree=tree, num_gpu_blocks=256)
    assert llm.scheduler.speculation.max_num_speculative_tokens == 5   # the 4-deep path is cut
    assert run_checked(llm, prompts) == expected


# ---- sampling ---------------------------------------------------------------------------------

def test_medusa_sampling_draws_each_sample_from_its_own_generator(prompts):
    llm = LLM(TARGET, speculative_model="medusa", num_speculative_tokens=3, num_gpu_blocks=256)
    common = dict(temperature=1.0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate([prompts[3], prompts[2]], [SamplingParams(n=3, seed=5, **common),
                                                      GREEDY], use_tqdm=False)
    samples = [completion.token_ids for completion in outputs[0].outputs]
    assert len(set(map(tuple, samples))) > 1
    assert sum(llm.executor.acceptance_stats.position_accepts) > 0
    separate = llm.generate([prompts[3]] * 3, [SamplingParams(seed=5 + j, **common)
                                               for j in range(3)], use_tqdm=False)
    assert samples == token_ids(separate)


def test_lookahead_is_greedy_only(prompts):
    llm = LLM(TARGET, speculative_model="lookahead", num_speculative_tokens=3,
              num_gpu_blocks=256)
    outputs = llm.generate(prompts[:2], [SamplingParams(temperature=0.7, max_tokens=8),
                                         SamplingParams(temperature=0, max_tokens=8)],
                           use_tqdm=False)
    assert "lookahead decoding is greedy only" in outputs[0].error
    assert outputs[1].error is None and len(outputs[1].outputs[0].token_ids) == 8


def test_bad_tree_settings_are_named():
    with pytest.raises(ValueError, match="medusa_heads needs speculative_model='medusa'"):
        LLM(TARGET, speculative_model="ngram", num_speculative_tokens=2, medusa_heads="x")
    with pytest.raises(ValueError, match="is not a Medusa heads folder|has no medusa_config"):
        LLM(TARGET, speculative_model="medusa", num_speculative_tokens=2,
            medusa_heads="models/no-such-heads")
    with pytest.raises(ValueError, match="at most 63 fit a tree mask"):
        LLM(TARGET, speculative_model="lookahead", num_speculative_tokens=8,
            lookahead_window=8)
    with pytest.raises(ValueError, match="num_speculative_tokens must be a positive integer"):
        LLM(TARGET, speculative_model="medusa")


# ---- the simulator ----------------------------------------------------------------------------

def test_tree_depth_per_size():
    from policies.speculation.trees import lookahead_depth_per_size, medusa_depth_per_size

    paths = tree_paths([2, 2], num_heads=2, max_depth=2)   # (0,) (0,0) (1,) (0,1) (1,0) (1,1)
    assert medusa_depth_per_size(paths) == [0, 1, 2, 2, 2, 2, 2]
    assert lookahead_depth_per_size(window=2, ngram=3, guesses=1) == [0, 0, 2, 2, 2, 2, 2]


@pytest.mark.parametrize("drafter, k, size, depth", [("medusa", 4, 3 + 6 + 12 + 12, 4),
                                                      ("lookahead", 3, (4 + 4) * 3, 3)])
def test_simulated_tree_speculation(drafter, k, size, depth):
    """speculation.draft_model=medusa / lookahead: the policy's size is the tokens a step
    verifies, acceptances are drawn over the depth it reaches (all of it at rate 1), the
    roofline charges Medusa's heads; every request completes."""
    from factories import make_cfg
    from policies.types import StepPlan
    from sim.core.build import build_replica_executor
    from sim.core.settings import replica_settings
    from sim.core.speculation_setup import speculation_setup
    from sim.core.experiment import run_experiment
    from runtime.specs import HardwareSpec, ModelSpec

    overrides = ["speculation=fixed", f"speculation.draft_model={drafter}",
                 f"speculation.num_speculative_tokens={k}", "speculation.acceptance_rate=1.0",
                 "workload.num_requests=40"]
    cfg = make_cfg(*overrides)
    model = ModelSpec.from_config(cfg.model)
    settings = replica_settings(cfg, model)
    setup = settings.speculation
    assert setup.max_num_speculative_tokens == size and max(setup.depth_per_size) == depth
    executor = build_replica_executor(cfg, settings, model,
                                      HardwareSpec.from_config(cfg.hardware), None)
    plan = StepPlan(num_decode_seqs=2, decode_context_tokens=200)
    plan.spec_lens = {0: size, 1: 1}
    result = executor.execute(plan)
    assert result.num_accepted == {0: depth, 1: setup.depth_per_size[1]}
    drafting = executor.cost_model.draft_time(plan)
    assert (drafting > executor.cost_model.drafting.ngram_overhead_s_per_seq * 2) == (drafter == "medusa")
    result = run_experiment(cfg, plots=False)
    assert result.summary["completed"] == 40
    assert result.summary["mean_tokens_per_decode_step"] > 2
    adaptive = speculation_setup(make_cfg("speculation=adaptive", overrides[1],
                                          f"speculation.max_num_speculative_tokens={k}"))
    assert adaptive.policy_cfg.depth_per_size == adaptive.depth_per_size


@pytest.mark.parametrize("drafter", ["medusa", "lookahead"])
def test_tree_drafters_run_under_the_simulator_clock(drafter, prompts, expected):
    """backend=engine: a simulator replica whose scheduler verifies token trees drives the
    engine executor that build_replica_executor builds from the speculation group; replayed
    requests (greedy) get the target's tokens."""
    from factories import make_cfg, replay_on_sim_clock
    from policies.batching import ContinuousBatchingScheduler
    from policies.memory import PagedBlockManager
    from policies.preemption import RecomputePreemption
    from sim.core.build import build_replica_executor
    from sim.core.settings import replica_settings
    from runtime.policy_config import build_policy
    from runtime.specs import HardwareSpec, ModelSpec

    cfg = make_cfg("backend=engine", "model=tiny-pair", "hardware=cpu", "speculation=fixed",
                   f"speculation.draft_model={drafter}", "speculation.num_speculative_tokens=3",
                   "++speculation.tree=[2,2,1]")
    model = ModelSpec.from_config(cfg.model)
    settings = replica_settings(cfg, model)
    setup = settings.speculation
    kv_cache = PagedBlockManager(num_blocks=96, block_size=8)
    executor = build_replica_executor(cfg, settings, model,
                                      HardwareSpec.from_config(cfg.hardware), kv_cache)
    scheduler = ContinuousBatchingScheduler(
        kv_cache, RecomputePreemption(), max_num_seqs=8, max_model_len=2048,
        speculation=build_policy(setup.policy_cfg, "speculation"))
    assert scheduler.speculation.max_num_speculative_tokens == (
        2 + 4 + 4 if drafter == "medusa" else (4 + 4) * 3)
    requests, _ = replay_on_sim_clock(scheduler, executor, prompts, len(expected[0]))
    assert [request.sequences[0].output_token_ids for request in requests] == expected
    assert len(executor.acceptance_stats.position_trials) == 3
    assert sum(executor.acceptance_stats.position_accepts) > 0
    assert kv_cache.num_free_blocks() == kv_cache.num_blocks


def test_simulated_tree_steps_start_fresh_runs():
    """Every tree step proposes a new tree (the engine counts each as fresh), so a run of
    acceptable positions longer than the tree's depth does not carry into the next step: the
    mean accepted is p1 + p1 p2 at depth 2, where a chain drafter's runs carry over."""
    from sim.core.acceptance import AcceptanceModel
    from sim.core.executor import SimExecutor
    from policies.types import StepPlan

    rates = [0.6, 0.95, 0.95, 0.95]

    class FixedCost:
        def step_time(self, plan):
            return 1e-3

    def mean_accepted(depth_per_size, size):
        executor = SimExecutor(FixedCost(), AcceptanceModel(rates, seed=1, run_probabilities=rates),
                               depth_per_size)
        plan = StepPlan()
        plan.spec_lens = {0: size}
        return sum(executor.execute(plan).num_accepted[0] for _ in range(20000)) / 20000

    assert mean_accepted([0, 1, 1, 2, 2, 2], 5) == pytest.approx(0.6 + 0.6 * 0.95, abs=0.02)
    assert mean_accepted(None, 2) > 0.6 + 0.6 * 0.95 + 0.2   # a chain's run carries over


def test_every_tree_step_counts_in_the_acceptance_statistics(prompts):
    """A lookahead step whose pool has no n-gram for the last token verifies the window alone
    and accepts nothing; it still counts as a depth-1 trial, as the simulator draws it."""
    llm = LLM(TARGET, speculative_model="lookahead", num_speculative_tokens=4)
    llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    stats = llm.executor.acceptance_stats
    # All but the prefill and the last step (one token left to make: no drafts).
    assert stats.position_trials[0] == llm.last_stats.num_steps - 2
