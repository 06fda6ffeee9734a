"""The profiled cost model's expert feature (sim/cost/profiled/expert_features.py): the expected
distinct experts a step's tokens touch matches sampled uniform routing; a profile fitted with it
predicts a per-expert cost on step shapes it was not fitted on, which the core features alone
miss; a profile with the feature but no experts in its metadata is refused."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from calibration.profiler.fit import fit_profile
from calibration.profiler.grid import make_grid, profile
from runtime.step_shapes import GridPoint, build_plan
from sim.cost.profiled.cost_model import ProfiledCostModel, ProfileError
from sim.cost.profiled.expert_features import (EXPERT_FEATURES, ExpertRouting, expert_features,
                                          profile_routing)
from sim.cost.profiled.step_features import STEP_FEATURES, step_features
from policies.types import StepResult

from factories import TRUE_COEFS, TRUE_INTERCEPT

ROUTING = ExpertRouting(num_experts=8, num_experts_per_tok=2)
# The stand-in mixture's cost of each distinct expert a step touches (per layer, all layers).
SECONDS_PER_EXPERT = 4e-4
METADATA = {"device": "stand-in", "model_config": {"num_experts": 8, "num_experts_per_tok": 2}}


@pytest.mark.parametrize("num_tokens", [1, 2, 3, 5, 8, 16, 40])
def test_experts_touched_is_the_mean_of_sampled_uniform_routing(num_tokens):
    rng = np.random.default_rng(num_tokens)
    trials = 4000
    # Each token picks 2 distinct experts of 8 uniformly: the top 2 of 8 random scores.
    picks = np.argsort(rng.random((trials, num_tokens, 8)), axis=-1)[..., :2]
    distinct = [len(np.unique(trial)) for trial in picks]
    assert ROUTING.experts_touched(num_tokens) == pytest.approx(np.mean(distinct), rel=0.02)
    assert ROUTING.experts_touched(0) == 0.0 and ROUTING.experts_touched(1) == 2.0


def mixture_cost(plan) -> float:
    """The stand-in mixture's step: the profiler tests' stand-in cost on the core features, plus
    a cost per expert the step's tokens touch."""
    return (TRUE_INTERCEPT + sum(TRUE_COEFS.get(name, 0.0) * value for name, value in
                                 zip(STEP_FEATURES, step_features(plan)))
            + SECONDS_PER_EXPERT * ROUTING.experts_touched(plan.num_batched_tokens))


class MixtureStandIn:
    """execute(plan) -> mixture_cost(plan) with 1 % noise."""

    def __init__(self, block_size, num_blocks, num_host_blocks):
        self.rng = np.random.default_rng(block_size)

    def execute(self, plan):
        return StepResult(duration=mixture_cost(plan) * (1 + 0.01 * self.rng.standard_normal()))


def held_out_decodes() -> list[GridPoint]:
    """Small decode batches the default grid does not run (it has 1-4, 8, 16, ...)."""
    return [GridPoint(2000 + batch, "decode", 16, decodes=(200,) * batch) for batch in (5, 6, 11)]


def test_a_profile_with_the_expert_feature_predicts_the_per_expert_cost():
    prof = profile(MixtureStandIn, make_grid((16,)), repeats=2, progress=False, routing=ROUTING)
    with_experts = fit_profile(prof.samples, METADATA)
    assert with_experts["features"] == [*STEP_FEATURES, *EXPERT_FEATURES]
    assert with_experts["model"]["coefficients_s"]["experts_touched"] == pytest.approx(
        SECONDS_PER_EXPERT, rel=0.1)
    core_only = fit_profile([{k: v for k, v in sample.items() if k not in EXPERT_FEATURES}
                             for sample in prof.samples], {"device": "stand-in"})
    with_model = ProfiledCostModel(with_experts, sample_residuals=False)
    core_model = ProfiledCostModel(core_only, sample_residuals=False)
    core_errors = []
    for point in held_out_decodes():
        plan = build_plan(point)
        truth = mixture_cost(plan)
        assert with_model.predict_mean(with_model.features(plan)) == pytest.approx(truth,
                                                                                  rel=0.03)
        core_errors.append(abs(core_model.predict_mean(core_model.features(plan)) / truth - 1))
    # Without it the per-expert cost bends the line through the grid's decode batches.
    assert max(core_errors) > 0.05


