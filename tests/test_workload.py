"""Tests for sim/core/workload/: synthetic sampling, trace replay, validation, the yaml presets."""
from __future__ import annotations

import csv
import math
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from omegaconf import OmegaConf

from factories import request_tuples, synthetic_workload
from sim.core.workload import REPO_ROOT, build_workload

CONF_DIR = REPO_ROOT / "conf" / "workload"
AZURE_TRACE = REPO_ROOT / "data" / "traces" / "azure_llm_2023_code.csv"


def gaps(requests) -> np.ndarray:
    return np.diff([0.0] + [r.arrival_time for r in requests])


def write_csv(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# --- synthetic ---------------------------------------------------------------------------------


def test_same_seed_same_requests_different_seed_different():
    cfg = synthetic_workload(with_token_ids=True, shared_prefix_len=4)
    first = build_workload(cfg, seed=3, vocab_size=100)
    assert request_tuples(first) == request_tuples(build_workload(cfg, seed=3, vocab_size=100))
    assert request_tuples(first) != request_tuples(build_workload(cfg, seed=4, vocab_size=100))


def test_requests_are_sorted_and_numbered():
    requests = build_workload(synthetic_workload(n=3), seed=0)
    assert [r.request_id for r in requests] == list(range(200))
    times = [r.arrival_time for r in requests]
    assert times == sorted(times) and times[0] > 0
    assert all(r.n == 3 and r.prompt_token_ids is None for r in requests)
    assert all(type(r.prompt_len) is int and type(r.arrival_time) is float for r in requests)


def test_changing_lengths_keeps_arrivals():
    # Independent random streams: a different output distribution leaves the arrivals alone.
    base = build_workload(synthetic_workload(), seed=1)
    other = build_workload(
        synthetic_workload(output_len={"dist": "uniform", "low": 1, "high": 99}), seed=1)
    assert [r.arrival_time for r in base] == [r.arrival_time for r in other]
    assert [r.prompt_len for r in base] == [r.prompt_len for r in other]


@pytest.mark.parametrize("arrival", ["poisson", "gamma", "constant"])
def test_rate_is_respected(arrival):
    requests = build_workload(synthetic_workload(num_requests=20_000, rate=5.0, arrival=arrival,
                                        burstiness=0.5), seed=0)
    assert gaps(requests).mean() == pytest.approx(1 / 5.0, rel=0.10)


def test_gamma_burstiness_sets_the_coefficient_of_variation():
    def cv(**overrides):
        g = gaps(build_workload(synthetic_workload(num_requests=20_000, **overrides), seed=0))
        return g.std() / g.mean()

    assert cv(arrival="gamma", burstiness=0.25) == pytest.approx(2.0, rel=0.15)
    assert cv(arrival="gamma", burstiness=1.0) == pytest.approx(1.0, rel=0.10)
    assert cv(arrival="gamma", burstiness=4.0) == pytest.approx(0.5, rel=0.10)
    assert cv(arrival="poisson") == pytest.approx(1.0, rel=0.10)
    assert cv(arrival="constant") == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("rate", [math.inf, "inf"])
def test_infinite_rate_puts_every_arrival_at_zero(rate):
    assert {r.arrival_time for r in build_workload(synthetic_workload(rate=rate), seed=0)} == {0.0}


def truncated_zipf_mean(a, low, high):
    ranks = np.arange(1, high - low + 2, dtype=float)
    weights = ranks ** -a
    return float(((low + ranks - 1) * weights).sum() / weights.sum())


@pytest.mark.parametrize("spec, low, high, mean, rel", [
    ({"dist": "fixed", "value": 42}, 42, 42, 42, 0),
    ({"dist": "uniform", "low": 3, "high": 9}, 3, 9, 6, 0.02),
    # A wide clip barely moves the mean, so the sample mean is close to `mean`.
    ({"dist": "lognormal", "mean": 300, "sigma": 0.5, "min": 1, "max": 100_000}, 1, 100_000,
     300, 0.03),
    # A tight clip: bounds hold (the mean is the unclipped one, so it is not checked here).
    ({"dist": "lognormal", "mean": 512, "sigma": 1.0, "min": 16, "max": 600}, 16, 600, None, 0),
    ({"dist": "zipf", "a": 1.5, "min": 5, "max": 500}, 5, 500, truncated_zipf_mean(1.5, 5, 500),
     0.05),
])
def test_length_distribution_bounds_and_mean(spec, low, high, mean, rel):
    requests = build_workload(
        synthetic_workload(num_requests=20_000, prompt_len=spec, output_len=spec), seed=0)
    for lengths in ([r.prompt_len for r in requests], [r.output_len for r in requests]):
        lengths = np.array(lengths)
        assert lengths.min() >= low and lengths.max() <= high
        if mean is not None:
            assert lengths.mean() == pytest.approx(mean, rel=rel)
    if spec["dist"] == "uniform":  # inclusive on both ends
        assert set(lengths.tolist()) == set(range(3, 10))
    if spec["dist"] == "zipf":  # truncated, not clipped: the most common length is `min`
        assert np.bincount(lengths).argmax() == 5


@settings(max_examples=40, deadline=None)
@given(mean=st.floats(1, 5000), sigma=st.floats(0, 3), low=st.integers(1, 50),
       span=st.integers(0, 3000), seed=st.integers(0, 2**32))
def test_lognormal_lengths_stay_in_bounds(mean, sigma, low, span, seed):
    spec = {"dist": "lognormal", "mean": mean, "sigma": sigma, "min": low, "max": low + span}
    requests = build_workload(synthetic_workload(num_requests=50, prompt_len=spec), seed=seed)
    assert all(low <= r.prompt_len <= low + span for r in requests)


def test_token_ids_share_the_prefix():
    cfg = synthetic_workload(prompt_len={"dist": "uniform", "low": 2, "high": 40},
                             with_token_ids=True, shared_prefix_len=16)
    requests = build_workload(cfg, seed=0, vocab_size=50)
    prefix = max(requests, key=lambda r: r.prompt_len).prompt_token_ids[:16]
    for r in requests:
        assert len(r.prompt_token_ids) == r.prompt_len
        assert r.prompt_token_ids[:16] == prefix[:r.prompt_len]  # short prompts: part of it
        assert all(0 <= token < 50 for token in r.prompt_token_ids)
    # Beyond the prefix, prompts differ.
    long_tails = {tuple(r.prompt_token_ids[16:]) for r in requests if r.prompt_len > 24}
    assert len(long_tails) == sum(r.prompt_len > 24 for r in requests)


def test_token_ids_need_vocab_size():
    with pytest.raises(ValueError, match="workload.with_token_ids=true needs a vocab_size"):
        build_workload(synthetic_workload(with_token_ids=True), seed=0)
    with pytest.raises(ValueError, match="workload.shared_prefix_len=8 needs "
                                         "workload.with_token_ids=true"):
        build_workload(synthetic_workload(shared_prefix_len=8), seed=0)


def test_hundred_thousand_requests_are_ordered_and_numbered():
    cfg = OmegaConf.load(CONF_DIR / "synthetic.yaml")
    cfg.num_requests = 100_000
    requests = build_workload(cfg, seed=0)
    assert [r.request_id for r in requests] == list(range(100_000))
    arrivals = [r.arrival_time for r in requests]
    assert arrivals == sorted(arrivals)


# --- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    ({"rate": -1}, "workload.rate must be > 0, got -1"),
    ({"rate": "fast"}, "workload.rate must be a number, got 'fast'"),
    ({"arrival": "foo"}, "workload.arrival must be one of poisson, gamma, constant; got 'foo'"),
    ({"kind": "replay"}, "workload.kind must be one of synthetic, trace, conversation; got 'replay'"),
    ({"num_requests": 0}, "workload.num_requests must be >= 1, got 0"),
    ({"num_requests": 2.5}, "workload.num_requests must be an integer, got 2.5"),
    ({"burstiness": 0}, "workload.burstiness must be > 0, got 0"),
    ({"n": True}, "workload.n must be an integer, got True"),
    ({"num_request": 5}, "workload.num_request is not a known field"),
    ({"prompt_len": {"dist": "normal"}},
     "workload.prompt_len.dist must be one of fixed, uniform, lognormal, zipf; got 'normal'"),
    ({"prompt_len": {"dist": "uniform", "low": 10, "high": 5}},
     "workload.prompt_len.high must be >= 10, got 5"),
    ({"output_len": {"dist": "zipf", "a": 1.0, "max": 10}}, "workload.output_len.a must be > 1"),
    ({"output_len": {"dist": "zipf", "a": 2.0}}, "workload.output_len.max is required"),
    ({"output_len": {"dist": "lognormal", "mean": 10, "sigma": -1}},
     "workload.output_len.sigma must be a number >= 0, got -1.0"),
    ({"output_len": {"dist": "fixed", "value": 0}}, "workload.output_len.value must be >= 1"),
    ({"output_len": 5}, "workload.output_len must be a mapping"),
])
def test_bad_values_name_the_field(overrides, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)) as error:
        build_workload(synthetic_workload(**overrides), seed=0)
    assert "\n" not in str(error.value)


