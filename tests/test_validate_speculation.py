"""bench/validate_speculation.py: speedups and errors from the per-job validations, the gate, and
one tiny end-to-end run on the trained pair with the shipped profiles."""
from __future__ import annotations

import functools
import importlib.util
import json
import statistics
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parent.parent
SPEC = importlib.util.spec_from_file_location("validate_speculation",
                                              REPO / "bench" / "validate_speculation.py")
validate_speculation = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(validate_speculation)


def job(engine_throughput, sim_throughput, acceptance=(0.0, 0.0), tokens=(1.0, 1.0)):
    def metric(engine, sim):
        return {"engine": engine, "sim": sim, "error_pct": (sim - engine) / engine * 100
                if engine else None}
    return {"metrics": {"output_throughput": metric(engine_throughput, sim_throughput),
                        "spec_acceptance_rate": metric(*acceptance),
                        "mean_tokens_per_decode_step": metric(*tokens)}}


def test_speedup_is_each_sides_throughput_over_its_own_k0_run():
    results = {(4, 0): job(100.0, 110.0), (4, 2): job(150.0, 143.0, (0.8, 0.76), (2.4, 2.3)),
               (1, 0): job(50.0, 50.0), (1, 3): job(40.0, 50.0, (0.5, 0.5))}
    rows = validate_speculation.speculation_rows(results)
    assert [(row["batch_size"], row["k"]) for row in rows] == [(1, 3), (4, 2)]
    row = rows[1]
    assert row["engine_speedup"] == pytest.approx(1.5)
    assert row["sim_speedup"] == pytest.approx(1.3)
    assert row["speedup_error_pct"] == pytest.approx((1.3 - 1.5) / 1.5 * 100)
    assert row["acceptance_error_pct"] == pytest.approx(-5.0)
    assert row["throughput_error_pct"] == pytest.approx(-100 * 7 / 150)
    summary = validate_speculation.summarize(rows, gate_pct=10.0)
    assert summary["max_abs_speedup_error_pct"] == pytest.approx(25.0)   # batch 1: 1.0 vs 0.8
    assert not summary["passed"]
    assert validate_speculation.summarize(rows[1:], gate_pct=15.0)["passed"]
    # A job whose engine accepted nothing while the simulator did: an infinite error fails.
    rows[1]["acceptance_error_pct"] = None
    assert not validate_speculation.summarize(rows[1:], gate_pct=15.0)["passed"]


def test_repeated_runs_count_by_their_medians():
    runs = [job(100.0, 90.0, (0.5, 0.6)), job(120.0, 90.0, (0.7, 0.6)), job(110.0, 95.0)]
    for run in runs:
        run["metrics"]["mean_tpot_ms"] = {"engine": 1.0, "sim": 1.0, "error_pct": 0.0}
    result = validate_speculation.median_result(runs)
    throughput = result["metrics"]["output_throughput"]
    assert (throughput["engine"], throughput["sim"]) == (110.0, 90.0)
    assert throughput["error_pct"] == pytest.approx(-20 / 110 * 100)
    assert result["metrics"]["spec_acceptance_rate"]["engine"] == 0.5
    assert result["engine_spread_pct"] == pytest.approx(20 / 110 * 100)
    assert result["num_runs"] == 3


# The tiny runs' acceptance side, measured: the engine's (greedy on fixed held-out prompts) and
# the simulator's (seeded draws from the shipped statistics) repeat exactly from run to run
# (not so their speedups: wall time on shared cores). Two requests x 8 tokens are too few for
# the two to agree within the 10 % gate; the stand-in tests below check that claim.
# drafter: (engine acceptance, sim acceptance, engine tokens/step, sim tokens/step)
TINY_ACCEPTANCE = {"tiny-pair-draft": (0.7, 0.806838, 2.0, 2.25),
                   "medusa": (0.166667, 0.272385, 1.555556, 1.826389),
                   "lookahead": (0.044118, 0.147714, 1.136364, 1.494571)}


