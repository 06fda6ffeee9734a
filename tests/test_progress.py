"""Time always moves, or the run stops with a reason (issue 41): a replica whose steps gain no
token and finish no request for MAX_STEPS_WITHOUT_PROGRESS steps in a row stops the run with one
line naming the scheduler and what it planned; every shipped scheduler, and a policy that thrashes
but progresses, runs to the end."""
from __future__ import annotations

import math
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from policies.batching import ChunkedPrefillScheduler
from policies.memory import PagedBlockManager
from policies.routing import RoundRobinRouter
from policies.types import Request, StepResult
from runtime import step
from sim.core.experiment import run_experiment
from runtime.metrics import MetricsCollector
from sim.core.replica import Replica, SimEnvironment, arrivals, drive_alone
from runtime.step import NoProgress

from factories import (MAX_MODEL_LEN, POLICY_STRATEGIES, build_scheduler, check_outcome,
                       make_cfg, requests_from_specs, twinserve)
from las_scheduler import LeastAttainedService

# A small bound, so a stalled run stops within a test's time; the checks do not depend on it.
BOUND = 200


class TokenlessStepsCostNothing:
    """A cost model under which a step that computes no token (one that only preempts) takes
    no time: such steps alone never move the clock. (Times in powers of two keep the clock's
    sums exact: a request is never scheduled a rounding error before it arrives.)"""

    def execute(self, plan):
        return StepResult(duration=plan.num_batched_tokens / 1024)


class NothingCostsTime:
    """A cost model under which no step takes time: the clock stands still."""

    def execute(self, plan):
        return StepResult(duration=0.0)


class PreemptEverything(ChunkedPrefillScheduler):
    """A pathological policy: every step with requests running only preempts them all (for
    recompute); a step with none running plans as its parent does."""

    def schedule(self, now):
        if not self.running:
            return super().schedule(now)
        plan = self._new_plan(now)
        for request in list(self.running):
            self._preempt(request, plan)
        return self._finish_plan(plan)


class CappedSteps:
    """The executor, failing the test past `cap` steps: a detector that misses fails, not hangs."""

    def __init__(self, executor, cap: int = 5_000):
        self.executor, self.cap, self.num_steps = executor, cap, 0

    def execute(self, plan):
        self.num_steps += 1
        assert self.num_steps <= self.cap, f"{self.cap} steps and the run goes on: a hang"
        return self.executor.execute(plan)


def run_replica(scheduler, requests, executor):
    """One replica's run of the requests on the simulator's step loop: the number of steps."""
    env = SimEnvironment()
    metrics = MetricsCollector()
    replica = Replica(env, 0, [scheduler], CappedSteps(executor), metrics)
    drive_alone(replica)
    env.process(arrivals(env, requests, RoundRobinRouter(), [replica]))
    env.run()
    return len(metrics.step_rows)


def preempt_everything(budget: int) -> PreemptEverything:
    from policies.preemption import RecomputePreemption
    return PreemptEverything(PagedBlockManager(num_blocks=64, block_size=4), RecomputePreemption(),
                             max_num_seqs=1, max_num_batched_tokens=budget,
                             max_model_len=MAX_MODEL_LEN)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(budget=st.integers(4, 40),
       lengths=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12)), min_size=1,
                        max_size=5),
       executor=st.sampled_from([TokenlessStepsCostNothing(), NothingCostsTime()]))