def test_missing_kind_is_named():
    with pytest.raises(ValueError, match="workload.kind"):
        build_workload({"num_requests": 5}, seed=0)


# --- traces ------------------------------------------------------------------------------------


def trace_cfg(path, **overrides) -> dict:
    return {"kind": "trace", "trace_path": str(path), "time_scale": 1.0, **overrides}


@pytest.fixture
def azure_trace() -> Path:
    return AZURE_TRACE


def test_azure_trace_replays_the_csv(azure_trace):
    requests = build_workload(trace_cfg(azure_trace), seed=0)
    with open(azure_trace, newline="") as file:
        rows = list(csv.DictReader(file))
    assert len(requests) == len(rows) == 8819
    assert requests[0].arrival_time == 0.0
    # The file is in time order, so requests follow it row by row.
    assert [r.prompt_len for r in requests] == [int(row["ContextTokens"]) for row in rows]
    assert [r.output_len for r in requests] == [int(row["GeneratedTokens"]) for row in rows]
    # Rows 1 and 2 are 18:17:03.9799600 and 18:17:04.0319600: the 7th digit is kept.
    assert requests[1].arrival_time == pytest.approx(0.052, abs=1e-9)
    assert requests[-1].arrival_time == pytest.approx(3435.948056, abs=1e-6)


