"""The profiler: its grid builds valid plans, its fit recovers a known linear cost from a stand-in
executor, it writes the profile JSON and samples CSV, and one quick real run on the tiny Llama."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from calibration.profiler.cli import main, read_samples, write_profile
from calibration.profiler.fit import fit_profile, nnls
from calibration.profiler.grid import make_grid, profile
from runtime.step_shapes import GridPoint, build_plan
from kernels.tiling import query_class
from policies.memory import PagedBlockManager
from policies.types import Request, Sequence, StepResult
from sim.cost.profiled.tile_features import (TILE_FEATURES, AttentionTiling,
                                                     attention_lengths, tile_features)
from sim.cost.profiled.cost_model import ProfiledCostModel
from sim.cost.profiled.step_features import STEP_FEATURES, step_features
from runtime.step_shapes import age_pool

from factories import (ALL_FEATURES, KV_BYTES_PER_TOKEN, features_of, held_out_points, predict,
                       true_cost)

torch.set_num_threads(1)


class StandInExecutor:
    """execute(plan) -> the known cost of the plan's features, with 1% multiplicative noise."""

    def __init__(self, block_size, num_blocks, num_host_blocks, seed=0, noise=0.01):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.rng = np.random.default_rng(seed + block_size)
        self.noise = noise
        self.calls = 0

    def execute(self, plan):
        self.calls += 1
        for table in plan.block_tables.values():  # tables must index the pool sized for them
            assert all(0 <= block < self.num_blocks for block in table)
        for src, dst in plan.blocks_to_copy:
            assert 0 <= src < self.num_blocks and 0 <= dst < self.num_blocks
        for dev, host in plan.blocks_to_swap_out:
            assert 0 <= dev < self.num_blocks and 0 <= host < self.num_host_blocks
        for host, dev in plan.blocks_to_swap_in:
            assert 0 <= dev < self.num_blocks and 0 <= host < self.num_host_blocks
        features = features_of(plan, self.block_size)
        duration = true_cost(features) * (1 + self.noise * self.rng.standard_normal())
        return StepResult(duration=duration)


def test_grid_plans_are_real():
    for point in make_grid((16, 32)):
        plan = build_plan(point)
        features = dict(zip(STEP_FEATURES, step_features(plan)))
        assert features["num_decode_seqs"] == len(point.decodes)
        assert features["num_prefill_seqs"] == len(point.prefills)
        assert features["num_prefill_tokens"] == sum(c for c, _ in point.prefills)
        assert features["decode_context_tokens"] == sum(point.decodes)
        assert features["num_blocks_copied"] == point.num_copies
        assert features["num_blocks_swapped"] == point.num_swap_out + point.num_swap_in
        for seq, num_new in zip(plan.seqs, plan.num_new_tokens):
            table = plan.block_tables[seq.seq_id]
            assert len(table) * point.block_size >= seq.num_computed_tokens + num_new
            assert len(seq.request.prompt_token_ids) == seq.request.prompt_len


def test_an_aged_pool_scatters_the_blocks_and_keeps_the_step():
    """The profiler's plans take their blocks from a pool handed out in a random order, as a
    serving run's pool is; the step (its features) is the fresh pool's."""
    point = GridPoint(0, "mixed", 16, decodes=(256,) * 8, prefills=((128, 64),))
    fresh = build_plan(point, np.random.default_rng(3), 400, 0)
    aged = build_plan(point, np.random.default_rng(3), 400, 0, aged_pool=True)
    assert step_features(aged) == step_features(fresh)
    tables = [aged.block_tables[seq.seq_id] for seq in aged.seqs]
    neighbours = [b == a + 1 for table in tables for a, b in zip(table, table[1:])]
    assert sum(neighbours) < 0.1 * len(neighbours)
    for seq in fresh.seqs:   # a fresh pool: consecutive blocks
        table = fresh.block_tables[seq.seq_id]
        assert table == list(range(table[0], table[0] + len(table)))
    blocks = [block for table in tables for block in table]
    assert len(set(blocks)) == len(blocks) and max(blocks) < 400
    again = build_plan(point, np.random.default_rng(3), 400, 0, aged_pool=True)
    assert [again.block_tables[seq.seq_id] for seq in again.seqs] == tables