def test_a_policy_that_preempts_everything_completes_or_stops_with_the_reason(
        budget, lengths, executor):
    requests = [Request(i, 0.001 * i, prompt, output) for i, (prompt, output) in
                enumerate(lengths)]
    scheduler = preempt_everything(budget)
    # One request runs at a time and is recomputed from its prompt each time it is admitted: it
    # gains a token only while its prompt and outputs fit one step's budget.
    stalls = any(prompt + output - 1 > budget for prompt, output in lengths)
    with mock.patch.object(step, "MAX_STEPS_WITHOUT_PROGRESS", BOUND):
        if not stalls:
            run_replica(scheduler, requests, executor)
            check_outcome(scheduler, requests, [r.request_id for r in requests])
            assert sum(r.num_preemptions for r in requests) >= sum(o - 1 for _, o in lengths)
            return
        with pytest.raises(NoProgress) as stopped:
            run_replica(scheduler, requests, executor)
    message = str(stopped.value)
    assert f"scheduler PreemptEverything made no progress for {BOUND} steps" in message
    assert "\n" not in message
    if isinstance(executor, NothingCostsTime):
        assert "simulated time stood still" in message
    else:   # (its admitting steps compute a chunk, and take time)
        assert "simulated time moved" in message


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**POLICY_STRATEGIES)
def test_every_shipped_scheduler_runs_to_the_end_when_tokenless_steps_cost_nothing(
        scheduler_name, kv_name, preemption_name, block_size, pool_slack, num_host_blocks,
        max_num_seqs, chunk_budget, request_specs):
    num_blocks = math.ceil(MAX_MODEL_LEN / block_size) + pool_slack // block_size
    scheduler = build_scheduler(scheduler_name, kv_name, preemption_name, block_size,
                                num_blocks, num_host_blocks, max_num_seqs, chunk_budget)
    requests = requests_from_specs(request_specs)
    for request in requests:
        request.arrival_time = round(request.arrival_time * 8) / 8
    with mock.patch.object(step, "MAX_STEPS_WITHOUT_PROGRESS", BOUND):
        run_replica(scheduler, requests, TokenlessStepsCostNothing())
    check_outcome(scheduler, requests, [r.request_id for r in requests
                                        if r.rejected_reason is None])


def test_the_detector_counts_steps_without_progress_in_a_row_only():
    """A policy that thrashes but progresses (a token every other step) runs to the end, however
    many steps it preempts in, and its preemption count shows it."""
    requests = [Request(i, 0.0, 8, 40) for i in range(6)]
    scheduler = preempt_everything(budget=64)
    with mock.patch.object(step, "MAX_STEPS_WITHOUT_PROGRESS", 3):
        num_steps = run_replica(scheduler, requests, NothingCostsTime())
    check_outcome(scheduler, requests, list(range(6)))
    assert num_steps > 3 * 6 * 40 // 2
    assert sum(r.num_preemptions for r in requests) == 6 * 39


def test_the_from_scratch_las_scheduler_stops_with_the_reason_when_preempting_costs_nothing():
    """Issue 41's plug-in on a pool where requests preempt each other: with steps that only
    preempt priced at zero it either completes or stops, naming itself."""
    requests = [Request(i, 0.0, 40, 30) for i in range(12)]
    scheduler = LeastAttainedService(PagedBlockManager(num_blocks=30, block_size=16),
                                     max_num_batched_tokens=64)
    with mock.patch.object(step, "MAX_STEPS_WITHOUT_PROGRESS", BOUND):
        try:
            run_replica(scheduler, requests, NothingCostsTime())
        except NoProgress as stopped:
            assert "scheduler LeastAttainedService made no progress" in str(stopped)
        else:
            assert all(r.finish_time is not None for r in requests)
            assert scheduler.kv_cache.num_used_blocks() == 0


@pytest.mark.parametrize("cost_model", ["roofline", "gpu"])
def test_the_from_scratch_las_scheduler_completes_under_each_cost_model(cost_model):
    """Issue 41's run (two replicas, 300 blocks, 300 requests), which hung on main: it thrashes
    and completes, its preemptions counted."""
    result = run_experiment(make_cfg(
        "scheduler._target_=las_scheduler.LeastAttainedService", f"cost_model={cost_model}",
        "cluster.num_replicas=2", "kv_cache.num_blocks=300", "workload.num_requests=300"),
        plots=False)
    assert result.summary["completed"] == 300
    assert result.summary["num_preemptions"] > 1000


def test_the_command_line_prints_the_reason_in_one_line(tmp_path):
    (tmp_path / "stuck_policy.py").write_text(
        "from policies.batching import ContinuousBatchingScheduler\n"
        "class Stuck(ContinuousBatchingScheduler):\n"
        "    def schedule(self, now):   # only preempts, once anything runs\n"
        "        if not self.running:\n"
        "            return super().schedule(now)\n"
        "        plan = self._new_plan(now)\n"
        "        for request in list(self.running):\n"
        "            self._preempt(request, plan)\n"
        "        return self._finish_plan(plan)\n"
        "    def update(self, plan, result, now):   # and never lets a prompt finish\n"
        "        for seq in plan.seqs:\n"
        "            seq.num_computed_tokens = 0\n"
        "        return []\n")
    done = twinserve("scheduler._target_=stuck_policy.Stuck", "workload.num_requests=3",
                     "progress=false", f"hydra.run.dir={tmp_path / 'out'}", cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "twinserve: error: scheduler Stuck made no progress for 10000 steps"), done.stderr
