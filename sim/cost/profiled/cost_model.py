"""The profiled cost model: a step's duration from a linear model fitted to engine measurements,
times (1 + a drawn residual), optionally with tile features, expert features and a local
correction; docs/calibration.md (The profiled cost model) describes the profile it reads."""
from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np

from policies import validators
from sim.core.repeated_steps import step_times_one_by_one
from policies.types import StepPlan
from sim.cost.profiled.expert_features import EXPERT_FEATURES, expert_features, profile_routing
from sim.cost.profiled.local_correction import LocalCorrection
from sim.cost.profiled.tile_features import TILE_FEATURES, profile_tiling, tile_features
from sim.cost.profiled.step_features import STEP_FEATURES, step_features
from sim.core.json_files import read_json_object
from runtime.specs import HardwareSpec, ModelSpec
from runtime.kv_sizing import offload_seconds_per_block
from sim.cost.terms_file import with_fitted_terms

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


def _known_features(features) -> bool:
    """Whether `features` names core features (in STEP_FEATURES order), attention-tile features
    (in TILE_FEATURES order) and expert features (EXPERT_FEATURES), each at most once."""
    if (not isinstance(features, list) or not features
            or not all(isinstance(name, str) for name in features)):
        return False
    core = [name for name in features if name in STEP_FEATURES]
    tiles = [name for name in features if name in TILE_FEATURES]
    experts = [name for name in features if name in EXPERT_FEATURES]
    return (len(core) + len(tiles) + len(experts) == len(features)
            and core == [name for name in STEP_FEATURES if name in core]
            and tiles == [name for name in TILE_FEATURES if name in tiles]
            and experts == [name for name in EXPERT_FEATURES if name in experts])


def check_profile(profile: dict, where: str = "profile") -> dict:
    """Check a profile's content (what the profiler's fit_profile returns); every problem is a
    ProfileError naming `where` and the field."""
    if profile.get("schema") != SCHEMA_VERSION:
        raise ProfileError(f"{where}: schema {profile.get('schema')!r} is not "
                           f"supported (this twinserve reads schema {SCHEMA_VERSION}); re-run the "
                           f"profiler")
    features = profile.get("features")
    if not _known_features(features):
        raise ProfileError(f"{where}: its features {features!r} are not "
                           f"sim.cost.profiled.step_features.STEP_FEATURES {list(STEP_FEATURES)!r} "
                           f"in that order, with any of the attention-tile features "
                           f"{list(TILE_FEATURES)!r} and expert features "
                           f"{list(EXPERT_FEATURES)!r} in theirs; re-run the profiler")
    # A profile from before some core features existed still loads: they cost 0.
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


