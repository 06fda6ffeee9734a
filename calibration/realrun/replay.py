"""Replay a measured run through the simulator (its own requests on the config its engine
settings and the command line give) and compare each load stage's metrics, real against
simulated. The whole run replays, queues carrying from stage to stage; configs are composed once
per set of overrides, so that a calibration loop pays Hydra's compose once."""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from functools import lru_cache

from calibration.realrun.prompt_blocks import prompt_token_ids
from calibration.realrun.run import RealRun, RealRunError
from calibration.realrun.settings import CONF_DIR, settings_overrides
from calibration.realrun.stage_metrics import Latencies, compare_stage, stage_metrics
from calibration.realrun.stages import find_stages
from sim.cost.build import cost_model_group

# Seeds the replayed prompts' random token ids (with prefix caching), with each request's index.
PROMPT_IDS_SEED = 2029


@dataclass
class ReplayOutcome:
    result: dict            # what replay() returns (validation.json's entry for the run)
    real: Latencies
    sim: Latencies
    stage_requests: list        # each stage's request indices (np.ndarray)


def replay_overrides(run: RealRun, overrides: list[str]) -> tuple[list[str], dict]:
    """(every override of the replay's config, the settings' provenance): the run's settings
    as overrides, then the command line's (which win; settings.py)."""
    from_file, provenance = settings_overrides(run.engine_settings, list(overrides), run.source)
    return ["progress=false", *from_file, *overrides], provenance


@lru_cache(maxsize=32)
def _compose(overrides: tuple[str, ...]):
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return compose("config", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as error:
        raise RealRunError(f"bad override: {error}") from None


def compose_config(overrides: list[str] | tuple[str, ...]):
    """conf/ plus `overrides`, composed once per set of overrides (a copy: the caller may change
    it); a bad override raises RealRunError."""
    return copy.deepcopy(_compose(tuple(overrides)))


def compose_replay_config(run: RealRun, overrides: list[str] = ()):
    """The simulator config the replay of `run` uses (a copy: the caller may change it)."""
    all_overrides, _ = replay_overrides(run, overrides)
    return copy.deepcopy(_compose(tuple(all_overrides)))


def replay_deadlines(run: RealRun) -> list[float | None]:
    """Each request's timeout_s as the simulator takes it (None: none)."""
    if run.timeout_s is None:
        return [None] * run.num_requests
    return [None if math.isnan(value) else value for value in run.timeout_s.tolist()]


def run_requests(run: RealRun, prompts_of_vocab: int | None = None) -> list:
    """The run's requests as fresh simulator requests, ids in arrival order. With
    `prompts_of_vocab`, token ids from the run's hash ids where it has them, else random per
    request (the prompts being unknown); either way a request preempted for recompute finds its
    own blocks in the prefix cache again, as in vLLM V1."""
    import numpy as np

    from policies.types import Request

    requests = [Request(request_id=i, arrival_time=t, prompt_len=p, output_len=o,
                        timeout_s=deadline)
                for i, (t, p, o, deadline) in enumerate(zip(
                    run.arrival_s.tolist(), run.prompt_len.tolist(), run.output_len.tolist(),
                    replay_deadlines(run)))]
    if prompts_of_vocab and run.prompt_hash_ids is not None:
        for request, token_ids in zip(requests, prompt_token_ids(run, prompts_of_vocab)):
            request.prompt_token_ids = token_ids
    elif prompts_of_vocab:
        for request in requests:
            rng = np.random.default_rng([PROMPT_IDS_SEED, request.request_id])
            request.prompt_token_ids = rng.integers(
                0, prompts_of_vocab, request.prompt_len).tolist()
    return requests


def simulate(run: RealRun, config):
    """The simulator's RunResult of the run's requests under `config` (nothing written)."""
    from omegaconf.errors import OmegaConfBaseException

    from sim.core.experiment import run_experiment

    caching = bool(config.kv_cache.get("enable_prefix_caching", False))
    vocab = int(config.model.vocab_size) if caching else None
    try:
        return run_experiment(config, requests=run_requests(run, vocab))
    except OmegaConfBaseException as error:
        raise RealRunError(f"{run.source}: bad config value: {error}") from None


def cost_models_that_ran(result) -> list:
    """The cost models the run's replicas used: the ones that ran, which are not the config's
    where the GPU model fell back to the roofline."""
    return [replica.executor.cost_model for replica in result.replicas
            if hasattr(replica.executor, "cost_model")]


def cost_model_that_ran(result) -> str:
    """The class name of the cost model the run's replicas used."""
    return ", ".join(sorted({type(model).__name__ for model in cost_models_that_ran(result)})) or "?"


def replay_details(run: RealRun, overrides: list[str] = (), config=None) -> ReplayOutcome:
    """replay() with both sides' per-request latencies (for the CDF figure)."""
    if config is None:
        all_overrides, provenance = replay_overrides(run, overrides)
        config = copy.deepcopy(_compose(tuple(all_overrides)))
    else:   # (the caller composed it: compose_replay_config, with the settings mapped there)
        all_overrides, provenance = list(overrides), {}
    start = time.perf_counter()
    result = simulate(run, config)
    wall_s = time.perf_counter() - start
    real, sim = Latencies.of_run(run), Latencies.of_requests(result.requests)
    stages, stage_requests = [], []
    for stage in find_stages(run.arrival_s, run.stage_labels):
        stage_requests.append(stage.requests)
        comparison = compare_stage(stage_metrics(real, stage.requests),
                                   stage_metrics(sim, stage.requests))
        stages.append({**stage.describe(), **comparison})
    report = {
        "name": run.name, "source": run.source, "num_requests": run.num_requests,
        "overrides": all_overrides, "settings": provenance,
        "cost_model": cost_model_that_ran(result),
        # (its conf/cost_model name: the one a terms file fitted on this replay names)
        "cost_model_group": ", ".join(sorted({cost_model_group(model)
                                              for model in cost_models_that_ran(result)})) or "?",
        "num_kv_blocks": result.num_kv_blocks,
        "sim_preemptions": result.summary.get("num_preemptions"),
        # The share of prompt tokens the prefix cache served at the requests' first admission.
        "sim_prefix_cache_hit_rate": result.summary.get("prefix_cache_hit_rate"),
        "sim_wall_time_s": wall_s, "notes": list(run.notes), "stages": stages,
    }
    return ReplayOutcome(report, real, sim, stage_requests)


def replay(run: RealRun, overrides: list[str] = (), config=None) -> dict:
    """Replay `run` through the simulator (its settings, then `overrides`; or `config`) and return
    {"stages": [{..., "real", "sim", "error_pct", "overloaded"}], "settings", ...}."""
    return replay_details(run, overrides, config).result
