"""Tests for the conversation workload (sim/core/workload/conversation.py,
conf/workload/conversation.yaml): multi-turn sessions whose later prompts carry the conversation
so far, so the prefix cache hits."""
from __future__ import annotations

import numpy as np
import pytest
from omegaconf import OmegaConf

from factories import make_cfg, request_tuples
from sim.core.experiment import run_experiment
from sim.core.workload import REPO_ROOT, build_workload

VOCAB = 32_000  # random ids from this many: two different prompts never share a long prefix


def conversation_workload(**overrides) -> dict:
    """A small conversation config: 30 sessions of 2-5 turns, short messages and answers."""
    cfg = {
        "kind": "conversation", "num_sessions": 30, "rate": 2.0,
        "turns": {"dist": "uniform", "low": 2, "high": 5},
        "think_time_s": {"dist": "exponential", "mean": 3.0},
        "message_len": {"dist": "uniform", "low": 5, "high": 20},
        "output_len": {"dist": "uniform", "low": 3, "high": 12},
        "max_prompt_len": None,
    }
    cfg.update(overrides)
    return cfg


def sessions_of(requests) -> list[list]:
    """The requests grouped into sessions, each in turn order, rebuilt from the prompts alone: a
    request's previous turn is the longest earlier prompt its own prompt starts with (random ids
    from a large vocabulary match no other request's)."""
    by_prompt = {tuple(r.prompt_token_ids): r for r in requests}
    lengths = sorted({r.prompt_len for r in requests}, reverse=True)
    previous = {}
    for request in requests:
        for length in lengths:
            if length < request.prompt_len:
                candidate = by_prompt.get(tuple(request.prompt_token_ids[:length]))
                if candidate is not None:
                    previous[request.request_id] = candidate
                    break
    sessions = {r.request_id: [r] for r in requests if r.request_id not in previous}
    for request in requests:  # arrival order, so a previous turn is placed before its next
        if request.request_id in previous:
            first = previous[request.request_id]
            while first.request_id in previous:
                first = previous[first.request_id]
            sessions[first.request_id].append(request)
    return list(sessions.values())


# --- prompts ---------------------------------------------------------------------------------


def test_next_turn_is_the_previous_prompt_its_answer_and_a_new_message():
    requests = build_workload(conversation_workload(
        num_sessions=25, turns={"dist": "fixed", "value": 4},
        message_len={"dist": "fixed", "value": 7}, shared_prefix_len=5), seed=0, vocab_size=VOCAB)
    sessions = sessions_of(requests)
    assert len(sessions) == 25 and all(len(turns) == 4 for turns in sessions)
    prefix = requests[0].prompt_token_ids[:5]
    answers = []
    for turns in sessions:
        assert turns[0].prompt_len == 5 + 7 and turns[0].prompt_token_ids[:5] == prefix
        for turn, following in zip(turns, turns[1:]):
            assert following.arrival_time >= turn.arrival_time
            assert following.prompt_token_ids[:turn.prompt_len] == turn.prompt_token_ids
            # prompt_len(k+1) = prompt_len(k) + output_len(k) + message_len(k+1)
            assert following.prompt_len == turn.prompt_len + turn.output_len + 7
            answers.append(following.prompt_token_ids[
                turn.prompt_len:turn.prompt_len + turn.output_len])
        # The stand-in answers are fixed once: every later turn carries the same ones.
        last = turns[-1].prompt_token_ids
        for turn in turns[:-1]:
            assert last[:turn.prompt_len] == turn.prompt_token_ids
    for request in requests:
        assert len(request.prompt_token_ids) == request.prompt_len
        assert all(0 <= i < VOCAB for i in request.prompt_token_ids)
    assert len({tuple(answer) for answer in answers}) == len(answers)  # drawn, not repeated


def test_prompt_lengths_grow_by_the_answer_and_the_message():
    requests = build_workload(conversation_workload(turns={"dist": "fixed", "value": 3}),
                              seed=1, vocab_size=VOCAB)
    sessions = sessions_of(requests)
    assert len(sessions) == 30
    messages = []
    for turns in sessions:
        messages.append(turns[0].prompt_len)
        for turn, following in zip(turns, turns[1:]):
            messages.append(following.prompt_len - turn.prompt_len - turn.output_len)
    assert min(messages) >= 5 and max(messages) <= 20 and len(set(messages)) > 5
    outputs = [r.output_len for r in requests]
    assert min(outputs) >= 3 and max(outputs) <= 12


