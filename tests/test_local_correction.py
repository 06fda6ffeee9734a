"""The profile's local correction (sim/cost/profiled/local_correction.py): where the
linear model misfits a region of step shapes, the kernel average of the grid points'
measured/fitted ratios brings the prediction back, chosen by leave-one-out; far from the points
and where the linear model is already right it changes nothing. And `twinserve-profile --refit` re-fits a written profile."""
from __future__ import annotations

import json

import numpy as np
import pytest

from calibration.profiler.cli import main, refit, write_profile
from calibration.profiler.fit import fit_local_correction, fit_profile
from sim.cost.profiled.local_correction import LocalCorrection
from sim.cost.profiled.cost_model import ProfileError, ProfiledCostModel
from sim.cost.profiled.step_features import STEP_FEATURES

from factories import predict

DECODE = STEP_FEATURES.index("num_decode_seqs")
CONTEXT = STEP_FEATURES.index("decode_context_tokens")
BATCHED = STEP_FEATURES.index("batched")


def decode_points(batches, contexts) -> np.ndarray:
    points = []
    for batch in batches:
        for context in contexts:
            row = np.zeros(len(STEP_FEATURES))
            row[DECODE], row[CONTEXT], row[BATCHED] = batch, batch * context, batch > 1
            points.append(row)
    return np.array(points)


def true_duration(points: np.ndarray) -> np.ndarray:
    """Linear, but a lone decode runs 15 % cheaper than the line says."""
    linear = 2e-3 + 1e-4 * points[:, DECODE] + 1e-7 * points[:, CONTEXT]
    return linear * np.where(points[:, DECODE] == 1, 0.85, 1.0)


def test_correction_brings_back_a_region_the_linear_model_misfits():
    points = decode_points((1, 2, 4, 8, 16, 32, 64), (64, 128, 256, 512, 1024))
    measured = true_duration(points)
    linear = 2e-3 + 1e-4 * points[:, DECODE] + 1e-7 * points[:, CONTEXT]
    correction, report = fit_local_correction(points, measured, linear)
    assert correction is not None
    assert report["loo_point_error"] < report["linear_point_error"] / 2
    lone = decode_points((1,), (300,))[0]
    assert correction.factor(lone) == pytest.approx(0.85, abs=0.03)
    batch = decode_points((16,), (300,))[0]
    assert correction.factor(batch) == pytest.approx(1.0, abs=0.03)
    # Far from every grid point the prior wins: the linear model alone.
    far = decode_points((1,), (1e9,))[0]
    assert correction.factor(far) == pytest.approx(1.0, abs=1e-3)
    again = LocalCorrection.from_json(json.loads(json.dumps(correction.to_json(points))))
    assert again.factor(lone) == pytest.approx(correction.factor(lone))


def test_no_correction_where_the_linear_model_is_right():
    points = decode_points((1, 4, 16), (64, 256))
    linear = 2e-3 + 1e-4 * points[:, DECODE]
    correction, report = fit_local_correction(points, linear.copy(), linear)
    assert correction is None and report["loo_point_error"] == report["linear_point_error"] == 0


def samples_of(points: np.ndarray, repeats: int = 3) -> list[dict]:
    rng = np.random.default_rng(0)
    durations = true_duration(points)
    return [{"point_id": index, "kind": "decode", "block_size": 16, "repeat": repeat,
             **dict(zip(STEP_FEATURES, point)),
             "duration_s": float(duration * (1 + 0.002 * rng.standard_normal()))}
            for index, (point, duration) in enumerate(zip(points, durations))
            for repeat in range(repeats)]


def test_fitted_profile_and_cost_model_apply_the_correction(tmp_path):
    points = decode_points((1, 2, 4, 8, 16, 32, 64), (64, 128, 256, 512, 1024))
    content = fit_profile(samples_of(points))
    assert content["correction"] is not None
    fit = content["fit"]["correction"]
    assert fit["loo_point_error"] < fit["linear_point_error"]
    lone = decode_points((1,), (300,))[0]
    expected = true_duration(lone[None, :])[0]
    assert predict(content, lone) == pytest.approx(expected, rel=0.03)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(content))
    model = ProfiledCostModel(str(path), sample_residuals=False)
    assert model.predict_mean(lone) == pytest.approx(predict(content, lone), rel=1e-12)

    content["correction"]["ratios"] = content["correction"]["ratios"][:-1]
    path.write_text(json.dumps(content))
    with pytest.raises(ProfileError, match="correction"):
        ProfiledCostModel(str(path))


def test_refit_rewrites_the_fit_from_the_samples_keeping_metadata(tmp_path):
    points = decode_points((1, 4, 16, 64), (64, 512))
    samples = samples_of(points)
    content = fit_profile(samples, {"device": "stand-in"})
    content["speed_reference"] = {"duration_s": 0.004}
    content["model"]["intercept_s"] = 1.0                # a stale fit
    json_path, _ = write_profile(content, samples, tmp_path, "cpu", "toy")
    refitted = refit(json_path)
    assert refitted["model"]["intercept_s"] < 0.01
    assert refitted["metadata"]["device"] == "stand-in" and "refitted" in refitted["metadata"]
    assert refitted["speed_reference"] == {"duration_s": 0.004}
    assert json.loads(json_path.read_text())["model"] == refitted["model"]


def test_refit_of_a_missing_or_unreadable_profile_is_a_clear_error(tmp_path, capsys):
    not_json = tmp_path / "p.json"
    not_json.write_text("not json")
    for path in (tmp_path / "missing.json", not_json):
        with pytest.raises(SystemExit) as exit_info:
            main(["--refit", str(path)])
        assert exit_info.value.code == 2
        assert f"--refit {path}: cannot re-fit it" in capsys.readouterr().err
