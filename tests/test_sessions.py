"""Closed-loop sessions and agents (sim/core/workload/sessions.py, session_source.py,
sim/core/session_arrivals.py): a session's next turn arrives a gap after its previous turn
finished during the run, with the conversation so far as its prompt; on the simulator (repeated
steps or not) and on the engine."""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from factories import assert_same_run, make_cfg, model_spec, run_both_ways
from sim.core.experiment import run_experiment
from runtime.metrics.session_kv import session_kv_summary
from sim.core.workload import build_session_source, build_workload
from sim.core.workload.distributions import parse_length_distribution
from sim.core.workload.fields import Fields, Streams
from sim.core.workload.session_source import SessionSource
from policies.types import Request

VOCAB = 32_000

SMALL_SESSIONS = ["workload=sessions", "workload.num_sessions=30", "workload.rate=2",
                  "++workload.think_time_s={dist: exponential, mean: 0.5}"]
SMALL_AGENTS = ["workload=agent", "workload.num_sessions=30", "workload.rate=2",
                "++workload.prompt_len={dist: uniform, low: 32, high: 400}"]


def sessions_workload(**overrides) -> dict:
    cfg = {"kind": "sessions", "num_sessions": 20, "rate": 2.0,
           "turns": {"dist": "uniform", "low": 1, "high": 6},
           "think_time_s": {"dist": "exponential", "mean": 1.0},
           "message_len": {"dist": "uniform", "low": 1, "high": 40},
           "output_len": {"dist": "uniform", "low": 1, "high": 30}, "max_prompt_len": None}
    cfg.update(overrides)
    return cfg


def agent_workload(**overrides) -> dict:
    cfg = {"kind": "agent", "num_sessions": 20, "rate": 2.0,
           "steps": {"dist": "uniform", "low": 1, "high": 8},
           "prompt_len": {"dist": "uniform", "low": 10, "high": 60},
           "output_len": {"dist": "uniform", "low": 1, "high": 30},
           "tool_latency_s": {"dist": "uniform", "low": 0.1, "high": 2.0},
           "tool_output_len": {"dist": "uniform", "low": 1, "high": 50},
           "max_prompt_len": None, "shared_prefix_len": 0}
    cfg.update(overrides)
    return cfg


def source_of(cfg) -> SessionSource:
    """The run's sessions as its config builds them (the same draws as the run's)."""
    return build_session_source(cfg.workload, seed=cfg.seed,
                                vocab_size=model_spec(cfg.model.name).vocab_size)


def by_session(requests) -> dict[int, list[Request]]:
    sessions: dict[int, list[Request]] = {}
    for request in requests:
        sessions.setdefault(request.session_id, []).append(request)
    return {session: sorted(turns, key=lambda r: r.turn) for session, turns in sessions.items()}


# --- the sessions' prompts ---------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), shared_prefix_len=st.integers(0, 20),
       high_turns=st.integers(1, 8))
def test_each_turn_extends_the_previous_prompt_and_answer(seed, shared_prefix_len, high_turns):
    workload = sessions_workload(shared_prefix_len=shared_prefix_len,
                                 turns={"dist": "uniform", "low": 1, "high": high_turns})
    source = build_session_source(workload, seed=seed, vocab_size=VOCAB)
    # The same sessions as the open-loop conversation kind draws from the same seed.
    conversation = build_workload({**workload, "kind": "conversation"}, seed=seed,
                                  vocab_size=VOCAB)
    assert sorted((r.session_id, r.turn, r.prompt_len, r.output_len) for r in conversation) == \
        sorted((r.session_id, r.turn, r.prompt_len, r.output_len)
               for r in source.all_requests())
    assert len(source.sessions) == 20
    prefix = source.sessions[0][0].prompt_token_ids[:shared_prefix_len]
    for session, turns in enumerate(source.sessions):
        assert [(r.session_id, r.turn) for r in turns] == [(session, k) for k in range(len(turns))]
        assert turns[0].prompt_token_ids[:shared_prefix_len] == prefix
        for turn, following in zip(turns, turns[1:]):
            # prompt(k+1) = prompt(k) + ids standing for answer k + a new message
            assert following.prompt_token_ids[:turn.prompt_len] == turn.prompt_token_ids
            assert following.prompt_len - turn.prompt_len - turn.output_len >= 1
        for request in turns:
            assert len(request.prompt_token_ids) == request.prompt_len
            assert request.request_id == -1 and math.isnan(request.arrival_time)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), shared_prefix_len=st.integers(0, 30))