def test_without_token_ids_the_same_lengths_and_arrivals():
    with_ids = build_workload(conversation_workload(), seed=2, vocab_size=VOCAB)
    without = build_workload(conversation_workload(with_token_ids=False), seed=2)
    assert all(r.prompt_token_ids is None for r in without)
    assert ([(r.arrival_time, r.prompt_len, r.output_len) for r in with_ids]
            == [(r.arrival_time, r.prompt_len, r.output_len) for r in without])


def test_token_ids_are_on_by_default_and_need_a_vocab_size():
    with pytest.raises(ValueError, match=r"^workload.with_token_ids=true needs a vocab_size"):
        build_workload(conversation_workload(), seed=0)


# --- arrivals ----------------------------------------------------------------------------------


def test_sessions_start_as_a_poisson_process_and_turns_follow_think_times():
    # Fixed lengths, so a second turn's previous prompt is its own prompt less answer + message.
    requests = build_workload(conversation_workload(
        num_sessions=20_000, rate=4.0, turns={"dist": "fixed", "value": 2},
        think_time_s={"dist": "exponential", "mean": 3.0},
        message_len={"dist": "fixed", "value": 8}, output_len={"dist": "fixed", "value": 2}),
        seed=3, vocab_size=VOCAB)
    assert len(requests) == 40_000
    assert [r.request_id for r in requests] == list(range(40_000))
    times = [r.arrival_time for r in requests]
    assert times == sorted(times)
    firsts = [r for r in requests if r.prompt_len == 8]
    starts = np.array([r.arrival_time for r in firsts])
    gaps = np.diff(np.concatenate([[0.0], starts]))
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.03)  # exponential gaps
    by_prompt = {tuple(r.prompt_token_ids): r for r in firsts}
    thinks = np.array([r.arrival_time - by_prompt[tuple(r.prompt_token_ids[:8])].arrival_time
                       for r in requests if r.prompt_len == 8 + 2 + 8])
    assert len(thinks) == 20_000 and thinks.min() >= 0
    assert thinks.mean() == pytest.approx(3.0, rel=0.03)
    assert thinks.std() == pytest.approx(3.0, rel=0.05)


def test_fixed_think_time_spaces_a_sessions_turns_evenly():
    requests = build_workload(conversation_workload(
        turns={"dist": "fixed", "value": 5}, think_time_s={"dist": "fixed", "value": 2.5}),
        seed=4, vocab_size=VOCAB)
    for turns in sessions_of(requests):
        assert len(turns) == 5
        assert np.diff([r.arrival_time for r in turns]) == pytest.approx([2.5] * 4)


def test_simultaneous_turns_are_ordered_by_session_then_turn():
    # rate=inf and no think time: every turn arrives at t=0.
    requests = build_workload(conversation_workload(
        rate="inf", think_time_s={"dist": "fixed", "value": 0}), seed=5, vocab_size=VOCAB)
    assert all(r.arrival_time == 0.0 for r in requests)
    assert [r.request_id for r in requests] == list(range(len(requests)))
    sessions = sessions_of(requests)
    assert len(sessions) == 30
    # Each session's turns are consecutive ids, in turn order, sessions one after another.
    assert [r.request_id for turns in sessions for r in turns] == list(range(len(requests)))


# --- the cap ----------------------------------------------------------------------------------


def test_the_prompt_cap_ends_sessions_exactly_where_the_next_prompt_would_pass_it():
    # Prompts 10, 35, 60, 85, ...: a cap of 60 keeps three turns (the cap is inclusive).
    requests = build_workload(conversation_workload(
        turns={"dist": "fixed", "value": 10}, message_len={"dist": "fixed", "value": 10},
        output_len={"dist": "fixed", "value": 15}, max_prompt_len=60), seed=6, vocab_size=VOCAB)
    sessions = sessions_of(requests)
    assert len(sessions) == 30
    assert all([r.prompt_len for r in turns] == [10, 35, 60] for turns in sessions)


