"""The written contract checked where things are built: a cost model written from scratch against
`CostModel` runs a simulation; every policy missing a member of its protocol fails at build time
in one line naming it; a run whose scheduler never stamps a first token, or ignores a configured
prefix cache or swap pool, says so in one line; the drafter table is what both backends read."""
from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from factories import make_cfg
from policies.batching import ContinuousBatchingScheduler
from policies.memory import PagedBlockManager
from policies.preemption import RecomputePreemption
from policies.checks import check_policy, missing_members
from policies.protocols import CostModel, KVCacheManager, PreemptionPolicy, Scheduler
from policies.speculation import drafters
from policies.speculation.drafters import DRAFTER_KINDS, TREE_DRAFTERS, Drafter, drafter_kind
from sim.core.experiment import run_experiment
from runtime.metrics import STEP_COLUMNS
from test_protocol_scheduler import FCFSScheduler

torch.set_num_threads(1)
STEP_S = 0.004


# ---- a cost model from scratch ------------------------------------------------------------------

class FlatCostModel:
    """Every step takes STEP_S, plus 1 µs per prefill token: written from the protocol alone."""

    def __init__(self, model, hardware, tensor_parallel_size):
        self.model = model

    def step_time(self, plan):
        return STEP_S + 1e-6 * plan.num_prefill_tokens


class StatedErrorCostModel(FlatCostModel):
    expected_error_pct = {"ttft": 20.0, "tpot": 7.5, "e2e": 9.0, "checks": 12, "basis": "test"}


def with_cost_model(target: str, *overrides: str):
    """The run's config with cost_model the class `target` alone (no group keys)."""
    cfg = make_cfg(*overrides)
    cfg.cost_model = OmegaConf.create({"_target_": target})
    return cfg


def test_a_cost_model_from_scratch_runs_a_simulation():
    assert isinstance(FlatCostModel(None, None, 1), CostModel)
    result = run_experiment(with_cost_model("test_contract.FlatCostModel",
                                            "workload.num_requests=30"), plots=False)
    assert result.summary["completed"] == 30
    steps = result.metrics.step_array()
    duration = steps[:, STEP_COLUMNS.index("duration")]
    prefill = steps[:, STEP_COLUMNS.index("num_prefill_tokens")]
    np.testing.assert_allclose(duration, STEP_S + 1e-6 * prefill)   # its times, step by step
    assert "expected_tpot_error_pct" not in result.summary
    stated = run_experiment(with_cost_model("test_contract.StatedErrorCostModel",
                                            "workload.num_requests=5"), plots=False)
    assert stated.summary["expected_tpot_error_pct"] == 7.5
    assert stated.summary["expected_ttft_error_pct"] == 20.0
    assert stated.summary["expected_error_basis"] == "12 leave-out checks: test"


# ---- build-time checks: one line naming the member --------------------------------------------

class NoQueueLengths(FCFSScheduler):
    queue_lengths = None   # not callable: as if it were missing


class NoStepTime:
    def __init__(self, model, hardware, tensor_parallel_size):
        pass

    def step_time_s(self, plan):   # misnamed
        return STEP_S


class NoFork(PagedBlockManager):
    fork = 3


class NoVictim:
    def __init__(self, swap_space_gb: float = 0.0):
        self.swap_space_gb = swap_space_gb

    def mode(self, request, kv_cache):
        return "recompute"


@pytest.mark.parametrize("overrides, message", [
    (["scheduler._target_=test_contract.NoQueueLengths"],
     "scheduler: NoQueueLengths lacks queue_lengths (Scheduler, policies/protocols.py)"),
    (["kv_cache._target_=test_contract.NoFork"],
     "kv_cache: NoFork lacks fork (KVCacheManager, policies/protocols.py)"),
    (["preemption._target_=test_contract.NoVictim"],
     "preemption: NoVictim lacks select_victim (PreemptionPolicy, policies/protocols.py)"),
])
def test_a_policy_missing_a_member_fails_at_build_in_one_line(overrides, message):
    with pytest.raises(ValueError) as error:
        run_experiment(make_cfg(*overrides, "workload.num_requests=4"), plots=False)
    assert str(error.value) == message


