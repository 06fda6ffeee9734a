"""A local correction of the profile's linear fit near its grid points, where a linear model cannot
follow the kernels' shape (docs/calibration.md, The profiled cost model)."""
from __future__ import annotations

import math

import numpy as np


class LocalCorrection:
    """The factor on the linear prediction: a Gaussian-kernel average of the grid points'
    measured/fitted ratios with `prior_weight` on 1. Cached on z rounded to a tenth of the
    bandwidth, so a step's cost stays a dict lookup."""

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

    @classmethod
    def from_profile(cls, data: dict, fitted_features, features) -> "LocalCorrection":
        """A profile's `correction` (its points over `fitted_features`, the profile's features)
        over `features`, a superset in any order: a feature the fit did not have was 0 at every
        point. A malformed one is a ValueError."""
        try:
            fitted_points = np.asarray(data["points"], dtype=np.float64)
            fitted_scales = np.asarray(data["scales"], dtype=np.float64)
            if fitted_points.ndim != 2 or fitted_points.shape[1] != len(fitted_features):
                raise ValueError(f"correction.points must have {len(fitted_features)} "
                                 f"features each")
            if list(fitted_features) == list(features):
                return cls.from_json(data)
            columns = [list(features).index(name) for name in fitted_features]
            points = np.zeros((len(fitted_points), len(features)))
            points[:, columns] = fitted_points
            scales = np.ones(len(features))
            scales[columns] = fitted_scales
            return cls(points, data["ratios"], scales, data["bandwidth"], data["prior_weight"])
        except (KeyError, TypeError) as error:
            raise ValueError(f"{type(error).__name__}: {error}") from None


def log_scaled(features, scales: np.ndarray) -> np.ndarray:
    """z = log(1 + x / scale), per feature: the space the correction measures distances in."""
    return np.log1p(np.asarray(features, dtype=np.float64) / scales)
