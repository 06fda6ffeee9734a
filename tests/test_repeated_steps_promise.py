"""The simulator's repeated steps are opt-in: a plug-in that does not state the promise never meets
them, each capability they ask is checked whole where it is built (one line naming what is
missing), and a subclass that overrides a hook withdraws the promise they rest on."""
from __future__ import annotations

import pytest

from factories import assert_same_run, make_cfg, run_both_ways
from policies.batching import (BaseScheduler, ContinuousBatchingScheduler,
                                PriorityScheduler)
from policies.capabilities import AdmissionCheckingKVCache, OffloadingKVCache
from policies.checks import has_capability, protocol_members
from policies.memory import PagedBlockManager
from policies.preemption import RecomputePreemption
from sim.core.executor import SimExecutor
from sim.core.experiment import run_experiment
from sim.core.repeated_run import RepeatedSteps
from sim.core.repeated_steps import (PausingKVCache, PausingScheduler, RepeatedStepsCostModel,
                                     RepeatedStepsExecutor, RepeatedStepsKVCache,
                                     RepeatedStepsLoop, RepeatedStepsScheduler)
from runtime.metrics import MetricsCollector, StepRecorder
from test_protocol_scheduler import REPO

PROTOCOLS = [RepeatedStepsKVCache, RepeatedStepsExecutor, RepeatedStepsCostModel,
             RepeatedStepsScheduler, PausingScheduler, PausingKVCache, OffloadingKVCache,
             AdmissionCheckingKVCache]