class ProfiledCostModel:
    """Predicts `step_time(plan)` in seconds from a profile fitted on the engine. `profile` is a
    path or a profile's content; `block_size` places sequences in the engine's attention tiles;
    `sample_residuals=False` gives the fitted mean alone. The model and hardware arguments only
    charge the prefix cache's host tier, which no profile measures."""

    def __init__(self, profile: str | Path | dict, seed: int = 0, sample_residuals: bool = True,
                 model=None, hardware=None, tensor_parallel_size: int = 1,
                 block_size: int | None = None, draft_model=None,
                 medusa_num_heads: int | None = None, offload_bandwidth_gbps: float | None = None,
                 step_time_scale: float = 1.0, step_overhead_s: float = 0.0,
                 per_sequence_overhead_s: float = 0.0, terms_file: str | None = None):
        if isinstance(profile, dict):
            data, where, self.profile_path = check_profile(profile), "profile", "a profile"
        else:
            data, where = load_profile(profile), f"cost_model.profile={profile}"
            self.profile_path = str(profile)
        self.metadata = data.get("metadata") or {}
        fitted = list(data["features"])
        self._set_features(fitted, where, block_size, content_only=isinstance(profile, dict))
        self._set_fit(data, fitted, where)
        self.sample_residuals = bool(sample_residuals) and self.residual_samples.size > 0
        self._offload_s_per_block = None   # None: a plan that moves tier blocks is an error
        if model is not None and hardware is not None and block_size is not None:
            model = model if isinstance(model, ModelSpec) else ModelSpec.from_config(model)
            hardware = (hardware if isinstance(hardware, HardwareSpec)
                        else HardwareSpec.from_config(hardware))
            self._offload_s_per_block = offload_seconds_per_block(
                model, hardware, block_size, tensor_parallel_size, offload_bandwidth_gbps)
        self.terms_file = terms_file
        self._set_served_terms(with_fitted_terms(
            "profiled", terms_file, step_time_scale=step_time_scale,
            step_overhead_s=step_overhead_s, per_sequence_overhead_s=per_sequence_overhead_s))
        self.seed = seed
        self._rng = np.random.default_rng(seed)
        self._draws: list[float] = []
        self._warned: set[str] = set()

    def _set_features(self, fitted: list[str], where: str, block_size: int | None,
                      content_only: bool) -> None:
        """The feature vector: the profile's features in its order, then those it lacks (which
        cost 0); the tiling and routing that its tile and expert features need."""
        self.uses_tiles = any(name in TILE_FEATURES for name in fitted)
        # The tiles come from each sequence's length; the plain features from the plan's sums.
        self.costs_repeated_steps = not self.uses_tiles
        self.uses_experts = any(name in EXPERT_FEATURES for name in fitted)
        computed = (STEP_FEATURES + (TILE_FEATURES if self.uses_tiles else ())
                    + (EXPERT_FEATURES if self.uses_experts else ()))
        self.feature_names: tuple[str, ...] = tuple(fitted) + tuple(
            name for name in computed if name not in fitted)
        order = [computed.index(name) for name in self.feature_names]
        self._order = None if order == list(range(len(computed))) else order
        self._sequence_indices = (self.feature_names.index("num_prefill_seqs"),
                                  self.feature_names.index("num_decode_seqs"))
        self.tiling = self.routing = None
        try:
            if self.uses_tiles and not (content_only and block_size is None):
                self.tiling = profile_tiling(self.metadata, block_size)
            if self.uses_experts:
                self.routing = profile_routing(self.metadata)
        except ValueError as error:
            raise ProfileError(f"{where}: {error}") from None
        if self.uses_experts and self.routing is None:
            raise ProfileError(f"{where}: it was fitted with {list(EXPERT_FEATURES)} but "
                               f"metadata.model_config has no num_experts")

    def _set_fit(self, data: dict, fitted: list[str], where: str) -> None:
        """The linear model, its residuals, the profiled feature ranges and the local
        correction, checked."""
        model_data = data["model"]
        self.intercept_s = _number(model_data.get("intercept_s", 0.0),
                                   f"{where}: model.intercept_s")
        self.coefficients_s = tuple(
            _number(model_data["coefficients_s"].get(name, 0.0),
                    f"{where}: model.coefficients_s.{name}")
            for name in self.feature_names)
        samples = [_number(value, f"{where}: residuals.samples[]")
                   for value in data.get("residuals", {}).get("samples", [])]
        if any(value <= -1.0 for value in samples):
            raise ProfileError(f"{where}: relative residuals must be > -1 (a measured duration "
                               f"is positive)")
        self.residual_samples = np.asarray(samples, dtype=np.float64)
        self.feature_ranges: dict[str, tuple[float, float]] = {}
        for name, bounds in (data.get("feature_ranges") or {}).items():
            if name not in self.feature_names:
                raise ProfileError(f"{where}: feature_ranges has unknown feature {name!r}")
            if not isinstance(bounds, (list, tuple)) or len(bounds) != 2:
                raise ProfileError(f"{where}: feature_ranges.{name} must be [min, max]")
            low, high = (_number(v, f"{where}: feature_ranges.{name}") for v in bounds)
            self.feature_ranges[name] = (low, high)
        self._ranges_by_index = [(i, name, *self.feature_ranges[name])
                                 for i, name in enumerate(self.feature_names)
                                 if name in self.feature_ranges]
        self.correction = None
        if data.get("correction") is not None:
            try:
                self.correction = LocalCorrection.from_profile(data["correction"], fitted,
                                                               self.feature_names)
            except ValueError as error:
                raise ProfileError(f"{where}: correction is malformed ({error}); re-fit the "
                                   f"profile") from None

    def _set_served_terms(self, terms: dict) -> None:
        """What a served run costs beyond the profiled steps (twinserve-calibrate fits them):
        the machine's speed then relative to the profile's, a server's work per step and per
        scheduled sequence."""
        self.step_time_scale = validators.positive_number(
            "ProfiledCostModel.step_time_scale", terms["step_time_scale"])
        self.step_overhead_s = validators.non_negative_number(
            "ProfiledCostModel.step_overhead_s", terms["step_overhead_s"])
        self.per_sequence_overhead_s = validators.non_negative_number(
            "ProfiledCostModel.per_sequence_overhead_s", terms["per_sequence_overhead_s"])

    def features(self, plan: StepPlan) -> tuple[float, ...]:
        """The plan's feature vector, in `feature_names` order."""
        features = step_features(plan)
        if self.uses_tiles:
            features += tile_features(plan, self.tiling)
        if self.uses_experts:
            features += expert_features(plan, self.routing)
        if self._order is not None:
            features = tuple([features[index] for index in self._order])
        return features

    def predict_mean(self, features) -> float:
        """The fitted prediction (seconds) for a feature vector in `feature_names` order: linear,
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
        """Seconds the step takes: 0 for an empty plan, else the prediction times (1 + a drawn
        residual), never negative."""
        features = self.features(plan)
        offload_s = self._offload_s(plan) if plan.blocks_to_offload or plan.blocks_to_load else 0.0
        if not any(features):
            return offload_s
        self._check_range(features)
        time = self.predict_mean(features)
        if self.sample_residuals:
            time *= 1.0 + self._residual()
        time = max(time, 0.0) * self.step_time_scale
        if self.step_overhead_s or self.per_sequence_overhead_s:
            prefills, decodes = (features[index] for index in self._sequence_indices)
            time += self.step_overhead_s + self.per_sequence_overhead_s * (prefills + decodes)
        return time + offload_s if offload_s else time

    def repeated_step_times(self, plan: StepPlan, num_steps: int):
        """step_time of a run of repeated steps, step by step (each draws its residual);
        used only when `costs_repeated_steps`."""
        return step_times_one_by_one(self, plan, num_steps)

    def _offload_s(self, plan: StepPlan) -> float:
        """The plan's stores to and loads from the prefix cache's host tier."""
        if self._offload_s_per_block is None:
            raise ValueError("the plan moves blocks of the prefix cache's host tier, but this "
                             "profiled cost model was built without model, hardware and "
                             "block_size to cost them")
        return (len(plan.blocks_to_offload) + len(plan.blocks_to_load)) * self._offload_s_per_block