def test_an_aged_pool_hands_out_blocks_in_the_given_order_then_as_freed():
    manager = PagedBlockManager(6, 4, watermark=0)
    age_pool(manager, [3, 0, 5, 1, 4, 2])
    assert manager.num_used_blocks() == 0 and not manager.block_tables
    request = Request(0, 0.0, 16, 1)
    first, second, third = (Sequence(seq_id, request) for seq_id in range(3))
    assert manager.allocate_slots(first, 8) and manager.allocate_slots(second, 4)
    assert manager.block_tables == {0: [3, 0], 1: [5]}
    manager.free(first)
    assert manager.allocate_slots(third, 16)
    # The rest of the order, then the freed ones (a table is released from its last block).
    assert manager.block_tables[2] == [1, 4, 2, 0]
    manager.check_invariants()
    for order in ([0, 1, 2], [0, 0, 1, 2, 3, 4]):
        with pytest.raises(ValueError, match="free_order must be a permutation"):
            age_pool(PagedBlockManager(6, 4, watermark=0), order)
    with pytest.raises(ValueError, match="empty pool"):
        age_pool(manager, list(range(6)))


def test_a_profile_without_tile_features_is_fitted_and_predicted_on_the_core_ones(tmp_path):
    """Profiled without the tile features (no kv_bytes_per_token), a profile lists only
    STEP_FEATURES and its cost model needs no block size."""
    def factory(block_size, num_blocks, num_host_blocks):
        return StandInExecutor(block_size, num_blocks, num_host_blocks)

    prof = profile(factory, make_grid((16,), quick=True), repeats=2, progress=False)
    assert not set(TILE_FEATURES) & set(prof.samples[0])
    content = fit_profile(prof.samples)
    assert content["features"] == list(STEP_FEATURES)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(content))
    model = ProfiledCostModel(str(path), sample_residuals=False)
    assert model.feature_names == STEP_FEATURES and model.tiling is None
    plan = build_plan(GridPoint(0, "decode", 16, decodes=(100,) * 4))
    assert model.step_time(plan) == pytest.approx(model.predict_mean(step_features(plan)))


def test_tile_features_in_any_position_predict_the_same():
    """A profile lists its features in its own order (the shipped ones have the tile features
    among the core ones): the prediction is by name."""
    def factory(block_size, num_blocks, num_host_blocks):
        return StandInExecutor(block_size, num_blocks, num_host_blocks)

    prof = profile(factory, make_grid((16,), quick=True), repeats=2, progress=False,
                   kv_bytes_per_token=KV_BYTES_PER_TOKEN)
    content = fit_profile(prof.samples, {"attention_tiling": {
        "kv_bytes_per_token": KV_BYTES_PER_TOKEN, "tile_bytes": 2 << 20}})
    assert content["features"] == list(ALL_FEATURES)
    order = [*STEP_FEATURES[:9], *TILE_FEATURES[:2], *STEP_FEATURES[9:], TILE_FEATURES[2]]
    columns = [ALL_FEATURES.index(name) for name in order]
    interleaved = json.loads(json.dumps(content))
    interleaved["features"] = order
    if content["correction"] is not None:
        correction = interleaved["correction"]
        correction["points"] = [[point[c] for c in columns] for point in correction["points"]]
        correction["scales"] = [correction["scales"][c] for c in columns]
    as_fitted = ProfiledCostModel(content, sample_residuals=False, block_size=16)
    reordered = ProfiledCostModel(interleaved, sample_residuals=False, block_size=16)
    assert reordered.feature_names == tuple(order)
    for point in held_out_points():
        plan = build_plan(point)
        assert reordered.step_time(plan) == pytest.approx(as_fitted.step_time(plan), rel=1e-12)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-pair", "tiny-pair+ngram",
                                  "tiny-pair+tiny-pair-draft", "tiny-moe"])