def test_the_cap_with_varying_answers():
    requests = build_workload(conversation_workload(
        turns={"dist": "fixed", "value": 10}, message_len={"dist": "fixed", "value": 10},
        output_len={"dist": "uniform", "low": 5, "high": 30}, max_prompt_len=100),
        seed=7, vocab_size=VOCAB)
    sessions = sessions_of(requests)
    assert len(sessions) == 30
    assert max(r.prompt_len for r in requests) <= 100
    lengths = set()
    for turns in sessions:
        last = turns[-1]
        assert last.prompt_len + last.output_len + 10 > 100  # the next one would pass the cap
        lengths.add(len(turns))
    assert len(lengths) > 1
    uncapped = build_workload(conversation_workload(
        turns={"dist": "fixed", "value": 10}, message_len={"dist": "fixed", "value": 10},
        output_len={"dist": "uniform", "low": 5, "high": 30}), seed=7, vocab_size=VOCAB)
    assert len(uncapped) == 300 and len(requests) < 300


def test_a_cap_no_first_prompt_fits_is_an_error():
    with pytest.raises(ValueError, match=r"^workload.max_prompt_len=4 leaves no request"):
        build_workload(conversation_workload(max_prompt_len=4), seed=0, vocab_size=VOCAB)


# --- seeds and common random numbers ------------------------------------------------------------


def test_same_seed_same_requests_different_seed_different():
    cfg = conversation_workload(shared_prefix_len=3, max_prompt_len=80)
    first = build_workload(cfg, seed=8, vocab_size=VOCAB)
    assert request_tuples(first) == request_tuples(build_workload(cfg, seed=8, vocab_size=VOCAB))
    assert request_tuples(first) != request_tuples(build_workload(cfg, seed=9, vocab_size=VOCAB))


def test_changing_the_answers_keeps_the_arrivals():
    base = build_workload(conversation_workload(), seed=10, vocab_size=VOCAB)
    other = build_workload(conversation_workload(output_len={"dist": "fixed", "value": 40}),
                           seed=10, vocab_size=VOCAB)
    assert [r.arrival_time for r in base] == [r.arrival_time for r in other]
    assert [r.prompt_len for r in base] != [r.prompt_len for r in other]


# --- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    ({"num_sessions": 0}, "workload.num_sessions must be >= 1"),
    ({"num_sessions": 2.5}, "workload.num_sessions must be an integer"),
    ({"rate": -1}, "workload.rate must be > 0"),
    ({"rate": "fast"}, "workload.rate must be a number"),
    ({"turns": {"dist": "uniform", "low": 3, "high": 1}}, "workload.turns.high must be >= 3"),
    ({"turns": 4}, "workload.turns must be a mapping"),
    ({"message_len": {"dist": "normal", "mean": 4}}, "workload.message_len.dist must be one of"),
    ({"output_len": {"dist": "fixed", "value": 0}}, "workload.output_len.value must be >= 1"),
    ({"think_time_s": {"dist": "gamma", "mean": 1}}, "workload.think_time_s.dist must be one of"),
    ({"think_time_s": {"dist": "exponential", "mean": 0}},
     "workload.think_time_s.mean must be > 0"),
    ({"think_time_s": {"dist": "fixed", "value": -1}},
     "workload.think_time_s.value must be a number >= 0"),
    ({"think_time_s": {"dist": "uniform", "low": 5, "high": 1}},
     "workload.think_time_s.high must be >= workload.think_time_s.low"),
    ({"think_time_s": {"dist": "lognormal", "mean": 2, "sigma": -1}},
     "workload.think_time_s.sigma must be a number >= 0"),
    ({"think_time_s": {"dist": "fixed", "value": 1, "a": 2}},
     "workload.think_time_s.a is not a known field"),
    ({"max_prompt_len": 0}, "workload.max_prompt_len must be >= 1"),
    ({"max_prompt_len": 8, "shared_prefix_len": 8},
     "workload.max_prompt_len must be > workload.shared_prefix_len"),
    ({"with_token_ids": False, "shared_prefix_len": 4},
     "workload.shared_prefix_len=4 needs workload.with_token_ids=true"),
    ({"n": 0}, "workload.n must be >= 1"),
    ({"classes": None}, "workload.classes is not a known field"),
    ({"num_requests": 10}, "workload.num_requests is not a known field"),
])
def test_bad_values_name_the_field_in_one_line(overrides, message):
    cfg = conversation_workload(**overrides)
    with pytest.raises(ValueError) as error:
        build_workload(cfg, seed=0, vocab_size=VOCAB)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_a_missing_field_is_required():
    cfg = conversation_workload()
    del cfg["think_time_s"]
    with pytest.raises(ValueError, match=r"^workload.think_time_s is required$"):
        build_workload(cfg, seed=0, vocab_size=VOCAB)