def test_agents_make_their_drawn_steps_and_append_each_tool_result(seed, shared_prefix_len):
    workload = agent_workload(shared_prefix_len=shared_prefix_len)
    source = build_session_source(workload, seed=seed, vocab_size=VOCAB)
    # Drawn here from the streams the kind is documented to use: steps (turns stream), tasks
    # (prompt stream), tool results (the tool stream, one after every call).
    streams = Streams(*np.random.default_rng(seed).spawn(len(Streams._fields)))
    steps = parse_length_distribution(Fields(workload["steps"], "steps")).sample(
        20, streams.turns)
    tasks = parse_length_distribution(Fields(workload["prompt_len"], "p")).sample(
        20, streams.prompt)
    tool_lens = parse_length_distribution(Fields(workload["tool_output_len"], "t")).sample(
        int(steps.sum()), streams.tool)
    assert [len(turns) for turns in source.sessions] == steps.tolist()
    call = 0
    for session, turns in enumerate(source.sessions):
        assert turns[0].prompt_len == shared_prefix_len + tasks[session]
        for turn, following in zip(turns, turns[1:]):
            assert following.prompt_token_ids[:turn.prompt_len] == turn.prompt_token_ids
            assert following.prompt_len == turn.prompt_len + turn.output_len + tool_lens[call]
            call += 1
        call += 1   # (the last call's tool result is drawn, not used)
    assert call == steps.sum()


def test_bad_session_settings_name_their_key():
    with pytest.raises(ValueError, match=r"workload\.concurrency must be >= 1"):
        build_session_source(sessions_workload(concurrency=0), seed=0, vocab_size=VOCAB)
    with pytest.raises(ValueError, match=r"workload\.think_time_s is not a known field"):
        build_session_source(agent_workload(think_time_s={"dist": "fixed", "value": 1}),
                             seed=0, vocab_size=VOCAB)
    with pytest.raises(ValueError, match=r"workload\.kind=sessions is closed-loop"):
        build_workload(sessions_workload(), seed=0, vocab_size=VOCAB)
    with pytest.raises(ValueError, match=r"workload\.max_prompt_len=5 leaves no request"):
        build_session_source(sessions_workload(max_prompt_len=5, shared_prefix_len=4,
                                               message_len={"dist": "fixed", "value": 9}),
                             seed=0, vocab_size=VOCAB)


# --- the closed loop in a run ------------------------------------------------------------------


def check_closed_loop(run, cfg) -> None:
    """Every session's turns arrived in order, each a gap after the previous one finished (the
    gap the workload drew), none lost and none twice; request ids in arrival order."""
    source = source_of(cfg)
    requests = run.requests
    assert [r.request_id for r in requests] == list(range(len(requests)))
    arrivals = [r.arrival_time for r in requests]
    assert arrivals == sorted(arrivals)
    assert len({id(r) for r in requests}) == len(requests)
    assert len(requests) == source.num_planned_requests   # nothing rejected here
    sessions = by_session(requests)
    assert sorted(sessions) == list(range(len(source.sessions)))
    for session, turns in sessions.items():
        planned = source.sessions[session]
        assert [r.turn for r in turns] == list(range(len(planned)))
        assert [r.prompt_len for r in turns] == [r.prompt_len for r in planned]
        for turn, following in zip(turns, turns[1:]):
            assert turn.finish_time is not None and turn.rejected_reason is None
            assert following.arrival_time == turn.finish_time + source.gaps[session][turn.turn]
            assert following.first_scheduled_time >= following.arrival_time


@pytest.mark.parametrize("overrides", [
    SMALL_SESSIONS,
    [*SMALL_SESSIONS, "cluster.num_replicas=3", "cluster.router=least_outstanding"],
    [*SMALL_AGENTS, "workload.concurrency=5", "kv_cache.enable_prefix_caching=true"],
    [*SMALL_AGENTS, "cluster=disaggregated"],
], ids=["sessions", "three-replicas", "agents-concurrency", "agents-two-pools"])
def test_each_turn_arrives_its_gap_after_the_previous_finished(overrides, monkeypatch):
    ended = Counter()
    on_finished = SessionSource.on_finished

    def counting(self, request, now):
        ended[id(request)] += 1
        return on_finished(self, request, now)

    monkeypatch.setattr(SessionSource, "on_finished", counting)
    cfg = make_cfg(*overrides)
    run = run_experiment(cfg, plots=False)
    check_closed_loop(run, cfg)
    # Every request's end reached the sessions exactly once.
    assert sorted(ended.values()) == [1] * len(run.requests)
    assert set(ended) == {id(r) for r in run.requests}


