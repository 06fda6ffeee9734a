"""Repeated steps: the simulator runs a decode batch that the scheduler would plan again
unchanged as one event, and a run comes out exactly as if every step had run on its own (every
summary value, step row and inter-token latency), with the step noise off and on."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from factories import assert_same_run, make_cfg, run_both_ways
from sim.cost.profiled.tile_features import TILE_FEATURES
from runtime.policy_config import config_names
from sim.core.experiment import run_experiment
from sim.core.replica import SimEnvironment

REPO = Path(__file__).resolve().parents[1]


def drawn_workload(rng: random.Random, seed: int, num_requests: tuple[int, int],
                   rates: list[float], output_means: list[int]) -> tuple[list[str], int]:
    """What every random experiment here draws (size, load, lengths, block size, replicas,
    preemption), and its block size."""
    block_size = rng.choice([1, 8, 16])
    return [
        f"seed={seed}", f"workload.num_requests={rng.randint(*num_requests)}",
        f"workload.rate={rng.choice(rates)}",
        f"++workload.prompt_len={{dist: uniform, low: 8, high: {rng.choice([64, 600])}}}",
        f"++workload.output_len={{dist: lognormal, mean: {rng.choice(output_means)}, "
        f"sigma: 1.0}}",
        f"kv_cache.block_size={block_size}",
        f"cluster.num_replicas={rng.choice([1, 1, 2])}",
        f"preemption={rng.choice(['recompute', 'swap'])}",
    ], block_size


def random_workload(seed: int) -> list[str]:
    """A random small experiment: load, lengths, block size, pool, preemption, sampling,
    prefix caching and replicas all drawn."""
    rng = random.Random(seed)
    overrides, block_size = drawn_workload(rng, seed, (40, 160), [0.5, 2, 8, 30], [20, 150])
    if rng.random() < 0.5:
        overrides.append(f"kv_cache.num_blocks={rng.choice([300, 1200])}")
    if rng.random() < 0.3:
        overrides.append("++workload.n=3")
    # (With prefix caching a decode that needs a new block ends the repeats: at size 1, always.)
    if rng.random() < 0.3 and block_size > 1:
        overrides += ["kv_cache.enable_prefix_caching=true", "workload.with_token_ids=true",
                      "workload.shared_prefix_len=32"]
    return overrides


def light_workload(seed: int) -> list[str]:
    """A random small experiment light enough that the queue often empties: repeated steps then
    run on past finishes. KV manager, pool, block size, preemption, sampling and replicas drawn."""
    rng = random.Random(seed)
    overrides, block_size = drawn_workload(rng, seed, (40, 120), [0.5, 1, 3], [30, 150])
    if rng.random() < 0.3:
        overrides.append("kv_cache=contiguous")
    elif rng.random() < 0.5:   # tight: the rest's growth past a finish must fit what is free
        overrides.append(f"kv_cache.num_blocks={rng.choice([60, 200]) * 16 // block_size}")
    if rng.random() < 0.3:
        overrides.append("++workload.n=3")   # samples sharing blocks finish one by one
    return overrides


def scheduler_overrides(scheduler: str) -> list[str]:
    """The scheduler, and what it needs to be exercised: a small chunk budget, a predictor,
    priorities."""
    overrides = [f"scheduler={scheduler}"]
    if scheduler == "chunked_prefill":
        overrides.append("scheduler.max_num_batched_tokens=256")
    if scheduler == "sjf":
        overrides.append("predictor=noisy")
    if scheduler in ("priority", "mlfq"):
        overrides.append("++workload.classes=[{share: 0.3, priority: 0}, "
                         "{share: 0.7, priority: 1}]")
    return overrides


@pytest.mark.parametrize("scheduler", config_names("scheduler"))
@pytest.mark.parametrize("seed", range(4))
def test_repeated_steps_give_the_step_by_step_run(scheduler, seed, monkeypatch):
    overrides = [*scheduler_overrides(scheduler), *random_workload(seed * 7 + len(scheduler))]
    repeated, step_by_step, repeated_runs = run_both_ways(overrides, monkeypatch)
    assert_same_run(repeated, step_by_step)
    # Not vacuous: decode batches did run as one event, several steps at a time.
    assert repeated_runs and max(repeated_runs) > 1, overrides


@pytest.mark.parametrize("scheduler", config_names("scheduler"))
@pytest.mark.parametrize("seed", range(3))
def test_runs_go_on_past_finishes_as_step_by_step(scheduler, seed, monkeypatch):
    """Where sequences finish inside a run of repeated steps and nothing could change the plan
    (nothing waits, no arrival is due), the run goes on with the batch less them: they finish,
    free their blocks and leave at the step they would have step by step, and every row,
    latency and request time after comes out the same."""
    from sim.core.repeated_run import RepeatedSteps

    if scheduler == "vtc" and seed == 0:
        # Diverged at 3f905f9 (a100 default); no longer reproduces, the hazard stays: a tenant
        # that becomes active is lifted to the active counters' minimum, read mid-run before
        # the run's update charged its steps (identical with that lift turned off).
        pytest.xfail("known divergence: VTC.add_request reads counters a repeated run has not "
                     "charged yet; left for the repeated-steps issue")
    overrides = [*scheduler_overrides(scheduler), *light_workload(seed * 11 + len(scheduler))]
    if scheduler == "vtc":
        overrides.append("++workload.classes=[{share: 0.5, tenant: a}, {share: 0.5, tenant: b}]")
    continued = []
    continue_past_finishes = RepeatedSteps.continue_past_finishes

    def counting(self, plan, now):
        finished = continue_past_finishes(self, plan, now)
        if finished is not None:
            continued.append(self.num_steps_before)
        return finished

    monkeypatch.setattr(RepeatedSteps, "continue_past_finishes", counting)
    repeated, step_by_step, _ = run_both_ways(overrides, monkeypatch)
    assert_same_run(repeated, step_by_step)
    scheduler_type = type(repeated.replicas[0].scheduler)
    if scheduler_type.repeated_steps_past_finishes:   # (VTC and EDF end runs at finishes)
        assert continued, overrides   # not vacuous: runs did go on past finishes
    else:
        assert not continued


def pausing_workload(seed: int) -> list[str]:
    """A random small continuous-batching experiment whose runs are cut by arrivals and ended by
    finishes with requests waiting: load, lengths, block size, pool (tight ones refuse to resume),
    preemption and replicas drawn."""
    rng = random.Random(seed)
    overrides, block_size = drawn_workload(rng, seed, (60, 160), [1, 3, 8], [30, 150])
    overrides.append(f"kv_cache.num_blocks={rng.choice([80, 300, 1200]) * 16 // block_size}")
    return ["scheduler=continuous", *overrides]


@pytest.mark.parametrize("seed", range(8))
def test_runs_pause_over_prefill_steps_as_step_by_step(seed, monkeypatch):
    """A run of continuous batching's decodes cut by an arrival, or ended by finishes with others
    left, pauses with the pool holding its decodes' growth: the prefill steps that come first
    run, then the run goes on with their decodes joined (or completes where the scheduler would
    plan otherwise). The pool's bookkeeping holds at every pause, and every row, latency and
    request time comes out as step by step."""
    from sim.core.repeated_steps import RepeatedStepsLoop

    counts = {"held": 0, "resumed": 0, "joined": 0, "completed": 0}
    pause, resume = RepeatedStepsLoop._pause, RepeatedStepsLoop._resume

    def pausing(self, run, plan, now):
        pause(self, run, plan, now)
        self.scheduler.kv_cache.check_invariants()
        counts["held"] += run.num_held_blocks > 0

    def resuming(self, *args):
        num_joining = len(self.joining)
        result = resume(self, *args)
        counts["resumed" if result is not None else "completed"] += 1
        counts["joined"] += num_joining if result is not None else 0
        return result

    monkeypatch.setattr(RepeatedStepsLoop, "_pause", pausing)
    monkeypatch.setattr(RepeatedStepsLoop, "_resume", resuming)
    overrides = pausing_workload(seed)
    repeated, step_by_step, _ = run_both_ways(overrides, monkeypatch)
    assert_same_run(repeated, step_by_step)
    # Not vacuous: runs went on over prefill steps with their decodes, the pool holding blocks.
    assert counts["resumed"] and counts["joined"] and counts["held"], (overrides, counts)


def test_a_paused_run_the_pool_cannot_carry_completes_as_step_by_step(monkeypatch):
    """Where the pool cannot hold a paused run's next step (step by step would preempt), the run
    completes where it stopped and the scheduler plans as it would have."""
    from sim.core.repeated_steps import RepeatedStepsLoop

    completed = []
    unpause = RepeatedStepsLoop._unpause

    def completing(self):
        completed.append(self.paused.num_steps_before)
        unpause(self)

    monkeypatch.setattr(RepeatedStepsLoop, "_unpause", completing)
    overrides = pausing_workload(4)   # a tight pool: 1,280 blocks of 1 token
    repeated, step_by_step, _ = run_both_ways(overrides, monkeypatch)
    assert_same_run(repeated, step_by_step)
    assert completed, overrides


def test_the_contiguous_baseline_repeats_within_its_reservation(monkeypatch):
    repeated, step_by_step, repeated_runs = run_both_ways(
        ["kv_cache=contiguous", "workload.num_requests=100", "workload.rate=2"], monkeypatch)
    assert_same_run(repeated, step_by_step)
    assert max(repeated_runs) > 16   # past block boundaries: the reservation holds them


def test_with_step_noise_the_draws_match_step_by_step(tmp_path, monkeypatch):
    """A profiled cost model draws a residual per step; repeated steps draw them in the same
    order, and stop drawing when an arrival cuts the run short, so even noisy runs agree."""
    profile = json.loads((REPO / "profiles/cpu/tiny-llama.json").read_text())
    profile["features"] = [name for name in profile["features"] if name not in TILE_FEATURES]
    for name in TILE_FEATURES:
        profile["model"]["coefficients_s"].pop(name, None)
        profile.get("feature_ranges", {}).pop(name, None)
    profile["correction"] = None   # fitted over the tile features too
    path = tmp_path / "no-tiles.json"
    path.write_text(json.dumps(profile))
    overrides = ["model=tiny-llama", "hardware=cpu", "cost_model=profiled",
                 f"cost_model.profile={path}", "workload.num_requests=120", "workload.rate=3",
                 "++workload.prompt_len={dist: uniform, low: 8, high: 300}"]
    repeated, step_by_step, repeated_runs = run_both_ways(overrides, monkeypatch)
    assert repeated.summary["p99_itl_ms"] != repeated.summary["median_itl_ms"]   # noisy
    assert_same_run(repeated, step_by_step)
    assert max(repeated_runs) > 1


def test_a_profile_with_tile_features_runs_step_by_step(monkeypatch):
    """Tile features read each sequence's length, which repeated steps do not update."""
    _, _, repeated_runs = run_both_ways(
        ["model=tiny-llama", "hardware=cpu", "cost_model=profiled",
         f"cost_model.profile={REPO / 'profiles/cpu/tiny-llama.json'}",
         "workload.num_requests=30", "workload.rate=2"], monkeypatch)
    assert repeated_runs == []