def test_time_scale_and_max_requests(azure_trace):
    full = build_workload(trace_cfg(azure_trace), seed=0)
    fast = build_workload(trace_cfg(azure_trace, time_scale=0.5, n=2), seed=0)
    assert fast[-1].arrival_time == pytest.approx(full[-1].arrival_time / 2)
    assert fast[0].n == 2
    first_ten = build_workload(trace_cfg(azure_trace, max_requests=10), seed=0)
    assert request_tuples(first_ten) == request_tuples(full[:10])


def test_trace_yaml_resolves_from_another_working_directory(azure_trace, tmp_path, monkeypatch):
    # data/traces/... is not there from tmp_path, so the repo-root fallback must find it.
    monkeypatch.chdir(tmp_path)
    requests = build_workload(OmegaConf.load(CONF_DIR / "trace.yaml"), seed=0)
    assert len(requests) == 8819


def test_plain_format_trace(tmp_path):
    # Out of order and starting at t=10: replayed sorted, relative to the earliest row.
    path = write_csv(tmp_path / "plain.csv",
                     "arrival_time,prompt_len,output_len\n12.5,30,4\n10.0,20,3\n\n11,25,2\n")
    requests = build_workload(trace_cfg(path, time_scale=2.0), seed=0)
    assert [(r.request_id, r.arrival_time, r.prompt_len, r.output_len) for r in requests] == [
        (0, 0.0, 20, 3), (1, 2.0, 25, 2), (2, 5.0, 30, 4)]