def test_concurrency_keeps_that_many_sessions_going():
    cfg = make_cfg(*SMALL_SESSIONS, "workload.concurrency=4")
    run = run_experiment(cfg, plots=False)
    check_closed_loop(run, cfg)
    source = source_of(cfg)
    sessions = by_session(run.requests)
    starts = sorted((turns[0].arrival_time, s) for s, turns in sessions.items())
    assert [time for time, _ in starts[:4]] == [0.0] * 4 and starts[4][0] > 0
    # Session 4 + j starts a gap after the (j+1)-th session to end (sessions ending in one step
    # may be taken in any order).
    ended = sorted(sessions.values(), key=lambda turns: turns[-1].finish_time)
    for j, session in enumerate(range(4, len(sessions))):
        ties = [turns[-1] for turns in ended
                if turns[-1].finish_time == ended[j][-1].finish_time]
        assert sessions[session][0].arrival_time in [
            last.finish_time + source.gaps[last.session_id][last.turn] for last in ties]
    # At most 4 sessions between their first arrival and their last finish at any time.
    events = sorted([(turns[0].arrival_time, 1) for turns in sessions.values()]
                    + [(turns[-1].finish_time, -1) for turns in sessions.values()])
    assert max(np.cumsum([change for _, change in events])) == 4


def test_a_slower_policy_delays_the_later_turns():
    """Under a small KV pool (preemptions, queueing) the same sessions' follow-up turns arrive
    later than with the default pool; first turns arrive at the same drawn times. The open-loop
    conversation kind's arrivals do not move."""
    overrides = ["workload.num_sessions=40", "workload.rate=4",
                 "++workload.think_time_s={dist: exponential, mean: 0.5}"]
    runs = {}
    for kind in ("sessions", "conversation"):
        for pool in ("default", "small"):
            small = ["kv_cache.num_blocks=150"] if pool == "small" else []
            runs[kind, pool] = run_experiment(
                make_cfg(f"workload={kind}", *overrides, *small), plots=False)
    fast = by_session(runs["sessions", "default"].requests)
    slow = by_session(runs["sessions", "small"].requests)
    assert runs["sessions", "small"].summary["num_preemptions"] > 0
    assert [turns[0].arrival_time for turns in fast.values()] == \
        [turns[0].arrival_time for turns in slow.values()]
    later = [slow[s][-1].arrival_time - fast[s][-1].arrival_time
             for s in fast if len(fast[s]) > 1]
    assert np.mean(later) > 0.5 and max(later) > 2.0
    open_loop = [[r.arrival_time for r in runs["conversation", pool].requests]
                 for pool in ("default", "small")]
    assert open_loop[0] == open_loop[1]


@pytest.mark.parametrize("overrides", [
    [*SMALL_SESSIONS, "cluster.num_replicas=3", "cluster.router=least_outstanding",
     "workload.rate=1", "++workload.think_time_s={dist: exponential, mean: 0.2}"],
    [*SMALL_AGENTS, "workload.concurrency=6", "cluster.num_replicas=2",
     "kv_cache.enable_prefix_caching=true"],
    [*SMALL_SESSIONS, "scheduler=vtc", "kv_cache.num_blocks=400"],
], ids=["least-outstanding", "agents-two-replicas", "vtc-small-pool"])
def test_closed_loop_runs_come_out_as_step_by_step(overrides, monkeypatch):
    """Runs of repeated steps end where a finish could send a turn (the least gap in
    flight, and the run's first finish), so the run is the one step by step."""
    repeated, step_by_step, repeated_runs = run_both_ways(overrides, monkeypatch)
    assert_same_run(repeated, step_by_step)
    assert [r.arrival_time for r in repeated.requests] == \
        [r.arrival_time for r in step_by_step.requests]
    assert repeated_runs and max(repeated_runs) > 1   # not vacuous: steps did repeat


def test_follow_up_turns_hit_the_previous_prompt_in_the_prefix_cache():
    cfg = make_cfg(*SMALL_SESSIONS, "kv_cache.enable_prefix_caching=true")
    run = run_experiment(cfg, plots=False)
    block_size = cfg.kv_cache.block_size
    follow_ups = 0
    for turns in by_session(run.requests).values():
        assert turns[0].num_cached_tokens == 0
        for turn, following in zip(turns, turns[1:]):
            assert following.num_cached_tokens == turn.prompt_len // block_size * block_size
            follow_ups += 1
    assert follow_ups > 30
    summary = run.summary
    assert summary["mean_ttft_followup_turn_ms"] > 0 and summary["mean_ttft_first_turn_ms"] > 0