def test_a_cost_model_missing_step_time_fails_at_build_in_one_line():
    with pytest.raises(ValueError) as error:
        run_experiment(with_cost_model("test_contract.NoStepTime", "workload.num_requests=4"),
                       plots=False)
    assert str(error.value) == ("cost_model: NoStepTime lacks step_time (CostModel, "
                                "policies/protocols.py)")


def test_missing_members_reads_annotations_methods_and_properties():
    kv_cache = PagedBlockManager(8, 4)
    scheduler = ContinuousBatchingScheduler(kv_cache, RecomputePreemption(), max_num_seqs=4,
                                            max_model_len=64)
    assert missing_members(scheduler, Scheduler) == []
    assert missing_members(kv_cache, KVCacheManager) == []
    assert missing_members(RecomputePreemption(), PreemptionPolicy) == []

    class Bare:
        kv_cache = None   # an attribute, and a property below: both count as present

        @property
        def num_outstanding(self):
            raise AssertionError("a check must not run a property")

    assert missing_members(Bare(), Scheduler) == ["speculation", "add_request", "schedule",
                                                  "update", "has_unfinished", "queue_lengths"]
    with pytest.raises(ValueError) as error:
        check_policy(Bare(), Drafter, "speculative_model")
    assert str(error.value) == ("speculative_model: Bare lacks kind, step, observe_hidden, "
                                "observe_verification (Drafter, policies/speculation/drafters.py)")


def test_a_check_never_reads_the_instance_dict():
    """Reading an object's __dict__ turns off CPython's specialised attribute access on it for
    the rest of the run (the steps ran 7 % slower); the checks run on every scheduler and KV
    manager the simulator builds. gc shows a materialised dict among an object's referents."""
    def dict_materialised(obj):
        # A materialised __dict__ is one referent holding the attributes; otherwise gc sees
        # each attribute's value directly.
        return any(isinstance(r, dict) and "kv_cache" in r for r in gc.get_referents(obj))

    kv_cache = PagedBlockManager(8, 4)
    scheduler = ContinuousBatchingScheduler(kv_cache, RecomputePreemption(), max_num_seqs=4,
                                            max_model_len=64)
    assert not dict_materialised(scheduler)
    check_policy(kv_cache, KVCacheManager, "kv_cache")
    check_policy(scheduler, Scheduler, "scheduler")
    assert not dict_materialised(scheduler)
    vars(scheduler)
    assert dict_materialised(scheduler)   # the probe sees it when it happens


def test_the_engine_checks_a_scheduler_object_and_its_drafter():
    from engine import LLM

    with pytest.raises(ValueError, match="^scheduler: NoQueueLengths lacks queue_lengths "):
        LLM("tiny-llama", scheduler=NoQueueLengths(PagedBlockManager(64, 16)))


def test_the_engine_sizes_its_host_tier_from_the_offloading_capability():
    from engine.builder import num_offload_blocks
    from policies.memory import ContiguousAllocator

    assert num_offload_blocks(PagedBlockManager(64, 16, enable_prefix_caching=True,
                                                num_offload_blocks=3)) == 3
    assert num_offload_blocks(ContiguousAllocator(64, 16, max_model_len=64)) == 0

    class TierWithoutLoads(ContiguousAllocator):   # a host tier half written
        num_offload_blocks = 2

        def take_pending_offload(self):
            return [], []

    with pytest.raises(ValueError) as error:
        num_offload_blocks(TierWithoutLoads(64, 16, max_model_len=64))
    assert str(error.value).startswith("kv_cache: TierWithoutLoads lacks num_loaded_prefix_tokens "
                                       "(OffloadingKVCache, policies/capabilities.py) but has "
                                       "num_offload_blocks, take_pending_offload")


