"""Data-parallel ranks of one expert group step in lockstep (sim/core/lockstep.py): each step
lasts as long as the slowest rank's, by hand arithmetic on a cost model written here; groups stay
aligned and lose nothing over random workloads; bad settings are one line naming the key. No
wall-clock."""
import copy
import functools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from omegaconf import OmegaConf

from policies.types import Request
from sim.core.experiment import run_experiment
from runtime.metrics import STEP_COLUMNS

from factories import make_cfg

BASE_S = 0.01
PER_PREFILL_TOKEN_S = 0.001


class PrefillTokenCostModel:
    """A step costs BASE_S plus PER_PREFILL_TOKEN_S per prompt token."""

    def __init__(self, model, hardware, tensor_parallel_size, expert_parallel_size=1):
        self.model = model

    def step_time(self, plan):
        return BASE_S + PER_PREFILL_TOKEN_S * plan.num_prefill_tokens


def moe_cfg(expert_parallel_size: int, num_replicas: int = 2, *overrides: str):
    cfg = make_cfg("model=tiny-moe", "scheduler=continuous", f"cluster.num_replicas={num_replicas}",
                   f"cluster.expert_parallel_size={expert_parallel_size}", *overrides)
    cfg.cost_model = OmegaConf.create({"_target_": "test_lockstep.PrefillTokenCostModel"})
    return cfg


def ttft(request: Request) -> float:
    return request.first_token_time - request.arrival_time


def e2e(request: Request) -> float:
    return request.finish_time - request.arrival_time


def by_id(result) -> dict[int, Request]:
    return {request.request_id: request for request in result.requests}


@pytest.mark.parametrize("expert_parallel_size", [1, 2])
def test_a_short_prompt_waits_for_its_peers_long_one(expert_parallel_size):
    """Round robin puts a 10-token prompt on rank 0 and a 500-token one on rank 1, both at 0.
    Stepping together, rank 0's prefill lasts as long as rank 1's (0.51 s); alone, 0.02 s. The
    decodes after it cost BASE_S either way, and rank 1 goes on alone once rank 0 is done."""
    requests = [Request(0, 0.0, 10, 4), Request(1, 0.0, 500, 8)]
    result = run_experiment(moe_cfg(expert_parallel_size), plots=False, requests=requests)
    served = by_id(result)
    long_prefill = BASE_S + 500 * PER_PREFILL_TOKEN_S
    short_prefill = long_prefill if expert_parallel_size == 2 else BASE_S + 10 * PER_PREFILL_TOKEN_S
    assert ttft(served[0]) == pytest.approx(short_prefill)
    assert e2e(served[0]) == pytest.approx(short_prefill + 3 * BASE_S)
    assert ttft(served[1]) == pytest.approx(long_prefill)
    assert e2e(served[1]) == pytest.approx(long_prefill + 7 * BASE_S)
    steps = result.metrics.step_array()
    replica = steps[:, STEP_COLUMNS.index("replica_id")]
    durations = steps[:, STEP_COLUMNS.index("duration")]
    # Rank 0's first row carries the group's duration: the step it waited through.
    assert durations[replica == 0][0] == pytest.approx(short_prefill)


def check_groups_aligned(result, group_size: int) -> None:
    """Within a group, every step starts when the group's previous one ended, and the ranks that
    step together record one start and one duration."""
    steps = result.metrics.step_array()
    column = {name: steps[:, STEP_COLUMNS.index(name)]
              for name in ("replica_id", "start_time", "duration")}
    groups = column["replica_id"] // group_size
    for group in np.unique(groups):
        rows = groups == group
        starts, durations = column["start_time"][rows], column["duration"][rows]
        for start in np.unique(starts):
            at = starts == start
            assert np.ptp(durations[at]) == 0.0, "ranks of one step recorded different durations"
            assert at.sum() <= group_size
        order = np.argsort(starts, kind="stable")
        first_of_step = np.r_[True, np.diff(starts[order]) > 0]
        step_starts, step_durations = starts[order][first_of_step], durations[order][first_of_step]
        assert (step_starts[1:] >= step_starts[:-1] + step_durations[:-1] - 1e-12).all(), \
            "a group began a step before its previous one ended"


@functools.lru_cache(maxsize=None)
def four_replicas_cfg(scheduler: str):
    return make_cfg("model=tiny-moe", f"scheduler={scheduler}", "cluster.num_replicas=4",
                    "cluster.expert_parallel_size=2", "cluster.router=least_outstanding",
                    "kv_cache.num_blocks=48")   # (a small pool: some runs preempt)


@settings(max_examples=12, deadline=None)
@given(specs=st.lists(st.tuples(st.floats(0.0, 2.0), st.integers(1, 300), st.integers(1, 40)),
                      min_size=1, max_size=30),
       scheduler=st.sampled_from(["continuous", "chunked_prefill"]))
def test_groups_step_together_and_lose_nothing(specs, scheduler):
    """Four replicas in two groups of two (ep 2, tp 1), each with a 48-block pool, under the
    default cost model: every request finishes once, each group's ranks stay on one clock, every
    KV block comes back."""
    requests = [Request(i, arrival, prompt, output)
                for i, (arrival, prompt, output) in enumerate(sorted(specs))]
    result = run_experiment(copy.deepcopy(four_replicas_cfg(scheduler)), plots=False,
                            requests=requests)
    assert sorted(r.request_id for r in result.requests if r.is_finished) == list(range(len(specs)))
    assert result.summary["completed"] == len(specs)
    check_groups_aligned(result, 2)
    for replica in result.replicas:
        kv_cache = replica.scheduler.kv_cache
        assert kv_cache.num_used_blocks() == 0
        assert kv_cache.num_free_blocks() == kv_cache.num_blocks


def test_replicas_must_fill_whole_groups():
    with pytest.raises(ValueError, match=r"cluster.num_replicas=3 must be a multiple of 2"):
        run_experiment(moe_cfg(2, 3), plots=False)


def test_lockstep_groups_refuse_disaggregated_pools():
    cfg = make_cfg("model=tiny-moe", "cluster=disaggregated", "cluster.expert_parallel_size=2")
    with pytest.raises(ValueError, match=r"cluster.expert_parallel_size=2 spans 2 replicas"):
        run_experiment(cfg, plots=False)