def test_azure_timestamps_with_timezones(tmp_path):
    path = write_csv(tmp_path / "tz.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "2024-05-10 00:00:00.1234567+00:00,5,6\n2024-05-10 01:00:01+01:00,7,8\n")
    # 7th fractional digit dropped: 01:00:01+01:00 is 00:00:01 UTC, 0.876544 s after the first.
    assert [r.arrival_time for r in build_workload(trace_cfg(path), seed=0)] == [
        0.0, pytest.approx(0.876544, abs=1e-9)]


def test_trace_missing_column_is_named(tmp_path):
    path = write_csv(tmp_path / "t.csv", "TIMESTAMP,GeneratedTokens\n2023-11-16 18:17:03.97,4\n")
    with pytest.raises(ValueError, match="missing column") as error:
        build_workload(trace_cfg(path), seed=0)
    message = str(error.value)
    assert "ContextTokens" in message.split(";")[0] and str(path) in message
    assert "found TIMESTAMP, GeneratedTokens" in message and "\n" not in message


@pytest.mark.parametrize("bad_value", ["0", "-3", "abc", "", "2.5"])
def test_trace_bad_length_names_row_and_column(tmp_path, bad_value):
    path = write_csv(tmp_path / "t.csv",
                     f"arrival_time,prompt_len,output_len\n0,5,5\n1,5,5\n2,{bad_value},5\n")
    with pytest.raises(ValueError, match=r"row 3 \(line 4\): prompt_len must be a positive "
                                         r"integer") as error:
        build_workload(trace_cfg(path), seed=0)
    assert str(path) in str(error.value)


def test_trace_bad_timestamp_names_row(tmp_path):
    path = write_csv(tmp_path / "t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "2023-11-16 18:17:03.9799600,5,5\nyesterday,5,5\n")
    with pytest.raises(ValueError, match=r"row 2 \(line 3\): TIMESTAMP must be a datetime"):
        build_workload(trace_cfg(path), seed=0)


def test_trace_missing_file_and_bad_time_scale(tmp_path):
    with pytest.raises(ValueError, match="workload.trace_path: no trace file at"):
        build_workload(trace_cfg(tmp_path / "nope.csv"), seed=0)
    path = write_csv(tmp_path / "t.csv", "arrival_time,prompt_len,output_len\n0,1,1\n")
    with pytest.raises(ValueError, match="workload.time_scale must be > 0, got 0"):
        build_workload(trace_cfg(path, time_scale=0), seed=0)
    with pytest.raises(ValueError, match="workload.max_requests must be >= 1, got 0"):
        build_workload(trace_cfg(path, max_requests=0), seed=0)


# --- yaml presets ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["synthetic", "sharegpt_like"])
def test_presets_build_and_accept_overrides(name):
    cfg = OmegaConf.merge(OmegaConf.load(CONF_DIR / f"{name}.yaml"),
                          OmegaConf.from_dotlist(["num_requests=1000", "rate=5"]))
    requests = build_workload(cfg, seed=0)
    assert len(requests) == 1000
    assert gaps(requests).mean() == pytest.approx(0.2, rel=0.15)


def test_sharegpt_preset_matches_the_paper_means():
    cfg = OmegaConf.load(CONF_DIR / "sharegpt_like.yaml")
    cfg.num_requests = 50_000
    requests = build_workload(cfg, seed=0)
    assert np.mean([r.prompt_len for r in requests]) == pytest.approx(161.31, rel=0.03)
    assert np.mean([r.output_len for r in requests]) == pytest.approx(337.99, rel=0.03)
    assert max(r.prompt_len + r.output_len for r in requests) <= 2048


def test_trace_prompt_token_ids_are_the_prompts(tmp_path):
    # Rows out of order: the ids travel with their row when the trace is sorted by arrival.
    path = write_csv(tmp_path / "ids.csv", "arrival_time,prompt_len,output_len,prompt_token_ids\n"
                     "1.0,3,4,7 8 9\n0.0,2,5,5 6\n")
    requests = build_workload(trace_cfg(path), seed=0, vocab_size=16)
    assert [(r.prompt_len, r.output_len, r.prompt_token_ids) for r in requests] == [
        (2, 5, [5, 6]), (3, 4, [7, 8, 9])]
    # with_token_ids=true does not replace a trace's own prompts with random ones.
    again = build_workload(trace_cfg(path, with_token_ids=True), seed=3, vocab_size=16)
    assert [r.prompt_token_ids for r in again] == [[5, 6], [7, 8, 9]]


@pytest.mark.parametrize("row, match", [
    ("0.0,3,4,7 8", r"row 1 \(line 2\): 2 prompt_token_ids for a prompt_len of 3"),
    ("0.0,2,4,7 x", r"row 1 \(line 2\): prompt_token_ids must be space-separated integers"),
    ("0.0,2,4,7 99", r"row 1: prompt_token_ids outside the model's vocabulary \[0, 16\)"),
])
def test_trace_bad_prompt_token_ids_name_the_row(tmp_path, row, match):
    path = write_csv(tmp_path / "ids.csv",
                     f"arrival_time,prompt_len,output_len,prompt_token_ids\n{row}\n")
    with pytest.raises(ValueError, match=match):
        build_workload(trace_cfg(path), seed=0, vocab_size=16)


def test_trace_with_its_own_prompts_refuses_a_shared_prefix(tmp_path):
    path = write_csv(tmp_path / "ids.csv",
                     "arrival_time,prompt_len,output_len,prompt_token_ids\n0.0,2,4,1 2\n")
    with pytest.raises(ValueError, match="shared_prefix_len: trace .* has its own"):
        build_workload(trace_cfg(path, with_token_ids=True, shared_prefix_len=1), seed=0,
                       vocab_size=16)