def check_acceptance_side(row: dict, drafter: str) -> None:
    """The row's acceptance rates, tokens per step and their errors against the measured ones:
    the simulator's to 1e-4 (its draws are seeded); the engine's to 0.05 and 0.1 (a near-tie
    greedy token may fall the other way on another CPU)."""
    engine_rate, sim_rate, engine_tokens, sim_tokens = TINY_ACCEPTANCE[drafter]
    assert row["sim_acceptance"] == pytest.approx(sim_rate, abs=1e-4)
    assert row["sim_tokens_per_step"] == pytest.approx(sim_tokens, abs=1e-4)
    assert row["engine_acceptance"] == pytest.approx(engine_rate, abs=0.05)
    assert row["engine_tokens_per_step"] == pytest.approx(engine_tokens, abs=0.1)
    for name, (engine, sim) in {"acceptance": (row["engine_acceptance"], row["sim_acceptance"]),
                                "tokens_per_step": (row["engine_tokens_per_step"],
                                                    row["sim_tokens_per_step"])}.items():
        assert row[f"{name}_error_pct"] == pytest.approx((sim - engine) / engine * 100)


def test_tiny_end_to_end_on_the_trained_pair(tmp_path):
    out = tmp_path / "spec"
    status = validate_speculation.main(["--ks", "2", "--batch-sizes", "2", "--num-requests",
                                        "2", "--output-len", "8", "--prompt-len", "32",
                                        "--repeats", "2", "--sim-runs", "2", "--out", str(out)])
    result = json.loads((out / "speculation.json").read_text())
    [row] = result["rows"]
    assert (row["batch_size"], row["k"]) == (2, 2)
    check_acceptance_side(row, "tiny-pair-draft")
    # The row is the medians of the two rounds' validations; the speedup divides by k = 0's.
    runs = {k: [json.loads((out / f"b2-k{k}/run{repeat}/validation.json").read_text())
                for repeat in (0, 1)] for k in (0, 2)}
    throughput = {(k, side): statistics.median(run["metrics"]["output_throughput"][side]
                                               for run in runs[k])
                  for k in (0, 2) for side in ("engine", "sim")}
    for side in ("engine", "sim"):
        assert row[f"{side}_speedup"] == pytest.approx(throughput[2, side] / throughput[0, side])
    assert row["speedup_error_pct"] == pytest.approx(
        (row["sim_speedup"] - row["engine_speedup"]) / row["engine_speedup"] * 100)
    spreads = [(max(t) - min(t)) / statistics.median(t) * 100 for t in (
        [run["metrics"]["output_throughput"]["engine"] for run in runs[k]] for k in (0, 2))]
    assert row["engine_spread_pct"] == pytest.approx(max(spreads))
    # The default gate (10 %) decides on this run's errors, and the exit status follows it.
    within = all(error is not None and abs(error) <= 10
                 for error in (row["acceptance_error_pct"], row["speedup_error_pct"]))
    assert result["summary"]["gate_pct"] == 10.0
    assert result["summary"]["passed"] == within
    assert status == (0 if within else 1)
    for name in ("speculation.md", "speculation.png", "trace.csv", "b2-k0/run0/validation.json",
                 "b2-k2/run1/engine/summary.json"):
        assert (out / name).exists(), name
    # Each round's simulator runs draw from seeds of their own.
    seeds = [json.loads((out / f"b2-k2/run{repeat}/validation.json").read_text())["sim_seeds"]
             for repeat in (0, 1)]
    assert seeds == [[0, 1], [2, 3]]
    # The engine ran the trace's own prompts: held-out Python source, bytes.
    with open(out / "trace.csv") as handle:
        assert handle.readline().strip().endswith("prompt_token_ids")


def test_missing_profiles_are_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        validate_speculation.main(["--profiles", str(tmp_path), "--out", str(tmp_path / "o")])
    assert "tiny-pair.json" in capsys.readouterr().err