# ---- end-of-run checks ------------------------------------------------------------------------

class NoFirstTokenScheduler(ContinuousBatchingScheduler):
    """Forgets the first token time the base class stamps."""

    def update(self, plan, result, now):
        finished = super().update(plan, result, now)
        for seq in plan.seqs:
            seq.request.first_token_time = None
        return finished


def test_a_run_without_first_tokens_says_so():
    with pytest.raises(RuntimeError, match=r"^\d+ finished requests have no first_token_time "
                       r".*NoFirstTokenScheduler.update must set request.first_token_time"):
        run_experiment(make_cfg("scheduler._target_=test_contract.NoFirstTokenScheduler",
                                "workload.num_requests=10"), plots=False)


REPEATED_PROMPTS = ["workload=conversation", "workload.num_sessions=6",
                    "kv_cache.enable_prefix_caching=true"]


def test_a_scheduler_ignoring_the_prefix_cache_is_named(capsys):
    run_experiment(make_cfg(*REPEATED_PROMPTS, "scheduler._target_=test_contract.FCFSScheduler"),
                   plots=False)
    lines = [line for line in capsys.readouterr().err.splitlines()
             if "enable_prefix_caching" in line]
    assert len(lines) == 1 and lines[0].startswith(
        "twinserve: kv_cache.enable_prefix_caching=true but no prompt token came from the prefix "
        "cache, though ") and lines[0].endswith("does FCFSScheduler call kv_cache.allocate_prefix?")
    # Prompts that share no first block: nothing to hit, nothing said.
    result = run_experiment(make_cfg(*REPEATED_PROMPTS, "workload.turns.low=1",
                                     "workload.turns.high=1",
                                     "scheduler._target_=test_contract.FCFSScheduler"),
                            plots=False)
    assert result.summary["prefix_cache_hit_rate"] == 0
    assert "enable_prefix_caching" not in capsys.readouterr().err
    result = run_experiment(make_cfg(*REPEATED_PROMPTS), plots=False)   # the built-in one hits
    assert result.summary["prefix_cache_hit_rate"] > 0
    assert "enable_prefix_caching" not in capsys.readouterr().err


SWAPPING = ["preemption=swap", "kv_cache.num_blocks=300", "workload.num_requests=200"]


def test_a_scheduler_ignoring_the_swap_pool_is_named(capsys):
    result = run_experiment(make_cfg(*SWAPPING, "scheduler._target_=test_contract.FCFSScheduler"),
                            plots=False)
    assert result.summary["num_preemptions"] > 0
    err = capsys.readouterr().err
    assert "preemptions recomputed: does FCFSScheduler ask preemption.mode" in err
    result = run_experiment(make_cfg(*SWAPPING), plots=False)   # the built-in one swaps
    assert result.summary["swap_bytes"] > 0
    assert "preemptions recomputed" not in capsys.readouterr().err


# ---- the drafter table ------------------------------------------------------------------------

def test_one_table_of_drafter_kinds():
    assert TREE_DRAFTERS == ("medusa", "lookahead")
    assert drafter_kind("llama-68m") is drafters.DRAFT_MODEL and drafter_kind("ngram").draft_cost \
        == "lookup"
    assert [name for name, kind in DRAFTER_KINDS.items() if kind.reads_hidden_states] == [
        "medusa"]
    from engine.drafters import DraftModelDrafter, NgramDrafter
    from engine.lookahead import LookaheadDrafter
    from engine.medusa import MedusaDrafter
    for drafter, kind in ((NgramDrafter, drafters.NGRAM), (DraftModelDrafter, drafters.DRAFT_MODEL),
                          (MedusaDrafter, drafters.MEDUSA), (LookaheadDrafter, drafters.LOOKAHEAD)):
        assert drafter.kind is kind and missing_members(drafter, Drafter) == []