def test_a_speculating_run_never_repeats_steps(monkeypatch):
    repeated, step_by_step, repeated_runs = run_both_ways(
        ["speculation=fixed", "workload.num_requests=60"], monkeypatch)
    assert repeated_runs == []
    assert_same_run(repeated, step_by_step)


def test_the_clock_wakes_at_the_exact_end_of_repeated_steps():
    """0.0634 + 0.3006 rounds past the end its steps' durations add up to (ties to even skip
    it), so one delay cannot land there; timeout_at does."""
    start, durations = 0.06338868311109055, [0.3006453747500217 / 3] * 3
    end = start
    for duration in durations:
        end += duration
    env = SimEnvironment()
    woke = []

    def process():
        yield env.timeout(start)
        yield env.timeout_at(end)
        woke.append(env.now)

    env.process(process())
    env.run()
    assert woke == [end]
    with pytest.raises(ValueError, match="before now"):
        env.timeout_at(end - 1)


def test_repeated_steps_run_past_arrivals_that_must_wait(monkeypatch):
    """Overloaded, the queue's head waits for memory, so a request arriving during repeated
    steps only joins the queue: the steps run on past it and its rows count it waiting."""
    from runtime.metrics import StepRecorder

    counted = []
    count_arrivals = StepRecorder.count_arrivals

    def counting(self, first_row, num_rows, arrival_times):
        counted.append(len(arrival_times))
        return count_arrivals(self, first_row, num_rows, arrival_times)

    monkeypatch.setattr(StepRecorder, "count_arrivals", counting)
    overloaded = ["workload.num_requests=300", "workload.rate=40", "kv_cache.num_blocks=400"]
    repeated = run_experiment(make_cfg(*overloaded), plots=False)
    monkeypatch.undo()
    step_by_step = run_experiment(make_cfg(*overloaded, "backend.repeated_steps=false"),
                                  plots=False)
    assert sum(counted) > 10
    assert_same_run(repeated, step_by_step)