@pytest.mark.parametrize("drafter", ["medusa", "lookahead"])
def test_token_tree_drafters_validate_acceptance_length_and_speedup(tmp_path, drafter):
    """Medusa and lookahead through the same path, on the shipped token-tree profiles: k is the
    tree's depth, and the gate reads the acceptance length (tokens per step) and the speedup."""
    out = tmp_path / drafter
    status = validate_speculation.main(["--drafter", drafter, "--ks", "2", "--batch-sizes", "2",
                                        "--num-requests", "2", "--output-len", "8",
                                        "--prompt-len", "32", "--repeats", "2", "--sim-runs",
                                        "2", "--out", str(out)])
    result = json.loads((out / "speculation.json").read_text())
    assert result["drafter"] == drafter
    assert result["acceptance_statistics"].endswith(f"tiny-pair-{drafter}.json")
    [row] = result["rows"]
    assert (row["batch_size"], row["k"]) == (2, 2)
    check_acceptance_side(row, drafter)
    assert row["tokens_per_step_error_pct"] == pytest.approx(
        (row["sim_tokens_per_step"] - row["engine_tokens_per_step"])
        / row["engine_tokens_per_step"] * 100)
    summary = result["summary"]
    assert summary["gated_on"] == "tokens_per_step"
    within = all(abs(row[key]) <= 10 for key in ("tokens_per_step_error_pct",
                                                  "speedup_error_pct"))
    assert summary["passed"] == within and status == (0 if within else 1)
    engine = json.loads((out / "b2-k2/run0/engine/summary.json").read_text())
    assert engine["num_draft_tokens"] > 0


# ---- the gate's claim, on the simulator standing in for the engine ------------------------------

TINY_JOB = ["--ks", "2", "--batch-sizes", "2", "--num-requests", "2", "--output-len", "8",
            "--prompt-len", "32", "--repeats", "1", "--sim-runs", "1"]


# Within the gate on the acceptance rate's path, outside it on the tree drafters' (tokens/step).
@pytest.mark.parametrize("drafter, speculative_time_factor", [("tiny-pair-draft", 1.05),
                                                              ("medusa", 1.25)])
def test_gate_passes_and_fails_on_the_speedup_a_stand_in_engine_is_off_by(
        tmp_path, monkeypatch, drafter, speculative_time_factor):
    """The "engine" is the simulator with the same profiles, seeds and acceptance statistics
    (the same draws as the simulator's one run: acceptance and tokens per step agree exactly),
    its steps 1.1 times the profile's without speculation and 1.1 x `speculative_time_factor`
    times with: its speedup is the simulator's / factor, so the simulator's speedup error is
    factor - 1 (+5 % within the 10 % gate, +25 % outside it), whatever both runs' clock."""
    from test_validate import engine_replaced_by_noisy_scaled_simulator

    # A simulated engine has no machine speed to normalise to the profile's.
    monkeypatch.setattr(validate_speculation, "validate",
                        functools.partial(validate_speculation.validate, normalize_speed=False))
    # The engine runs k = 0, then k = 2.
    factors = [1.1, 1.1 * speculative_time_factor]
    taken = engine_replaced_by_noisy_scaled_simulator(monkeypatch, factors)
    out = tmp_path / "stand-in"
    status = validate_speculation.main(["--drafter", drafter, *TINY_JOB, "--out", str(out)])
    assert taken == factors
    result = json.loads((out / "speculation.json").read_text())
    [row] = result["rows"]
    assert row["acceptance_error_pct"] == row["tokens_per_step_error_pct"] == 0.0
    assert row["engine_acceptance"] > 0
    expected = (speculative_time_factor - 1) * 100
    assert row["speedup_error_pct"] == pytest.approx(expected, rel=1e-6)
    assert row["throughput_error_pct"] == pytest.approx((factors[1] - 1) * 100, rel=1e-6)
    summary = result["summary"]
    assert summary["max_abs_speedup_error_pct"] == pytest.approx(expected, rel=1e-6)
    within = speculative_time_factor < 1.1
    assert summary["passed"] == within and status == (0 if within else 1)
