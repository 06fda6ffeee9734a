"""Acceptance per node of a fixed token tree (Medusa's paths): the engine's counts, the
simulator's walk over the same tree, the fallback to per-depth rates, the statistics file and
bench/validate_speculation.py's --tree."""
from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from policies.speculation import AcceptanceCounts
from policies.speculation.trees import node_children, path_parents
from sim.core.acceptance import AcceptanceModel

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parent.parent
# Root children (0,), (1,), (2,); (0,) has (0, 0) and (0, 1); (1,) has (1, 0); (0, 0) has (0, 0, 0).
TREE = [(0,), (1,), (0, 0), (2,), (0, 1), (1, 0), (0, 0, 0)]


def test_path_parents_and_children():
    assert path_parents(TREE) == [-1, -1, 0, -1, 0, 1, 2]
    assert node_children(path_parents(TREE)) == [[0, 1, 3], [2, 4], [5], [6], [], [], [], []]
    with pytest.raises(ValueError, match=r"\[1, 0\]"):
        path_parents([(0,), (1, 0)])


def test_engine_counts_examined_and_accepted_nodes():
    counts = AcceptanceCounts(3, TREE)
    # (1,) then (1, 0): (0,) examined and rejected, (2,) not examined (an earlier sibling, (1,),
    # was accepted); below (1,) only (1, 0).
    counts.record_tree([7], [[1, 5]])
    assert counts.node_trials == [1, 1, 0, 0, 0, 1, 0]
    assert counts.node_accepts == [0, 1, 0, 0, 0, 1, 0]
    # Nothing accepted: every root child examined.
    counts.record_tree([7], [[]])
    assert counts.node_trials == [2, 2, 0, 1, 0, 1, 0]
    # A tree of its first 3 nodes, (0,) accepted: below it (0, 0) is examined, (0, 1) is not in it.
    counts.record_tree([3], [[0]])
    assert counts.node_trials == [3, 2, 1, 1, 0, 1, 0]
    assert counts.node_accepts == [1, 1, 0, 0, 0, 1, 0]
    # (0,), then its second child (0, 1) after the first, (0, 0), was rejected.
    counts.record_tree([7], [[0, 4]])
    assert counts.node_trials == [4, 2, 2, 1, 1, 1, 0]
    assert counts.node_accepts == [2, 1, 0, 0, 1, 1, 0]
    # An empty tree: its first node examined and rejected, as per depth.
    counts.record_tree([0], [[]])
    assert counts.node_trials[0] == 5 and counts.node_accepts[0] == 2
    with pytest.raises(ValueError, match="not a path from the root"):
        counts.record_tree([7], [[0, 5]])
    with pytest.raises(ValueError, match="not a path from the root"):
        counts.record_tree([2], [[0, 2]])      # (0, 0) is not among the first 2 nodes
    with pytest.raises(ValueError, match="need the tree"):
        AcceptanceCounts(3).record_tree([1], [[0]])


def test_engine_records_node_counts_for_medusa():
    """The executor's statistics for a Medusa tree: the tree's paths and node counts that add up
    to the per-depth counts."""
    from engine import LLM
    from test_speculative_engine import GREEDY, TARGET, text_prompts

    llm = LLM(TARGET, speculative_model="medusa", num_speculative_tokens=3, num_gpu_blocks=256)
    llm.generate(text_prompts()[:2], GREEDY, use_tqdm=False)
    stats = llm.executor.acceptance_stats
    assert stats.tree_paths == llm.executor.drafter.paths
    assert stats.node_trials[0] == stats.position_trials[0] > 0   # (0,) is examined every step
    for depth in (1, 2, 3):
        assert sum(accepts for path, accepts in zip(stats.tree_paths, stats.node_accepts)
                   if len(path) == depth) == stats.position_accepts[depth - 1]
    statistics = stats.to_statistics("medusa", "tiny", "test")
    assert statistics["tree_paths"] == [list(path) for path in stats.tree_paths]
    lookahead = LLM(TARGET, speculative_model="lookahead", num_speculative_tokens=3)
    assert lookahead.executor.acceptance_stats.tree_paths is None   # its tree is not fixed