def test_expert_feature_is_zero_without_routing_and_counts_every_batched_token():
    plan = build_plan(GridPoint(0, "mixed", 16, decodes=(64,) * 3, prefills=((5, 0),)))
    assert expert_features(plan, None) == (0.0,)
    assert expert_features(plan, ROUTING) == (ROUTING.experts_touched(8),)


def test_profile_routing_reads_the_model_config():
    assert profile_routing(METADATA) == ROUTING
    assert profile_routing({"model_config": {"num_experts": 0}}) is None
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        profile_routing({"model_config": {"num_experts": 8, "num_experts_per_tok": 9}})
    content = fit_profile([{**dict.fromkeys(STEP_FEATURES, 1.0), "num_decode_seqs": n,
                            "experts_touched": ROUTING.experts_touched(n), "point_id": n,
                            "duration_s": 1e-3 * (1 + n)} for n in range(1, 6)],
                          {"device": "stand-in"})
    with pytest.raises(ProfileError, match="metadata.model_config has no num_experts"):
        ProfiledCostModel(content, sample_residuals=False)


def test_quick_real_profile_of_tiny_moe_carries_the_expert_feature(tmp_path):
    """twinserve-profile --expert-feature on the mixture: its samples carry experts_touched
    (from each step's batched tokens) and its profile the feature and the experts it was
    computed with; a dense model has no experts to count."""
    from calibration.profiler.cli import main, read_samples

    assert main(["--model", "tiny-moe", "--quick", "--repeats", "1", "--device", "cpu",
                 "--block-sizes", "16", "--speed-probe-interval", "0", "--out-dir",
                 str(tmp_path), "--no-progress", "--expert-feature"]) == 0
    content = json.loads((tmp_path / "cpu" / "tiny-moe.json").read_text())
    assert content["features"][-1] == "experts_touched"
    assert profile_routing(content["metadata"]) == ROUTING
    samples = read_samples(tmp_path / "cpu" / "tiny-moe.samples.csv")
    assert len(samples) == len(make_grid((16,), quick=True))
    for sample in samples:
        tokens = sample["num_prefill_tokens"] + sample["num_decode_seqs"]
        assert sample["experts_touched"] == pytest.approx(ROUTING.experts_touched(tokens))
    model = ProfiledCostModel(str(tmp_path / "cpu" / "tiny-moe.json"), block_size=16)
    assert model.routing == ROUTING
    with pytest.raises(SystemExit):
        main(["--model", "tiny-llama", "--quick", "--expert-feature", "--out-dir",
              str(tmp_path)])


def test_refit_adds_the_expert_feature_to_a_mixtures_samples(tmp_path):
    """--refit --expert-feature: the shipped tiny-moe samples fitted with experts_touched
    computed from each sample's tokens, as the profiler would have measured them."""
    import shutil

    from calibration.profiler.cli import main, read_samples

    shipped = Path(__file__).resolve().parents[1] / "profiles" / "cpu"
    for suffix in (".json", ".samples.csv"):
        shutil.copy(shipped / f"tiny-moe{suffix}", tmp_path / f"tiny-moe{suffix}")
    assert main(["--refit", str(tmp_path / "tiny-moe.json"), "--expert-feature"]) == 0
    content = json.loads((tmp_path / "tiny-moe.json").read_text())
    assert content["features"][-1] == "experts_touched"
    assert content["feature_ranges"]["experts_touched"] == pytest.approx(
        [ROUTING.experts_touched(1), 8.0])
    samples = read_samples(tmp_path / "tiny-moe.samples.csv")
    assert max(s["num_decode_seqs"] for s in samples) == 256
    shutil.copy(shipped / "tiny-llama.json", tmp_path / "tiny-llama.json")
    shutil.copy(shipped / "tiny-llama.samples.csv", tmp_path / "tiny-llama.samples.csv")
    with pytest.raises(SystemExit):
        main(["--refit", str(tmp_path / "tiny-llama.json"), "--expert-feature"])
