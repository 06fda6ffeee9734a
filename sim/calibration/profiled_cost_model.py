"""The profiled cost model: a step's duration from a model fitted to engine measurements.

A profile (profiles/<device>/<model>.json, written by the profiler) holds a linear model of the
step duration over the features of sim/calibration/step_features.py, the relative residuals of the fit
(measured / predicted - 1) and the range of every feature it was fitted on:

    {"schema": 1, "metadata": {...}, "features": [STEP_FEATURES names],
     "model": {"kind": "linear", "intercept_s": float, "coefficients_s": {feature: float}},
     "residuals": {"kind": "relative", "samples": [float, ...]},
     "feature_ranges": {feature: [min, max]}, "fit": {...}}

A linear model cannot follow every shape (a lone decode runs cheaper kernels, a 2,048-token batch
of prompts spills the caches), so a profile may also carry a `correction` (LocalCorrection): the
measured/fitted ratio of every grid point, averaged around the step with a Gaussian kernel in
log-scaled feature space; far from every grid point it fades to 1 (the linear model alone).
A step takes `prediction × correction × (1 + r)`, r drawn from the residual samples with a seeded
generator, so the simulated tails carry the measured spread rather than the mean alone. A step whose features
fall outside the profiled ranges is extrapolated linearly (the model is linear in every feature)
and the first such step of each feature is logged as a warning.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np

from kernels.tiling import tile_tokens
from policies.types import StepPlan
from sim.core.json_files import read_json_object
from sim.calibration.step_features import STEP_FEATURES, AttentionTiling, step_features

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
# Residual draws are taken from the generator in batches: one numpy call per batch, not per step.
_DRAW_BATCH = 4096


class ProfileError(ValueError):
    """The profile file is missing or does not match what this cost model reads."""


def _number(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ProfileError(f"{where} must be a finite number, got {value!r}")
    return float(value)


def load_profile(path: str | Path) -> dict:
    """Read and check a profile; every problem is a ProfileError naming the file and the field."""
    if path is None or str(path) in ("", "???"):
        raise ProfileError("cost_model.profile is required: the path of a profile JSON "
                           "(profiles/<device>/<model>.json, from twinserve-profile)")
    path = Path(path)
    where = f"cost_model.profile={path}"
    return check_profile(read_json_object(path, where, ProfileError), where)


def check_profile(profile: dict, where: str = "profile") -> dict:
    """Check a profile's content (what the profiler's fit_profile returns); every problem is a
    ProfileError naming `where` and the field."""
    if profile.get("schema") != SCHEMA_VERSION:
        raise ProfileError(f"{where}: schema {profile.get('schema')!r} is not "
                           f"supported (this twinserve reads schema {SCHEMA_VERSION}); re-run the "
                           f"profiler")
    features = profile.get("features")
    # A profile from before some features existed (in STEP_FEATURES order, none unknown) still
    # loads: the missing ones get coefficient 0, and the log says so.
    if (not isinstance(features, list) or not features
            or list(features) != [name for name in STEP_FEATURES if name in features]):
        raise ProfileError(f"{where}: its features {features!r} differ from "
                           f"sim.calibration.step_features.STEP_FEATURES {list(STEP_FEATURES)!r}; re-run the "
                           f"profiler")
    missing = [name for name in STEP_FEATURES if name not in features]
    if missing:
        log.warning("profiled cost model: %s was fitted without the features %s; they cost 0 "
                    "(re-run the profiler to fit them)", where, missing)
    model = profile.get("model")
    if not isinstance(model, dict) or model.get("kind") != "linear":
        raise ProfileError(f"{where}: model.kind must be 'linear', got "
                           f"{(model or {}).get('kind') if isinstance(model, dict) else model!r}")
    coefficients = model.get("coefficients_s")
    if not isinstance(coefficients, dict) or set(coefficients) != set(features):
        raise ProfileError(f"{where}: model.coefficients_s must have exactly "
                           f"the keys of its features {features}")
    residuals = profile.get("residuals") or {"kind": "relative", "samples": []}
    if not isinstance(residuals, dict) or residuals.get("kind", "relative") != "relative":
        raise ProfileError(f"{where}: residuals.kind must be 'relative'")
    if not isinstance(residuals.get("samples", []), list):
        raise ProfileError(f"{where}: residuals.samples must be a list")
    ranges = profile.get("feature_ranges") or {}
    if not isinstance(ranges, dict):
        raise ProfileError(f"{where}: feature_ranges must be a mapping")
    return profile


def _in_step_features(correction: dict, features: list[str]) -> dict:
    """A correction fitted over `features` (a profile from before some STEP_FEATURES existed)
    over all of STEP_FEATURES: the missing features were 0 at every grid point."""
    if list(features) == list(STEP_FEATURES):
        return correction
    columns = [STEP_FEATURES.index(name) for name in features]
    points = np.zeros((len(correction["points"]), len(STEP_FEATURES)))
    points[:, columns] = np.asarray(correction["points"], dtype=np.float64)
    scales = np.ones(len(STEP_FEATURES))
    scales[columns] = correction["scales"]
    return {**correction, "points": points, "scales": scales}


def _attention_tiling(data: dict, block_size, where: str) -> AttentionTiling | None:
    """The tiling the profile's tile features were measured with, at this run's block size.
    None when the profile has no tile features (then they were 0 in every sample)."""
    tiling = (data.get("metadata") or {}).get("attention_tiling")
    if not tiling:
        return None
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ProfileError(f"{where}: cost_model.block_size must be the run's positive KV block "
                           f"size (the profile's tile features need it), got {block_size!r}")
    try:
        kv_bytes_per_token = int(tiling["kv_bytes_per_token"])
        tile_bytes = int(tiling["tile_bytes"])
    except (KeyError, TypeError, ValueError):
        raise ProfileError(f"{where}: metadata.attention_tiling must have integer "
                           f"kv_bytes_per_token and tile_bytes, got {tiling!r}") from None
    if kv_bytes_per_token <= 0 or tile_bytes <= 0:
        raise ProfileError(f"{where}: metadata.attention_tiling values must be positive")
    return AttentionTiling(block_size, tile_tokens(block_size, kv_bytes_per_token, tile_bytes))


class LocalCorrection:
    """The factor on the linear prediction near the profile's grid points: a kernel average of
    their measured/fitted ratios, with `prior_weight` on a ratio of 1 (so that a step far from
    every point keeps the linear prediction). Distances are in z = log(1 + x / scale) per
    feature: relative differences count, and a feature that is 0 in both counts nothing.
    Factors are cached on z rounded to a tenth of the bandwidth (a run's steps repeat their
    neighbourhoods: a decode batch's context grows a token a step), which changes a factor by
    well under 1 % and keeps the simulator's per-step cost to a dict lookup."""

    def __init__(self, points, ratios, scales, bandwidth: float, prior_weight: float):
        self.scales = np.asarray(scales, dtype=np.float64)
        self.z = self.transform(points)
        self.ratios = np.asarray(ratios, dtype=np.float64)
        self.bandwidth = float(bandwidth)
        self.prior_weight = float(prior_weight)
        if (self.z.ndim != 2 or len(self.ratios) != len(self.z) or (self.scales <= 0).any()
                or not self.bandwidth > 0 or not self.prior_weight > 0
                or not (self.ratios > 0).all()):
            raise ValueError("a local correction needs one positive ratio per point, positive "
                             "scales, bandwidth and prior weight")
        self._cells_per_unit = 10.0 / self.bandwidth
        self._inverse_scales = (1.0 / self.scales).tolist()
        self._cache: dict[tuple[int, ...], float] = {}

    def transform(self, features) -> np.ndarray:
        return log_scaled(features, self.scales)

    def weights(self, z: np.ndarray) -> np.ndarray:
        """Kernel weights of every point for each row of z (or one z)."""
        squared = ((self.z - z[..., None, :]) ** 2).sum(axis=-1)
        return np.exp(-squared / self.bandwidth ** 2)

    def factor(self, features) -> float:
        cells = self._cells_per_unit
        key = tuple(round(math.log1p(x * inverse) * cells)
                    for x, inverse in zip(features, self._inverse_scales))
        factor = self._cache.get(key)
        if factor is None:
            weights = self.weights(np.array(key, dtype=np.float64) / cells)
            factor = self._cache[key] = float((weights @ self.ratios + self.prior_weight)
                                              / (weights.sum() + self.prior_weight))
        return factor

    def to_json(self, points) -> dict:
        return {"kind": "local", "bandwidth": self.bandwidth, "prior_weight": self.prior_weight,
                "scales": self.scales.tolist(), "points": np.asarray(points).tolist(),
                "ratios": self.ratios.tolist()}

    @classmethod
    def from_json(cls, data: dict) -> "LocalCorrection":
        return cls(data["points"], data["ratios"], data["scales"], data["bandwidth"],
                   data["prior_weight"])


def log_scaled(features, scales: np.ndarray) -> np.ndarray:
    """z = log(1 + x / scale), per feature: the space the correction measures distances in."""
    return np.log1p(np.asarray(features, dtype=np.float64) / scales)


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
    """The correction whose leave-one-out error over the grid points is smallest (each point
    predicted from the others alone), or None when none beats the linear model. Returns it and
    {"linear": mean |point error|, "corrected": leave-one-out mean |point error|, ...}."""
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


class ProfiledCostModel:
    """Predicts `step_time(plan)` in seconds from a profile fitted on the engine.

    `model`, `hardware` and `tensor_parallel_size` are what the runner passes every cost model
    (and `draft_model` a speculating run); the profile already describes one model on one device
    (its draft features the drafter it was measured with), so they are accepted and not used.
    `block_size` (the run's KV block size) places the sequences in the attention tiles the
    engine would run, for the tile features. `sample_residuals=False` gives the fitted mean
    alone (deterministic). `profile` is a path, or a profile's content (the profiler's
    fit_profile), which needs no block size when only `predict_mean` is used."""

    def __init__(self, profile: str | Path | dict, seed: int = 0, sample_residuals: bool = True,
                 model=None, hardware=None, tensor_parallel_size: int = 1,
                 block_size: int | None = None, draft_model=None):
        if isinstance(profile, dict):
            data, where, self.profile_path = check_profile(profile), "profile", "a profile"
            self.tiling = (None if block_size is None
                           else _attention_tiling(data, block_size, where))
        else:
            data, where = load_profile(profile), f"cost_model.profile={profile}"
            self.profile_path = str(profile)
            self.tiling = _attention_tiling(data, block_size, where)
        self.metadata = data.get("metadata") or {}
        model_data = data["model"]
        self.intercept_s = _number(model_data.get("intercept_s", 0.0), f"{where}: model.intercept_s")
        self.coefficients_s = tuple(
            _number(model_data["coefficients_s"].get(name, 0.0),
                    f"{where}: model.coefficients_s.{name}")
            for name in STEP_FEATURES)
        samples = [_number(value, f"{where}: residuals.samples[]")
                   for value in data.get("residuals", {}).get("samples", [])]
        if any(value <= -1.0 for value in samples):
            raise ProfileError(f"{where}: relative residuals must be > -1 (a measured duration "
                               f"is positive)")
        self.residual_samples = np.asarray(samples, dtype=np.float64)
        ranges = data.get("feature_ranges") or {}
        self.feature_ranges: dict[str, tuple[float, float]] = {}
        for name, bounds in ranges.items():
            if name not in STEP_FEATURES:
                raise ProfileError(f"{where}: feature_ranges has unknown feature {name!r}")
            if not isinstance(bounds, (list, tuple)) or len(bounds) != 2:
                raise ProfileError(f"{where}: feature_ranges.{name} must be [min, max]")
            low, high = (_number(v, f"{where}: feature_ranges.{name}") for v in bounds)
            self.feature_ranges[name] = (low, high)
        self._ranges_by_index = [(i, name, *self.feature_ranges[name])
                                 for i, name in enumerate(STEP_FEATURES)
                                 if name in self.feature_ranges]
        self.correction = None
        if data.get("correction") is not None:
            try:
                self.correction = LocalCorrection.from_json(
                    _in_step_features(data["correction"], data["features"]))
            except (KeyError, TypeError, ValueError) as error:
                raise ProfileError(f"{where}: correction is malformed ({error}); re-fit the "
                                   f"profile") from None
            if self.correction.z.shape[1] != len(STEP_FEATURES):
                raise ProfileError(f"{where}: correction.points must have "
                                   f"{len(STEP_FEATURES)} features each")
        self.sample_residuals = bool(sample_residuals) and self.residual_samples.size > 0
        self.seed = seed
        self._rng = np.random.default_rng(seed)
        self._draws: list[float] = []
        self._warned: set[str] = set()

    def predict_mean(self, features) -> float:
        """The fitted prediction (seconds) for a feature vector in STEP_FEATURES order: linear,
        times the local correction where the profile has one."""
        linear = self.intercept_s + sum(c * x for c, x in zip(self.coefficients_s, features))
        return linear if self.correction is None else linear * self.correction.factor(features)

    def _check_range(self, features) -> None:
        for index, name, low, high in self._ranges_by_index:
            value = features[index]
            if (value < low or value > high) and name not in self._warned:
                self._warned.add(name)
                log.warning("profiled cost model: %s=%g is outside the profiled range [%g, %g] "
                            "of %s; extrapolating linearly (warned once per feature)",
                            name, value, low, high, self.profile_path)

    def _residual(self) -> float:
        if not self._draws:
            picks = self._rng.integers(0, self.residual_samples.size, size=_DRAW_BATCH)
            # Reversed so that pop() hands them out in the order they were drawn.
            self._draws = self.residual_samples[picks][::-1].tolist()
        return self._draws.pop()

    def step_time(self, plan: StepPlan) -> float:
        """Seconds the step takes: 0 for an empty plan, else the linear prediction times
        (1 + a drawn residual), never negative."""
        features = step_features(plan, self.tiling)
        if not any(features):
            return 0.0
        self._check_range(features)
        time = self.predict_mean(features)
        if self.sample_residuals:
            time *= 1.0 + self._residual()
        return max(time, 0.0)
