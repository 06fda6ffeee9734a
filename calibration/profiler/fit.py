"""The profiler's fit: a non-negative linear model of step duration on the step features, the
measurement noise the cost model draws from, and the local correction chosen by leave-one-out."""
from __future__ import annotations

import numpy as np

from sim.cost.profiled.local_correction import LocalCorrection, log_scaled
from sim.cost.profiled.step_features import STEP_FEATURES
from sim.cost.profiled.expert_features import EXPERT_FEATURES
from sim.cost.profiled.tile_features import TILE_FEATURES

SCHEMA = 1


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0: Lawson & Hanson's active-set method (scipy's nnls,
    in numpy)."""
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    max_iter = max_iter or 3 * n + 30
    tol = 10 * np.finfo(float).eps * np.linalg.norm(a, 1) * max(m, n)
    w = a.T @ (b - a @ x)
    for _ in range(max_iter):
        if passive.all() or not (w[~passive] > tol).any():
            break
        candidates = np.where(~passive, w, -np.inf)
        passive[int(np.argmax(candidates))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            # Step back toward x until a passive coefficient hits zero; drop it.
            blocking = passive & (z <= 0)
            alpha = np.min(x[blocking] / (x[blocking] - z[blocking] + 1e-300))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
        w = a.T @ (b - a @ x)
    return x


def sample_features(samples: list[dict]) -> list[str]:
    """The features a profile of these samples is fitted with: STEP_FEATURES, and the
    attention-tile and expert features where every sample has them."""
    return [*STEP_FEATURES, *(name for name in TILE_FEATURES + EXPERT_FEATURES
                              if all(name in sample for sample in samples))]


def fit_profile(samples: list[dict], metadata: dict | None = None) -> dict:
    """Fit duration = intercept + Σ coef·feature (every coef ≥ 0) to each grid point's median
    duration (robust to bursts of load), weighted by 1/duration so that the fit minimises relative
    error and the small decodes are not sacrificed to the long prefills. The residuals are each
    sample over its point's median, the noise of repeats without the fit's per-shape misfit.
    Returns the profile JSON's content."""
    if not samples:
        raise ValueError("fit_profile: no samples")
    by_point: dict[object, list[int]] = {}
    for index, sample in enumerate(samples):
        by_point.setdefault(sample.get("point_id", f"sample {index}"), []).append(index)
    features = sample_features(samples)
    x_all = np.array([[float(s[f]) for f in features] for s in samples])
    y_all = np.array([float(s["duration_s"]) for s in samples])
    if (y_all <= 0).any():
        raise ValueError("fit_profile: durations must be positive")
    first = [indices[0] for indices in by_point.values()]
    x = x_all[first]
    y = np.array([np.median(y_all[indices]) for indices in by_point.values()])
    design = np.hstack([np.ones((len(y), 1)), x])
    # Column scaling for conditioning; a feature that never varies from zero is left out.
    scale = np.abs(design).max(axis=0)
    used = scale > 0
    weighted = design[:, used] / scale[used] / y[:, None]
    coef_scaled = nnls(weighted, np.ones(len(y)))
    coef = np.zeros(design.shape[1])
    coef[used] = coef_scaled / scale[used]
    point_errors = (design @ coef) / y - 1.0          # misfit per point (noise mostly removed)
    correction, correction_fit = fit_local_correction(x, y, design @ coef)
    noise = np.empty(len(samples))
    for indices, median in zip(by_point.values(), y):
        noise[indices] = y_all[indices] / median - 1.0
    predicted_all = np.hstack([np.ones((len(y_all), 1)), x_all]) @ coef
    relative = y_all / np.maximum(predicted_all, 1e-12) - 1.0
    by_kind: dict[str, list[float]] = {}
    for indices, error in zip(by_point.values(), point_errors):
        by_kind.setdefault(str(samples[indices[0]].get("kind", "all")), []).append(float(error))
    ss_res = float(((y_all - predicted_all) ** 2).sum())
    ss_tot = float(((y_all - y_all.mean()) ** 2).sum())
    return {
        "schema": SCHEMA,
        "metadata": dict(metadata or {}),
        "features": features,
        "model": {"kind": "linear", "intercept_s": float(coef[0]),
                  "coefficients_s": {f: float(c) for f, c in zip(features, coef[1:])}},
        "residuals": {"kind": "relative", "samples": [float(r) for r in noise]},
        "feature_ranges": {f: [float(x[:, i].min()), float(x[:, i].max())]
                           for i, f in enumerate(features)},
        "fit": {"r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0,
                "mean_abs_rel_error": float(np.abs(relative).mean()),
                "median_abs_rel_error": float(np.median(np.abs(relative))),
                "max_abs_rel_error": float(np.abs(relative).max()),
                "num_samples": len(y_all),
                "num_points": len(y),
                # Prediction vs each point's median: the model's misfit, noise mostly removed.
                "mean_abs_point_error": float(np.abs(point_errors).mean()),
                "max_abs_point_error": float(np.abs(point_errors).max()),
                "noise_std": float(noise.std()),
                # Per kind of grid point: a mean far from 0 is a shape the features miss.
                "by_kind": {kind: {"mean_point_error": float(np.mean(v)),
                                   "mean_abs_point_error": float(np.mean(np.abs(v))),
                                   "num_points": len(v)} for kind, v in by_kind.items()},
                # With the local correction, each point predicted from the others alone.
                "correction": correction_fit},
        "correction": None if correction is None else correction.to_json(x),
    }


def feature_scales(points: np.ndarray) -> np.ndarray:
    """Per feature, the median of its non-zero values over the points (1 where none is)."""
    scales = np.ones(points.shape[1])
    for column in range(points.shape[1]):
        nonzero = np.abs(points[:, column][points[:, column] != 0])
        if nonzero.size:
            scales[column] = float(np.median(nonzero))
    return scales


def fit_local_correction(points: np.ndarray, measured: np.ndarray, predicted: np.ndarray,
                         bandwidths=(0.1, 0.2, 0.35, 0.5, 0.75, 1.0),
                         prior_weights=(0.25, 1.0, 4.0)) -> tuple[LocalCorrection | None, dict]:
    """The correction whose leave-one-out error over the grid points is smallest, or None when
    none beats the linear model; and the errors {"linear": ..., "corrected": ..., ...}."""
    ratios = measured / predicted
    linear_error = float(np.abs(1.0 / ratios - 1.0).mean())
    scales = feature_scales(points)
    z = log_scaled(points, scales)
    squared = ((z[:, None, :] - z[None, :, :]) ** 2).sum(axis=-1)   # once, for every candidate
    best, best_error = None, linear_error
    for bandwidth in bandwidths:
        weights = np.exp(-squared / bandwidth ** 2)
        np.fill_diagonal(weights, 0.0)                  # leave each point out of its own
        for prior_weight in prior_weights:
            factors = (weights @ ratios + prior_weight) / (weights.sum(axis=1) + prior_weight)
            error = float(np.abs(predicted * factors / measured - 1.0).mean())
            if error < best_error:
                best, best_error = (bandwidth, prior_weight), error
    correction = None if best is None else LocalCorrection(points, ratios, scales, *best)
    return correction, {"linear_point_error": linear_error, "loo_point_error": best_error,
                        "bandwidth": None if best is None else best[0],
                        "prior_weight": None if best is None else best[1]}