# --- the preset and runs ----------------------------------------------------------------------


def test_the_preset_builds_within_its_cap():
    cfg = OmegaConf.load(REPO_ROOT / "conf" / "workload" / "conversation.yaml")
    requests = build_workload(cfg, seed=0, vocab_size=VOCAB)
    assert len(sessions_of(requests)) == cfg.num_sessions
    assert max(r.prompt_len for r in requests) <= cfg.max_prompt_len
    assert all(r.prompt_token_ids is not None for r in requests)


def test_the_simulator_serves_later_turns_from_the_prefix_cache():
    overrides = ["workload=conversation", "workload.num_sessions=40"]
    cached = run_experiment(make_cfg(*overrides, "kv_cache.enable_prefix_caching=true"),
                            plots=False)
    uncached = run_experiment(make_cfg(*overrides, "kv_cache.enable_prefix_caching=false"),
                              plots=False)
    assert cached.summary["completed"] == uncached.summary["completed"] == len(cached.requests)
    assert all(r.num_cached_tokens == 0 for r in uncached.requests)
    assert cached.summary["mean_ttft_ms"] < 0.8 * uncached.summary["mean_ttft_ms"]
    block_size = make_cfg(*overrides).kv_cache.block_size
    hits = 0
    for turns in sessions_of(cached.requests):
        assert turns[0].num_cached_tokens == 0  # no shared prefix: nothing to hit
        for turn, following in zip(turns, turns[1:]):
            if turn.first_token_time <= following.arrival_time:
                # The whole previous prompt, in full blocks; its answer is computed again.
                assert following.num_cached_tokens == turn.prompt_len // block_size * block_size
                hits += 1
    assert hits > 100
    total = sum(r.num_cached_tokens for r in cached.requests)
    assert total > 0.5 * sum(r.prompt_len for r in cached.requests)


def test_the_shared_system_prompt_hits_on_first_turns():
    run = run_experiment(make_cfg("workload=conversation", "workload.num_sessions=10",
                                  "workload.shared_prefix_len=64",
                                  "kv_cache.enable_prefix_caching=true"), plots=False)
    firsts = [turns[0] for turns in sessions_of(run.requests)]
    assert len(firsts) == 10 and firsts[0].num_cached_tokens == 0
    assert all(r.num_cached_tokens == 64 for r in firsts[1:])


def test_the_engine_hits_the_cache_and_answers_the_same():
    """backend=engine on the tiny Llama: 4 sessions of 2 turns, the second a second after."""
    overrides = ["backend=engine", "model=tiny-llama", "hardware=cpu", "workload=conversation",
                 "workload.num_sessions=4", "workload.rate=inf",
                 "++workload.turns={dist: fixed, value: 2}",
                 "++workload.think_time_s={dist: fixed, value: 1.0}",
                 "++workload.message_len={dist: uniform, low: 8, high: 24}",
                 "++workload.output_len={dist: uniform, low: 4, high: 8}",
                 "workload.max_prompt_len=512", "kv_cache.block_size=4"]
    cached = run_experiment(make_cfg(*overrides, "kv_cache.enable_prefix_caching=true"),
                            plots=False)
    uncached = run_experiment(make_cfg(*overrides, "kv_cache.enable_prefix_caching=false"),
                              plots=False)
    sessions = sessions_of(cached.requests)
    assert len(sessions) == 4
    for first, second in sessions:
        assert first.num_cached_tokens == 0
        assert second.num_cached_tokens == first.prompt_len // 4 * 4 > 0
    # Greedy: the cache changes what is computed, not the answers.
    answers = [[s.output_token_ids for s in r.sequences] for r in cached.requests]
    assert answers == [[s.output_token_ids for s in r.sequences] for r in uncached.requests]
    assert all(len(seq.output_token_ids) == r.output_len
               for r in cached.requests for seq in r.sequences)