def test_a_rejected_turn_ends_its_session_and_the_next_one_starts():
    """tiny-llama takes 2,048 tokens: each session's 5th turn (a 2,400-token prompt) is
    rejected, its 6th never sent; with concurrency 2 all 5 sessions still run."""
    overrides = ["model=tiny-llama", "hardware=cpu", "workload=sessions",
                 "workload.num_sessions=5", "workload.concurrency=2",
                 "workload.max_prompt_len=null", "++workload.turns={dist: fixed, value: 6}",
                 "++workload.message_len={dist: fixed, value: 400}",
                 "++workload.output_len={dist: fixed, value: 100}",
                 "++workload.think_time_s={dist: fixed, value: 0.25}"]
    run = run_experiment(make_cfg(*overrides), plots=False)
    sessions = by_session(run.requests)
    assert sorted(sessions) == [0, 1, 2, 3, 4]
    for turns in sessions.values():
        assert [r.prompt_len for r in turns] == [400, 900, 1400, 1900, 2400]
        assert [r.rejected_reason is not None for r in turns] == [False] * 4 + [True]
    assert run.summary["rejected"] == 5 and run.summary["completed"] == 20


def test_the_session_summary_splits_first_and_follow_up_turns():
    def request(session, turn, ttft):
        r = Request(request_id=0, arrival_time=1.0, prompt_len=4, output_len=2,
                    session_id=session, turn=turn)
        r.first_token_time, r.finish_time = 1.0 + ttft, 3.0
        return r

    requests = [request(0, 0, 0.1), request(0, 1, 0.4), request(1, 0, 0.3),
                request(1, 1, 0.2), request(1, 2, 0.6)]
    summary = session_kv_summary(requests, [])
    assert (summary["num_sessions"], summary["num_followup_turns"]) == (2, 3)
    assert summary["mean_ttft_first_turn_ms"] == pytest.approx(200.0)
    assert summary["mean_ttft_followup_turn_ms"] == pytest.approx(400.0)
    assert summary["p99_ttft_followup_turn_ms"] == pytest.approx(
        np.percentile([400.0, 200.0, 600.0], 99))
    run = run_experiment(make_cfg("workload.num_requests=20"), plots=False)
    assert not any("turn" in key or key == "num_sessions" for key in run.summary)


# --- the engine -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sessions", "agent"])
def test_the_engine_runs_sessions_in_a_closed_loop(kind):
    """backend=engine on the tiny Llama: 3 sessions of 3 turns (agents: calls), each sent
    0.05 s after the previous answer; the prefix cache serves the previous prompt."""
    workload = {"sessions": ["++workload.turns={dist: fixed, value: 3}",
                             "++workload.message_len={dist: uniform, low: 8, high: 24}",
                             "++workload.think_time_s={dist: fixed, value: 0.05}"],
                "agent": ["++workload.steps={dist: fixed, value: 3}",
                          "++workload.prompt_len={dist: uniform, low: 8, high: 24}",
                          "++workload.tool_output_len={dist: uniform, low: 4, high: 16}",
                          "++workload.tool_latency_s={dist: fixed, value: 0.05}",
                          "workload.shared_prefix_len=8"]}[kind]
    cfg = make_cfg("backend=engine", "model=tiny-llama", "hardware=cpu", f"workload={kind}",
                   "workload.num_sessions=3", "workload.rate=inf", "workload.max_prompt_len=512",
                   "++workload.output_len={dist: uniform, low: 4, high: 8}", *workload,
                   "kv_cache.block_size=4", "kv_cache.enable_prefix_caching=true")
    run = run_experiment(cfg, plots=False)
    check_closed_loop(run, cfg)
    sessions = by_session(run.requests)
    assert len(sessions) == 3 and all(len(turns) == 3 for turns in sessions.values())
    for turns in sessions.values():
        for turn, following in zip(turns, turns[1:]):
            # At least turn k's prompt's full blocks; more only where the engine's answer (whose
            # blocks it caches too) happens to start like the stand-in ids (a 512-token vocab).
            computed = turn.prompt_token_ids + turn.sequences[0].output_token_ids
            shared = next((i for i, (a, b) in enumerate(zip(computed, following.prompt_token_ids))
                           if a != b), len(computed))
            assert turn.prompt_len // 4 * 4 <= following.num_cached_tokens <= shared // 4 * 4
            assert following.num_cached_tokens > 0
        for request in turns:
            assert [len(seq.output_token_ids) for seq in request.sequences] == \
                [request.output_len]
