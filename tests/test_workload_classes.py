"""Tests for request classes (`workload.classes`) and a trace's per-request metadata columns."""
from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from factories import make_cfg, request_tuples, summary_without_wall_time, synthetic_workload
from omegaconf import OmegaConf, open_dict

from sim.core.experiment import run_experiment
from sim.core.workload import REPO_ROOT, build_workload

CONF_DIR = REPO_ROOT / "conf" / "workload"


# --- synthetic classes ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_classes_mix_by_share(seed):
    shares = {"a": 0.2, "b": 0.5, "c": 0.3}
    classes = [{"share": share, "tenant": name, "priority": index}
               for index, (name, share) in enumerate(shares.items())]
    requests = build_workload(synthetic_workload(num_requests=4000, classes=classes), seed=seed)
    counts = Counter(r.tenant for r in requests)
    num = len(requests)
    for index, (name, share) in enumerate(shares.items()):
        # 4.5 binomial standard deviations: a false alarm about once in 150,000 runs.
        assert abs(counts[name] - num * share) <= 4.5 * math.sqrt(num * share * (1 - share))
        assert {r.priority for r in requests if r.tenant == name} == {index}
    # The mix is spread over the run, not one class after another.
    first_half = Counter(r.tenant for r in requests[:num // 2])
    assert abs(first_half["b"] - num / 4) <= 4.5 * math.sqrt(num / 2 * 0.25)


def test_each_class_uses_its_own_lengths_and_the_others_keep_the_workloads():
    classes = [
        {"share": 0.3, "tenant": "short", "prompt_len": {"dist": "fixed", "value": 5},
         "output_len": {"dist": "uniform", "low": 300, "high": 400}},
        {"share": 0.3, "tenant": "long", "prompt_len": {"dist": "uniform", "low": 1000,
                                                        "high": 1100}},
        {"share": 0.4, "tenant": "plain"},
    ]
    requests = build_workload(synthetic_workload(num_requests=4000, classes=classes), seed=2)
    plain = build_workload(synthetic_workload(num_requests=4000), seed=2)
    by_tenant = {name: [r for r in requests if r.tenant == name]
                 for name in ("short", "long", "plain")}
    assert all(len(group) > 1000 for group in by_tenant.values())
    assert {r.prompt_len for r in by_tenant["short"]} == {5}
    assert all(300 <= r.output_len <= 400 for r in by_tenant["short"])
    assert all(1000 <= r.prompt_len <= 1100 for r in by_tenant["long"])
    assert {r.output_len for r in by_tenant["long"]} == {7}  # no output_len: the workload's
    # A class with no lengths of its own gets exactly the lengths a run without classes draws,
    # and every request the same arrival (common random numbers).
    for request in by_tenant["plain"]:
        twin = plain[request.request_id]
        assert (request.prompt_len, request.output_len) == (twin.prompt_len, twin.output_len)
    assert [r.arrival_time for r in requests] == [r.arrival_time for r in plain]


def test_class_fields_reach_the_requests():
    classes = [{"share": 0.5, "tenant": "a", "priority": -1, "slo_ttft_ms": 200},
               {"share": 0.5, "slo_tpot_ms": 25.5}]
    requests = build_workload(synthetic_workload(num_requests=300, classes=classes), seed=0)
    kinds = {(r.tenant, r.priority, r.slo_ttft_ms, r.slo_tpot_ms) for r in requests}
    assert kinds == {("a", -1, 200.0, None), ("default", 0, None, 25.5)}
    assert all(r.predicted_output_len is None for r in requests)


def test_classes_that_only_tag_change_nothing_else():
    with_ids = dict(num_requests=4000, with_token_ids=True, shared_prefix_len=3)
    plain = build_workload(synthetic_workload(**with_ids), seed=5, vocab_size=50)
    tagged = build_workload(synthetic_workload(**with_ids, classes=[
        {"share": 0.5, "tenant": "a"}, {"share": 0.5, "tenant": "b"}]), seed=5, vocab_size=50)
    assert [t[:6] for t in request_tuples(tagged)] == [t[:6] for t in request_tuples(plain)]
    assert {r.tenant for r in tagged} == {"a", "b"}


@pytest.mark.parametrize("name", ["synthetic", "sharegpt_like"])
def test_no_classes_is_the_workload_without_the_key(name):
    cfg = OmegaConf.load(CONF_DIR / f"{name}.yaml")
    assert "classes" in cfg and cfg.classes is None
    without = OmegaConf.to_container(cfg)
    del without["classes"]
    assert (request_tuples(build_workload(cfg, seed=3))
            == request_tuples(build_workload(without, seed=3)))
    assert {(r.priority, r.tenant, r.slo_ttft_ms, r.slo_tpot_ms)
            for r in build_workload(cfg, seed=3)} == {(0, "default", None, None)}


def test_default_workload_draws_what_it_drew_before_classes():
    # Pinned from the workload before classes existed: a fifth random stream must not move the
    # other four.
    requests = build_workload(OmegaConf.load(CONF_DIR / "synthetic.yaml"), seed=0)
    assert [(r.prompt_len, r.output_len) for r in requests[:4]] == [
        (EXPECTED_PROMPTS[i], EXPECTED_OUTPUTS[i]) for i in range(4)]
    assert [r.arrival_time for r in requests[:2]] == pytest.approx(EXPECTED_ARRIVALS, rel=1e-12)


def test_run_without_classes_matches_the_run_without_the_key():
    cfg = make_cfg("workload.num_requests=150", "slo.ttft_ms=100")
    without = make_cfg("workload.num_requests=150", "slo.ttft_ms=100")
    with open_dict(without):
        del without.workload["classes"]
    summary = summary_without_wall_time(run_experiment(cfg))
    assert summary == summary_without_wall_time(run_experiment(without))
    assert not {"per_tenant", "per_priority", "jain_fairness"} & set(summary)


def test_classes_override_on_the_command_line():
    cfg = make_cfg("workload.num_requests=50",
                   "workload.classes=[{share: 0.5, tenant: a}, {share: 0.5, tenant: b}]")
    assert {r.tenant for r in run_experiment(cfg).requests} == {"a", "b"}


@pytest.mark.parametrize("classes, message", [
    ([{"share": 0.5}, {"share": 0.4}],
     r"^workload\.classes: shares must sum to 1, got 0\.5 \+ 0\.4 = 0\.9$"),
    ([{"share": 0.6}, {"share": 0.6}], r"^workload\.classes: shares must sum to 1"),
    ([{"share": 0}, {"share": 1}], r"^workload\.classes\[0\]\.share must be in \(0, 1\]"),
    ([{"share": 1.5}], r"^workload\.classes\[0\]\.share must be in \(0, 1\]"),
    ([{"share": "half"}], r"^workload\.classes\[0\]\.share must be a number"),
    ([{"tenant": "a"}], r"^workload\.classes\[0\]\.share is required"),
    ([{"share": 1, "prio": 1}],
     r"^workload\.classes\[0\]\.prio is not a known field; known fields: share, priority"),
    ([{"share": 0.5}, {"share": 0.5, "priority": 1.5}],
     r"^workload\.classes\[1\]\.priority must be an integer, got 1\.5"),
    ([{"share": 1, "priority": True}], r"^workload\.classes\[0\]\.priority must be an integer"),
    ([{"share": 1, "slo_ttft_ms": 0}], r"^workload\.classes\[0\]\.slo_ttft_ms must be > 0"),
    ([{"share": 1, "slo_tpot_ms": -5}], r"^workload\.classes\[0\]\.slo_tpot_ms must be > 0"),
    ([{"share": 1, "tenant": 7}], r"^workload\.classes\[0\]\.tenant must be a non-empty string"),
    ([{"share": 1, "prompt_len": {"dist": "fixed"}}],
     r"^workload\.classes\[0\]\.prompt_len\.value is required"),
    ([], r"^workload\.classes must be null or a non-empty list"),
    ("a", r"^workload\.classes must be null or a non-empty list"),
    ([3], r"^workload\.classes\[0\] must be a mapping"),
])
def test_bad_classes_name_the_field(classes, message):
    with pytest.raises(ValueError, match=message):
        build_workload(synthetic_workload(num_requests=4000, classes=classes), seed=0)


def test_shares_may_miss_one_by_rounding_only():
    thirds = [{"share": 0.333333333333, "tenant": name} for name in "ab"] + [
        {"share": 0.333333333334, "tenant": "c"}]
    assert len(build_workload(synthetic_workload(num_requests=10, classes=thirds), seed=0)) == 10
    with pytest.raises(ValueError, match="must sum to 1"):
        build_workload(synthetic_workload(classes=[{"share": 0.5}, {"share": 0.49999}]),
                       seed=0)


def test_a_trace_takes_no_classes(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("arrival_time,prompt_len,output_len\n0,3,4\n")
    cfg = {"kind": "trace", "trace_path": str(path), "classes": [{"share": 1}]}
    with pytest.raises(ValueError, match=r"^workload\.classes is not a known field"):
        build_workload(cfg, seed=0)


# --- trace metadata columns ----------------------------------------------------------------------


def trace(tmp_path: Path, text: str) -> dict:
    path = tmp_path / "trace.csv"
    path.write_text(text)
    return {"kind": "trace", "trace_path": str(path)}


def test_trace_metadata_columns_parse_and_follow_their_rows(tmp_path):
    # Rows out of order: each row's metadata travels with it when the trace is sorted.
    cfg = trace(tmp_path, "arrival_time,prompt_len,output_len,priority,tenant,slo_ttft_ms,"
                          "slo_tpot_ms\n"
                          "2.0,5,6,,,,\n"
                          "0.0,3,4,2,alice,150,30.5\n"
                          "1.0,7,8,-1, bob ,,12\n")
    requests = build_workload(cfg, seed=0)
    assert [(r.prompt_len, r.priority, r.tenant, r.slo_ttft_ms, r.slo_tpot_ms)
            for r in requests] == [(3, 2, "alice", 150.0, 30.5), (7, -1, "bob", None, 12.0),
                                   (5, 0, "default", None, None)]
    assert all(type(r.priority) is int for r in requests)


def test_trace_with_some_metadata_columns_and_short_rows(tmp_path):
    cfg = trace(tmp_path, "arrival_time,prompt_len,output_len,tenant\n0,3,4,x\n1,3,4\n")
    requests = build_workload(cfg, seed=0)
    assert [(r.tenant, r.priority, r.slo_ttft_ms) for r in requests] == [
        ("x", 0, None), ("default", 0, None)]


def test_trace_without_metadata_keeps_the_defaults():
    cfg = OmegaConf.load(CONF_DIR / "trace.yaml")
    cfg.max_requests = 100
    assert {(r.priority, r.tenant, r.slo_ttft_ms, r.slo_tpot_ms)
            for r in build_workload(cfg, seed=0)} == {(0, "default", None, None)}


@pytest.mark.parametrize("column, value, what", [
    ("priority", "1.5", "an integer"),
    ("priority", "high", "an integer"),
    ("priority", "inf", "an integer"),
    ("slo_ttft_ms", "0", "a positive number of ms or empty"),
    ("slo_ttft_ms", "-3", "a positive number of ms or empty"),
    ("slo_tpot_ms", "fast", "a positive number of ms or empty"),
    ("slo_tpot_ms", "nan", "a positive number of ms or empty"),
])
def test_trace_bad_metadata_names_row_and_column(tmp_path, column, value, what):
    cfg = trace(tmp_path, f"arrival_time,prompt_len,output_len,{column}\n0,3,4,\n1,3,4,{value}\n")
    with pytest.raises(ValueError) as error:
        build_workload(cfg, seed=0)
    message = str(error.value)
    assert "\n" not in message
    assert f"row 2 (line 3): {column} must be {what}, got {value!r}" in message


# The first requests of conf/workload/synthetic.yaml at seed 0, as drawn before classes existed.
EXPECTED_PROMPTS = (708, 81, 23, 785)
EXPECTED_OUTPUTS = (197, 53, 331, 200)
EXPECTED_ARRIVALS = (0.32935277908098276, 0.4056658528959677)