def test_the_shipped_cpu_profiles_load_with_their_tile_features_and_correction(name):
    path = Path(__file__).resolve().parents[1] / "profiles" / "cpu" / f"{name}.json"
    model = ProfiledCostModel(str(path), sample_residuals=False, block_size=16)
    content = json.loads(path.read_text())
    assert model.feature_names == tuple(content["features"])
    assert set(TILE_FEATURES) <= set(model.feature_names) and model.tiling is not None
    assert model.correction is not None
    plan = build_plan(GridPoint(0, "decode_mixed_ctx", 16, decodes=(40, 300, 120, 900)))
    features = dict(zip(model.feature_names, model.features(plan)))
    assert features["num_attention_tiles"] >= 1 and features["num_decode_seqs"] == 4
    assert 0 < model.step_time(plan) < 1


def test_nnls_matches_lstsq_when_unconstrained_and_clamps_otherwise():
    rng = np.random.default_rng(0)
    a = rng.random((50, 4))
    x_true = np.array([1.0, 2.0, 0.5, 3.0])
    assert np.allclose(nnls(a, a @ x_true), x_true, atol=1e-8)
    b = a @ np.array([1.0, -2.0, 0.5, 3.0])
    x = nnls(a, b)
    assert (x >= 0).all()
    # Optimality (KKT): the gradient vanishes on positive coefficients, points up on zeros.
    grad = a.T @ (a @ x - b)
    assert np.allclose(grad[x > 0], 0, atol=1e-8)
    assert (grad[x == 0] >= -1e-8).all()


def test_stand_in_recovered_within_two_percent(tmp_path):
    grid = make_grid((16, 32))
    executors = []

    def factory(block_size, num_blocks, num_host_blocks):
        executors.append(StandInExecutor(block_size, num_blocks, num_host_blocks))
        return executors[-1]

    prof = profile(factory, grid, repeats=3, warmup=1, progress=False,
                   kv_bytes_per_token=KV_BYTES_PER_TOKEN)
    assert len(prof.samples) == len(grid) * 3
    assert {executor.block_size for executor in executors} == {16, 32}
    content = fit_profile(prof.samples, {"device": "stand-in"})
    assert content["fit"]["r2"] > 0.99
    for point in held_out_points():
        features = features_of(build_plan(point), point.block_size)
        expected = true_cost(features)
        assert predict(content, features) == pytest.approx(expected, rel=0.02), point

    # The residuals keep the measured spread: 1% noise, one relative residual per sample.
    residuals = np.array(content["residuals"]["samples"])
    assert len(residuals) == len(prof.samples)
    assert 0.005 < residuals.std() < 0.02

    json_path, csv_path = write_profile(content, prof.samples, tmp_path, "standin", "toy")
    check_written(json_path, csv_path, len(grid), 3)


def check_written(json_path, csv_path, num_points, repeats):
    content = json.loads(json_path.read_text())
    assert content["schema"] == 1
    assert set(content) >= {"schema", "metadata", "features", "model", "residuals",
                            "feature_ranges", "fit"}
    assert content["features"] == list(ALL_FEATURES)   # the tile features declared
    model = content["model"]
    assert model["kind"] == "linear" and isinstance(model["intercept_s"], float)
    assert list(model["coefficients_s"]) == list(ALL_FEATURES)
    assert all(c >= 0 for c in model["coefficients_s"].values()) and model["intercept_s"] >= 0
    assert content["residuals"]["kind"] == "relative"
    assert len(content["residuals"]["samples"]) == num_points * repeats
    assert set(content["feature_ranges"]) == set(ALL_FEATURES)
    assert all(lo <= hi for lo, hi in content["feature_ranges"].values())
    assert content["fit"]["num_samples"] == num_points * repeats
    assert {"r2", "mean_abs_rel_error", "mean_abs_point_error", "noise_std",
            "by_kind"} <= set(content["fit"])
    with csv_path.open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == num_points * repeats
    assert set(rows[0]) >= {"point_id", "repeat", "duration_s", *ALL_FEATURES}
    assert len({(r["point_id"], r["repeat"]) for r in rows}) == len(rows)
    return content


def test_fit_rejects_empty_and_non_positive():
    with pytest.raises(ValueError):
        fit_profile([])
    sample = {f: 1.0 for f in STEP_FEATURES} | {"duration_s": 0.0}
    with pytest.raises(ValueError):
        fit_profile([sample])