def test_a_from_scratch_scheduler_runs_without_meeting_repeats(monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("repeated steps were planned for a scheduler that never asked")

    monkeypatch.setattr(RepeatedSteps, "__init__", never)
    result = run_experiment(make_cfg(
        "scheduler._target_=test_protocol_scheduler.FCFSScheduler", "workload.num_requests=80",
        "workload.rate=2"), plots=False)
    assert result.summary["completed"] == 80 and result.summary["mean_tpot_ms"] > 0


def test_the_contract_names_no_repeats():
    """Only the cost model's docstring points at its optional capability."""
    doc = (REPO / "docs" / "architecture.md").read_text()
    block = doc[doc.index("# fcfs_scheduler.py"):]
    contract = (REPO / "policies" / "protocols.py").read_text()
    cost_model = contract.index("class CostModel(")
    types = (REPO / "policies" / "types.py").read_text()
    for text in (contract[:cost_model], contract[contract.index("def step_time(", cost_model):],
                 block[:block.index("```")], types):
        assert "repeat" not in text.lower() and "decode_run" not in text


def one_short(protocol, missing: str) -> object:
    """An object with every member of `protocol` but `missing`."""
    members = {name: (lambda self, *args: None) for name in protocol_members(protocol)
               if name != missing}
    return type("OneShort", (), members)()


@pytest.mark.parametrize("protocol", [p for p in PROTOCOLS if len(protocol_members(p)) > 1])
def test_a_capability_half_written_names_the_missing_member_in_one_line(protocol):
    for missing in protocol_members(protocol):
        with pytest.raises(ValueError) as error:
            has_capability(one_short(protocol, missing), protocol, "kv_cache")
        message = str(error.value)
        assert "\n" not in message
        assert f"lacks {missing} ({protocol.__name__}, " in message
        assert message.startswith("kv_cache: OneShort lacks")


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_capability_had_whole_or_not_at_all(protocol):
    assert not has_capability(object(), protocol, "kv_cache")
    whole = one_short(protocol, missing="")
    assert has_capability(whole, protocol, "kv_cache") and isinstance(whole, protocol)


def test_the_built_ins_have_their_capabilities():
    from policies.memory import ContiguousAllocator
    from sim.cost.roofline import RooflineCostModel

    paged = PagedBlockManager(16, 4)
    for protocol in (RepeatedStepsKVCache, PausingKVCache, OffloadingKVCache,
                     AdmissionCheckingKVCache):
        assert has_capability(paged, protocol, "kv_cache")
    contiguous = ContiguousAllocator(16, 4, max_model_len=16)
    assert has_capability(contiguous, RepeatedStepsKVCache, "kv_cache")
    assert not has_capability(contiguous, PausingKVCache, "kv_cache")
    assert not has_capability(contiguous, OffloadingKVCache, "kv_cache")
    assert has_capability(RooflineCostModel, RepeatedStepsCostModel, "cost_model")
    assert has_capability(SimExecutor(RooflineCostModel.__new__(RooflineCostModel)),
                          RepeatedStepsExecutor, "executor")
    scheduler = ContinuousBatchingScheduler(paged, RecomputePreemption(), max_model_len=64,
                                            max_num_batched_tokens=64)
    assert has_capability(scheduler, RepeatedStepsScheduler, "scheduler")
    assert has_capability(scheduler, PausingScheduler, "scheduler")
    assert not has_capability(BaseScheduler, PausingScheduler, "scheduler")


class RepeatingExecutor:
    runs_repeated_steps = True

    def repeated_step_times(self, plan, num_steps):
        raise AssertionError

    def execute(self, plan):
        raise AssertionError


class HalfRepeatingKVCache(PagedBlockManager):
    """A KV manager whose repeats lack `frees_in_any_order` (shadowed away)."""

    frees_in_any_order = property(lambda self: (_ for _ in ()).throw(AttributeError("no")))


def test_each_builder_checks_its_capability_once():
    half_kv = ContinuousBatchingScheduler(HalfRepeatingKVCache(16, 4), RecomputePreemption(),
                                          max_model_len=64, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="kv_cache: .* lacks frees_in_any_order "):
        RepeatedStepsLoop(half_kv, RepeatingExecutor(), StepRecorder(MetricsCollector()))

    class HalfCostModel:   # the flag a cost model sets, without the run's step times
        costs_repeated_steps = True

        def step_time(self, plan):
            return 0.01

    with pytest.raises(ValueError, match="cost_model: .* lacks repeated_step_times "):
        SimExecutor(HalfCostModel())

    class HalfExecutor:
        runs_repeated_steps = True

        def execute(self, plan):
            raise AssertionError

    scheduler = ContinuousBatchingScheduler(PagedBlockManager(16, 4), RecomputePreemption(),
                                            max_model_len=64, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="executor: .* lacks repeated_step_times "):
        RepeatedStepsLoop(scheduler, HalfExecutor(), StepRecorder(MetricsCollector()))


def test_a_cost_model_with_step_time_alone_runs_every_step_on_its_own():
    class StepTimeOnly:
        def step_time(self, plan):
            return 1e-3 * (1 + plan.num_batched_tokens)

    assert not SimExecutor(StepTimeOnly()).runs_repeated_steps


class ShortestPromptFirst(ContinuousBatchingScheduler):
    """README's example: it reorders the queue and says nothing about repeats."""

    def next_waiting(self, now):
        return min(self.waiting, key=lambda request: request.prompt_len)


class RestatedOrder(PriorityScheduler):
    repeated_steps_past_arrivals = True   # (wrong for priorities; only restates the flag)

    def next_waiting(self, now):
        return self.waiting[0]


def test_an_override_withdraws_the_promise_it_does_not_restate():
    assert ContinuousBatchingScheduler.repeated_steps_past_arrivals
    assert not ShortestPromptFirst.repeated_steps_past_arrivals
    assert ShortestPromptFirst.repeated_steps_past_finishes
    assert RestatedOrder.repeated_steps_past_arrivals


def test_only_continuous_batching_itself_promises_to_pause_over_prefill_steps():
    """A run pauses over prefill steps only for a class that states it: continuous batching;
    a subclass that reorders its queue, overrides a planning method or its update withdraws it
    unless it restates it."""
    from policies.batching import StaticBatchingScheduler

    class ReorderedQueue(ContinuousBatchingScheduler):
        def next_waiting(self, now):
            return self.waiting[-1]

    class OwnUpdate(ContinuousBatchingScheduler):
        def update(self, plan, result, now):
            return super().update(plan, result, now)

    class OwnAdmissions(ContinuousBatchingScheduler):
        def _admit_prefills(self, plan):
            super()._admit_prefills(plan)

    class Restated(OwnAdmissions):
        repeated_steps_pause_for_prefills = True

    assert ContinuousBatchingScheduler.repeated_steps_pause_for_prefills
    assert not BaseScheduler.repeated_steps_pause_for_prefills
    for withdrawn in (ReorderedQueue, OwnUpdate, OwnAdmissions, PriorityScheduler,
                      StaticBatchingScheduler):
        assert not withdrawn.repeated_steps_pause_for_prefills, withdrawn
    assert Restated.repeated_steps_pause_for_prefills


def test_readmes_reordering_subclass_repeats_as_step_by_step(monkeypatch):
    """Overloaded, short prompts arrive behind a blocked head: a run past arrivals would keep
    them waiting where step by step admits them."""
    overrides = ["scheduler._target_=test_repeated_steps_promise.ShortestPromptFirst",
                 "workload.num_requests=200", "workload.rate=30", "kv_cache.num_blocks=300",
                 "++workload.prompt_len={dist: uniform, low: 8, high: 600}"]
    repeated, step_by_step, repeated_runs = run_both_ways(overrides, monkeypatch)
    assert_same_run(repeated, step_by_step)
    assert max(repeated_runs) > 1


class ClockCapped(ContinuousBatchingScheduler):
    """Issue 41's plug-in: its schedule caps the batch by the clock and states no promise."""

    def schedule(self, now):
        self.max_num_seqs = 2 if int(now) % 2 else 64
        return super().schedule(now)


class PromisedPassThrough(ContinuousBatchingScheduler):
    """Overrides schedule without changing what it plans, and says so."""

    repeated_steps = True

    def schedule(self, now):
        return super().schedule(now)


class InheritsThePromise(PromisedPassThrough):
    """Overrides a hook schedule reaches; its base's promise does not cover it."""

    def _admit_prefills(self, plan):
        super()._admit_prefills(plan)


class ClockPaced(BaseScheduler):
    """A plug-in written on BaseScheduler whose schedule decides by the clock (it admits only in
    even seconds) and states no promise."""

    def schedule(self, now):
        plan = self._new_plan(now)
        budget, preempted = self._schedule_running(plan, self.max_num_batched_tokens,
                                                   chunked=False)
        if not preempted and int(now) % 2 == 0:
            self._admit_waiting(plan, budget, chunked=False)
        return self._finish_plan(plan)


CLOCK_CAPPED_LOAD = ["workload.num_requests=200", "workload.rate=10"]


def test_a_schedule_override_repeats_steps_only_where_its_class_promises():
    assert not ClockCapped.repeated_steps
    assert PromisedPassThrough.repeated_steps
    assert not InheritsThePromise.repeated_steps
    assert not ClockPaced.repeated_steps
    assert ClockCapped.repeated_steps_past_arrivals   # (untouched)
    assert ClockCapped.repeated_steps_past_finishes


def test_a_clock_capped_schedule_runs_every_step_by_default(monkeypatch):
    """With no flag, the clock rule runs at every step, as `backend.repeated_steps=false` (and the
    engine) run it."""
    repeated, step_by_step, repeated_runs = run_both_ways(
        ["scheduler._target_=test_repeated_steps_promise.ClockCapped", *CLOCK_CAPPED_LOAD],
        monkeypatch)
    assert_same_run(repeated, step_by_step)
    assert repeated_runs == []


def test_a_base_scheduler_plug_in_deciding_by_the_clock_is_exact_without_a_flag(monkeypatch):
    """Overloaded, requests wait through odd seconds: a run past arrivals would keep them waiting
    into an even second, where step by step admits them."""
    repeated, step_by_step, repeated_runs = run_both_ways(
        ["scheduler._target_=test_repeated_steps_promise.ClockPaced",
         "workload.num_requests=120", "workload.rate=20"], monkeypatch)
    assert_same_run(repeated, step_by_step)
    assert repeated_runs == []


def test_a_schedule_override_that_states_the_promise_keeps_repeated_steps(monkeypatch):
    repeated, step_by_step, repeated_runs = run_both_ways(
        ["scheduler._target_=test_repeated_steps_promise.PromisedPassThrough",
         *CLOCK_CAPPED_LOAD],
        monkeypatch)
    assert max(repeated_runs) > 1
    assert_same_run(repeated, step_by_step)


def test_every_shipped_scheduler_states_the_promise_of_its_schedule():
    """(Their runs repeat steps and match step by step: test_repeated_steps.py.)"""
    from hydra.utils import get_class
    from omegaconf import OmegaConf

    from runtime.policy_config import config_names

    for name in config_names("scheduler"):
        target = OmegaConf.load(REPO / "conf" / "scheduler" / f"{name}.yaml")["_target_"]
        assert get_class(target).repeated_steps, name