def depth_distribution(tree, rates, size):
    """Exact probabilities of each accepted length of a walk over the first `size` nodes."""
    children = node_children(path_parents(tree))
    distribution = np.zeros(max(map(len, tree)) + 1)

    def walk(node, depth, probability):
        left = probability
        for child in (c for c in children[node + 1] if c < size):
            walk(child, depth + 1, left * rates[child])
            left *= 1 - rates[child]
        distribution[depth] += left

    walk(-1, 0, 1.0)
    return distribution


@pytest.mark.parametrize("size", [7, 4])
def test_walk_reproduces_the_node_rates(size):
    rates = [0.6, 0.5, 0.7, 0.4, 0.3, 0.9, 0.8]
    model = AcceptanceModel([0.5], node_rates=dict(zip(TREE, rates))).for_tree(TREE).reseeded(3)
    assert "per node" in model.source
    draws = 40000
    accepted = model.draw_tree({seq_id: size for seq_id in range(draws)})
    observed = np.bincount(accepted, minlength=4) / draws
    expected = depth_distribution(TREE, rates, size)
    # Each share within 5 standard errors of the exact distribution.
    assert np.abs(observed - expected).max() < 5 * np.sqrt(0.25 / draws)
    with pytest.raises(ValueError, match="1..7 nodes"):
        model.draw_tree({0: 8})


def test_counts_of_walks_give_back_the_rates():
    """Counting the simulator's walks as the engine counts its trees recovers the node rates."""
    rates = dict(zip(TREE, [0.6, 0.5, 0.7, 0.4, 0.3, 0.9, 0.8]))
    rng = np.random.default_rng(0)
    children = node_children(path_parents(TREE))
    counts = AcceptanceCounts(3, TREE)
    for _ in range(20000):
        node, path = -1, []
        while True:
            for child in children[node + 1]:
                if rng.random() < rates[TREE[child]]:
                    node = child
                    path.append(child)
                    break
            else:
                break
        counts.record_tree([len(TREE)], [path])
    measured = np.array(counts.node_accepts) / np.array(counts.node_trials)
    assert measured == pytest.approx([rates[path] for path in TREE], abs=0.03)


def test_unmeasured_nodes_fall_back_to_the_depth_rates():
    chain = [(0,), (0, 0), (0, 0, 0)]
    # (0,) always accepted, measured; (0, 0) never examined: the per-depth rates decide below.
    for depth_rates, accepted in (([0.5, 1.0, 1.0], 3), ([0.5, 0.0, 1.0], 1)):
        model = AcceptanceModel(depth_rates, node_rates={(0,): 1.0}).for_tree(chain)
        assert model.source.startswith("per node, 2 of 3 tree nodes never examined")
        assert set(model.reseeded(1).draw_tree({i: 3 for i in range(200)})) == {accepted}
    per_depth = AcceptanceModel([0.5]).for_tree(chain)
    assert per_depth.tree is None and "per depth" in per_depth.source


def test_statistics_file_round_trip(tmp_path):
    counts = AcceptanceCounts(3, TREE)
    counts.record([3, 3, 3], [2, 0, 1])
    counts.record_tree([7, 7, 7], [[1, 5], [], [0]])
    path = tmp_path / "medusa.json"
    path.write_text(json.dumps(counts.to_statistics("medusa", "tiny", "test")))
    model = AcceptanceModel.from_file(path)
    assert model.node_rates == {(0,): 1 / 3, (1,): 0.5, (0, 0): 0.0, (0, 1): 0.0, (1, 0): 1.0,
                                (2,): 0.0}    # (0, 0, 0) never examined: absent
    assert model.reseeded(5).node_rates == model.node_rates
    tree_model = model.for_tree(TREE)
    assert "1 of 7 tree nodes never examined" in tree_model.source
    assert tree_model.reseeded(2).tree == TREE
    # Per-sequence node counts: each text gets a shift of the nodes' log-odds of its own, the
    # easier text the larger one.
    sequences, node_counts = [], ([[20, 16], [16, 8]], [[20, 5], [5, 1]])
    for trials, accepts in zip(*node_counts):
        sequence = AcceptanceCounts(2, [(0,), (0, 0)])
        sequence.fresh_position_trials = sequence.position_trials = trials
        sequence.fresh_position_accepts = sequence.position_accepts = accepts
        sequence.node_trials, sequence.node_accepts = trials, accepts
        sequences.append(sequence.counts())
    statistics = {**AcceptanceCounts(2, [(0,), (0, 0)]).to_statistics("m", "t", "s"),
                  "position_trials": [40, 21], "position_accepts": [21, 9],
                  "fresh_position_trials": [40, 21], "fresh_position_accepts": [21, 9],
                  "node_trials": [40, 21], "node_accepts": [21, 9], "sequences": sequences}
    path.write_text(json.dumps(statistics))
    model = AcceptanceModel.from_file(path)
    assert len(model.node_shifts) == len(model.sequence_shifts) == 2
    assert model.node_shifts[0] > model.node_shifts[1] + 1
    chain = model.for_tree([(0,), (0, 0)]).reseeded(4)
    accepted = chain.draw_tree({seq_id: 2 for seq_id in range(4000)})
    by_text = {text: [a for seq_id, a in enumerate(accepted) if chain._texts[seq_id] == text]
               for text in (0, 1)}
    assert np.mean(by_text[0]) > np.mean(by_text[1]) + 0.5   # 1.25 and 0.31 accepted measured
    statistics["node_accepts"] = [10, 30]
    path.write_text(json.dumps(statistics))
    with pytest.raises(ValueError, match="node_accepts exceed node_trials"):
        AcceptanceModel.from_file(path)
    statistics["tree_paths"] = [[0, 0], [0]]
    path.write_text(json.dumps(statistics))
    with pytest.raises(ValueError, match="tree_paths"):
        AcceptanceModel.from_file(path)