def test_fit_recovers_a_known_linear_cost():
    """Samples whose duration is a known linear function of the features (1 % noise): the fit
    finds the intercept and every coefficient, and no cost where the true one is 0."""
    rng = np.random.default_rng(0)
    intercept = 2e-3
    # Each costed feature adds up to a few ms at the top of its range, as the intercept does.
    costs = {"num_prefill_tokens": (3e-5, 512), "num_decode_seqs": (1e-4, 32),
             "decode_context_tokens": (4e-7, 8192), "num_blocks_swapped": (8e-6, 256)}
    samples = []
    for point_id in range(300):
        features = {name: float(rng.uniform(0, costs.get(name, (0.0, 100))[1]))
                    for name in STEP_FEATURES}
        cost = intercept + sum(coef * features[name] for name, (coef, _) in costs.items())
        samples += [{**features, "point_id": point_id, "duration_s":
                     cost * (1 + 0.01 * rng.standard_normal())} for _ in range(3)]
    content = fit_profile(samples)
    assert content["features"] == list(STEP_FEATURES)
    fitted = content["model"]["coefficients_s"]
    assert content["model"]["intercept_s"] == pytest.approx(intercept, rel=0.05)
    for name, (coef, _) in costs.items():
        assert fitted[name] == pytest.approx(coef, rel=0.03), name
    for name in set(STEP_FEATURES) - set(costs):
        assert fitted[name] * 100 < 0.01 * intercept, name   # < 1 % of the step at its top


def test_quick_real_run_on_tiny_llama(tmp_path):
    assert main(["--quick", "--repeats", "2", "--device", "cpu", "--out-dir", str(tmp_path),
                 "--no-progress"]) == 0
    json_path = tmp_path / "cpu" / "tiny-llama.json"
    csv_path = tmp_path / "cpu" / "tiny-llama.samples.csv"
    num_points = len(make_grid((16, 32), quick=True))
    content = check_written(json_path, csv_path, num_points, 2)
    meta = content["metadata"]
    assert meta["model"] == "tiny-llama" and meta["model_config"]["num_layers"] == 4
    assert meta["torch_version"] == torch.__version__
    assert meta["block_sizes"] == [16, 32] and meta["repeats"] == 2 and meta["threads"] == 1
    assert {"device", "transformers_version", "date", "git_commit"} <= set(meta)
    # tiny-llama in fp32: 2 (K, V) x 2 KV heads x 64 dims x 4 bytes per token and layer.
    assert meta["attention_tiling"]["kv_bytes_per_token"] == 2 * 2 * 64 * 4
    # A real run's accuracy depends on the machine's load: the fit's statistics and residuals
    # are checked against the samples it wrote.
    samples = read_samples(csv_path)
    model = content["model"]
    measured = np.array([sample["duration_s"] for sample in samples])
    predicted = np.array([model["intercept_s"] + sum(
        model["coefficients_s"][name] * sample[name] for name in content["features"])
        for sample in samples])
    assert (predicted > 0).all()
    assert content["fit"]["r2"] == pytest.approx(
        1 - ((measured - predicted) ** 2).sum() / ((measured - measured.mean()) ** 2).sum())
    assert content["fit"]["mean_abs_rel_error"] == pytest.approx(
        np.abs(measured / predicted - 1).mean())
    medians = {point: np.median([s["duration_s"] for s in samples if s["point_id"] == point])
               for point in {s["point_id"] for s in samples}}
    assert content["residuals"]["samples"] == pytest.approx(
        [s["duration_s"] / medians[s["point_id"]] - 1 for s in samples])


