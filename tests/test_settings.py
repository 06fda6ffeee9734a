"""A run's settings are read and checked in one pass at the edge (sim/core/settings.py): each bad
value is one line naming its config key, before anything is built, and a pool's overrides give
it settings of its own."""
from __future__ import annotations

import dataclasses

import pytest

from sim.core.cluster import build_pools
from sim.core.settings import replica_settings, run_settings

from factories import make_cfg, model_spec


@pytest.mark.parametrize("override, message", [
    ("seed=-1", r"^seed must be a non-negative integer"),
    ("sim_seed=-1", r"^sim_seed must be a non-negative integer"),
    ("cluster.num_replicas=0", r"^cluster.num_replicas must be a positive integer"),
    ("cluster.frontend_latency_s=-1", r"^cluster.frontend_latency_s must be"),
    ("slo.ttft_ms=0", r"^slo.ttft_ms must be a positive number of ms or null, got 0$"),
    ("metrics.fairness_window_s=0", r"^metrics.fairness_window_s must be"),
])
def test_a_bad_run_setting_is_one_line_naming_its_key(override, message):
    with pytest.raises(ValueError, match=message):
        run_settings(make_cfg(override))


@pytest.mark.parametrize("override, message", [
    ("kv_cache.block_size=0", r"^kv_cache.block_size must be a positive integer"),
    ("kv_cache.num_blocks=0", r"^kv_cache.num_blocks must be a positive integer"),
    ("scheduler.max_num_seqs=0", r"^scheduler.max_num_seqs must be a positive integer"),
    ("cluster.pipeline_parallel_size=0", r"^cluster.pipeline_parallel_size must be a positive"),
    ("scheduler.max_num_batched_tokens=0", r"^scheduler.max_num_batched_tokens must be a "),
    ("cluster.expert_parallel_size=2", r"^cluster.expert_parallel_size=2 needs a mixture-of-"),
    ("kv_cache.offload_gb=-1", r"^kv_cache.offload_gb must be"),
    ("backend.repeated_steps=maybe", r"^backend.repeated_steps must be"),
])
def test_a_bad_replica_setting_is_one_line_naming_its_key(override, message):
    cfg = make_cfg(override)
    with pytest.raises(ValueError, match=message):
        replica_settings(cfg, model_spec("llama-2-7b"), run_settings(cfg))


def test_settings_are_read_once_and_pools_get_their_own():
    cfg = make_cfg("cluster=disaggregated", "+cluster.pools.1.pipeline_parallel_size=2",
                   "scheduler.max_num_batched_tokens=512", "backend.repeated_steps=false")
    run = run_settings(cfg)
    prefill, decode = build_pools(cfg, model_spec("llama-2-7b"), run)
    assert prefill.settings.pipeline_parallel_size == 1 < decode.settings.pipeline_parallel_size
    assert decode.settings.gpu_model.num_layers == 16 < prefill.settings.gpu_model.num_layers
    for pool in (prefill, decode):
        assert pool.settings.max_num_batched_tokens == 512
        assert pool.settings.repeated_steps is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.seed = 1


def test_the_speculation_setup_is_built_once_for_the_run():
    cfg = make_cfg("speculation=fixed", "speculation.draft_model=llama-68m")
    run = run_settings(cfg)
    [pool] = build_pools(cfg, model_spec("llama-2-7b"), run)
    assert run.speculation is not None and pool.settings.speculation is run.speculation