def test_simulated_medusa_run_walks_the_tree(tmp_path):
    """speculation.draft_model=medusa with statistics that have node counts: the executor walks
    the run's tree (a chain of the measured nodes here: every node accepted, so every step
    accepts the whole depth)."""
    from factories import make_cfg
    from policies.types import StepPlan
    from sim.core.build import build_replica_executor
    from sim.core.settings import replica_settings
    from runtime.specs import HardwareSpec, ModelSpec

    counts = AcceptanceCounts(2, [(0,), (1,), (0, 0)])
    counts.record([2], [2])
    counts.record_tree([3], [[0, 2]])
    path = tmp_path / "medusa.json"
    path.write_text(json.dumps(counts.to_statistics("medusa", "t", "s")))
    cfg = make_cfg("speculation=fixed", "speculation.draft_model=medusa",
                   "speculation.num_speculative_tokens=2", f"speculation.acceptance_profile={path}",
                   "++speculation.tree=[[0],[0,0]]")
    model = ModelSpec.from_config(cfg.model)
    settings = replica_settings(cfg, model)
    setup = settings.speculation
    assert setup.acceptance.tree == [(0,), (0, 0)]
    executor = build_replica_executor(cfg, settings, model,
                                      HardwareSpec.from_config(cfg.hardware), None)
    plan = StepPlan(num_decode_seqs=2, decode_context_tokens=200)
    plan.spec_lens = {0: 2, 1: 1}
    assert executor.execute(plan).num_accepted == {0: 2, 1: 1}


def load_validate_script():
    spec = importlib.util.spec_from_file_location("validate_speculation",
                                                  REPO / "bench" / "validate_speculation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_validate_script_tree_option(tmp_path):
    script = load_validate_script()
    assert script.parse_tree("[[0], [0, 0], [1]]") == [[0], [0, 0], [1]]
    for bad in ("[[0], [0, 0]", "[0, 1]", "[[0], []]", "[[-1]]"):
        with pytest.raises(argparse.ArgumentTypeError, match="--tree"):
            script.parse_tree(bad)
    overrides = script.job_overrides(Path("t.csv"), 1, 4, "medusa", Path("p"), Path("a.json"),
                                     [[0], [0, 0]])
    assert "speculation.tree=[[0],[0,0]]" in overrides
    statistics = AcceptanceCounts(2, [(0,)]).to_statistics("m", "t", "s")
    statistics["sequences"] = [AcceptanceCounts(2, [(0,)]).counts()]
    source = tmp_path / "node.json"
    source.write_text(json.dumps(statistics))
    stripped = json.loads(script.per_depth_statistics(source, tmp_path / "d.json").read_text())
    assert "node_trials" not in stripped and "tree_paths" not in stripped
    assert "node_trials" not in stripped["sequences"][0] and "position_trials" in stripped