def test_tile_features_count_the_tiles_the_torch_kernel_runs(monkeypatch):
    """tile_features' tile count and padded K/V tokens are those of kernels.torch_paged's
    plan."""
    from kernels import torch_paged

    kv_bytes_per_token = 2 * 2 * 8 * 4  # 2 KV heads of 8 dims, fp32
    tile_bytes = 300 * kv_bytes_per_token  # tiles of ~300 tokens: several per step
    monkeypatch.setattr(torch_paged, "TILE_BYTES", tile_bytes)
    for point in (GridPoint(0, "decode_mixed_ctx", 16, decodes=(5, 300, 17, 64, 129, 33, 250)),
                  GridPoint(1, "mixed", 8, decodes=(40, 90, 12), prefills=((30, 0), (7, 50))),
                  GridPoint(2, "spec_mixed", 16, decodes=(60, 70), prefills=((40, 0),),
                            spec_len=3)):
        plan = build_plan(point)
        block_size = point.block_size
        features = dict(zip(TILE_FEATURES, tile_features(
            plan, AttentionTiling.of(block_size, kv_bytes_per_token, tile_bytes))))
        seq_lens, query_lens = attention_lengths(plan)   # a speculating decode's drafts too
        max_blocks = max(-(-n // block_size) for n in seq_lens)
        tables = torch.tensor([plan.block_tables[s.seq_id][:max_blocks]
                               + [0] * (max_blocks - len(plan.block_tables[s.seq_id][:max_blocks]))
                               for s in plan.seqs], dtype=torch.int32)
        starts = np.concatenate([[0], np.cumsum(query_lens)])
        kv_cache = torch.zeros(2, max(map(max, plan.block_tables.values())) + 1, block_size, 2, 8)
        tiles = torch_paged.plan_attention(tables, torch.tensor(seq_lens, dtype=torch.int32),
                                         torch.tensor(starts, dtype=torch.int32), kv_cache)
        assert len(tiles) > 1
        # Queries pad only to their own class's longest: drafts verified apart from prompts.
        assert all(len({query_class(query_lens[b]) for b in t.seq_ids.tolist()}) == 1
                   for t in tiles)
        assert features["num_attention_tiles"] == len(tiles)
        assert features["padded_kv_tokens"] == sum(t.num_seqs * t.context for t in tiles)
        assert features["padded_attention_scores"] == sum(
            t.num_seqs * t.max_query_len * t.context for t in tiles)


def test_speculating_points_verify_k_drafts_on_a_real_drafter(tmp_path):
    """With a drafter the grid adds decodes that verify k drafts: the plan carries k per decode
    with the lookahead slots allocated, and the engine proposes and verifies all k (prompt lookup
    finds them in the points' repeating sequences)."""
    grid = make_grid((16,), quick=True, speculative_ks=(2, 5))
    speculating = [point for point in grid if point.spec_len]
    assert {point.spec_len for point in speculating} == {2, 5}
    assert not any(point.spec_len for point in make_grid((16,), quick=True))
    # The executors with and without a drafter, profiled together: one file each.
    assert main(["--quick", "--repeats", "1", "--device", "cpu", "--out-dir", str(tmp_path),
                 "--no-progress", "--block-sizes", "16", "--speculative-models", "none",
                 "ngram", "--speculative-ks", "2", "5"]) == 0
    content = json.loads((tmp_path / "cpu" / "tiny-llama+ngram.json").read_text())
    assert content["metadata"]["speculative_model"] == "ngram"
    assert content["metadata"]["speculative_ks"] == [2, 5]
    assert content["metadata"]["model"] == "tiny-llama"
    assert content["metadata"]["profiled_with"] == ["tiny-llama", "tiny-llama+ngram"]
    assert content["fit"]["by_kind"]["spec_decode"]["num_points"] == len(speculating)
    assert any(point.num_lagging for point in speculating)
    plain = json.loads((tmp_path / "cpu" / "tiny-llama.json").read_text())
    assert plain["metadata"]["speculative_model"] is None
    assert "spec_decode" not in plain["fit"]["by_kind"]
    assert plain["metadata"]["num_points"] == len(grid) - len(speculating)

    from engine.drafters import ngram_lookup
    from engine.model_loader import load_model
    from calibration.profiler.cli import executor_factory
    device = torch.device("cpu")
    factory = executor_factory(load_model("tiny-llama", device), device,
                               speculative_model="ngram", max_num_speculative_tokens=5)
    for point in speculating:
        plan = build_plan(point)
        assert plan.spec_lens == {seq.seq_id: point.spec_len for seq in plan.seqs
                                  if seq.num_output_tokens}
        assert plan.num_draft_tokens == point.spec_len * len(point.decodes)
        features = dict(zip(STEP_FEATURES, step_features(plan)))
        assert features["draft_context_work"] == point.spec_len * sum(point.decodes)
        assert features["speculating"] == 1 and features["draft_model_steps"] == point.spec_len - 1
        assert features["batched"] == (len(plan.seqs) > 1)
        assert features["draft_catch_up_tokens"] == point.num_lagging
        for seq in plan.seqs:  # slots for the token and its drafts
            needed = seq.num_computed_tokens + 1 + point.spec_len
            assert len(plan.block_tables[seq.seq_id]) * point.block_size >= needed
            if seq.seq_id in plan.spec_lens:   # prompt lookup proposes all k
                proposal = ngram_lookup(np.asarray(seq.token_ids()), point.spec_len, 1, 3)
                assert len(proposal) == point.spec_len
        executor = factory(point.block_size, point.num_blocks_needed(), 0)
        result = executor.execute(plan)
        assert executor.acceptance_stats.position_trials[0] == len(point.decodes)
        assert set(result.num_accepted) == set(plan.spec_lens)


def test_token_tree_drafters_are_profiled_on_whole_trees(tmp_path):
    """Medusa and lookahead executors: their speculating points verify whole trees (spec_len =
    the tree's tokens: Medusa's default tree at each depth, lookahead in units of N - 1), and the
    engine runs them as trees (Medusa's heads once they saw a step's hidden state)."""
    from engine.model_loader import load_model
    from calibration.profiler.cli import executor_factory, tree_setup

    medusa, medusa_sizes = tree_setup("medusa", [1, 2, 4])
    assert medusa_sizes == [3, 9, 33] and medusa.max_depth == 4
    lookahead, lookahead_sizes = tree_setup("lookahead", [1, 2, 4, 8])   # 8 x 8 tokens: too many
    assert lookahead.max_depth == 4 and lookahead_sizes == [4, 8, 16, 32]
    with pytest.raises(ValueError, match="method must be"):
        tree_setup("ngram", [2])
    assert main(["--quick", "--repeats", "1", "--device", "cpu", "--out-dir", str(tmp_path),
                 "--no-progress", "--block-sizes", "16", "--speculative-models", "none",
                 "medusa", "lookahead", "--speculative-ks", "2", "--speed-probe-interval",
                 "0"]) == 0
    for name, sizes in (("medusa", [9]), ("lookahead", [2, 4, 8, 16])):
        content = json.loads((tmp_path / "cpu" / f"tiny-llama+{name}.json").read_text())
        assert content["metadata"]["speculative_model"] == name
        assert content["metadata"]["spec_lens"] == sizes
        assert content["fit"]["by_kind"]["spec_decode"]["num_points"] > 0
        samples = read_samples(tmp_path / "cpu" / f"tiny-llama+{name}.samples.csv")
        assert not any(sample["draft_catch_up_tokens"] for sample in samples)   # never lags

    device = torch.device("cpu")
    factory = executor_factory(load_model("tiny-llama", device), device,
                               max_num_speculative_tokens=9, tree=tree_setup("medusa", [2])[0])
    point = GridPoint(0, "spec_decode", 16, decodes=(64,) * 3, spec_len=9)
    plan = build_plan(point)
    features = dict(zip(STEP_FEATURES, step_features(plan)))
    assert features["num_draft_tokens"] == 27 and features["speculating"] == 1
    executor = factory(point.block_size, point.num_blocks_needed(), 0)
    speculating = executor._speculating(plan)
    assert not any(len(tree) for tree in executor.drafter.step(plan, speculating).trees)
    executor.execute(plan)              # no hidden state yet: empty trees
    # The heads read the first step's hidden states: whole 9-node trees.
    assert [len(tree) for tree in executor.drafter.step(plan, speculating).trees] == [9] * 3
    result = executor.execute(plan)
    assert executor.acceptance_stats.position_trials[0] == 6   # an empty tree: depth 1 rejected
    assert set(result.num_accepted) == set(plan.spec_lens)
