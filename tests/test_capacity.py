"""Capacity search (sim/tools/capacity.py): the bisection on a known curve, the simulator's capacity
meeting the SLO at the capacity and missing it just above, and bad input."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sim.tools.capacity import SLO, compose_config, find_capacity, search_capacity
from sim.core.experiment import run_experiment

# 400 requests: enough that the queue past capacity shows in p99 TTFT/TPOT, ~0.2 s a probe.
CONFIG = ["workload.num_requests=400"]
SLO_UNDER_TEST = SLO(ttft_p99_ms=1000, tpot_p99_ms=100)
TOLERANCE = 0.05


def linear_latency(ms_per_rate: float):
    """A stand-in for the simulator: p99 latencies proportional to the rate."""
    def measure(rate: float) -> dict:
        return {"completed": 1, "p99_ttft_ms": ms_per_rate * rate,
                "p99_tpot_ms": ms_per_rate * rate / 10}
    return measure


# ---- the search itself, on a known curve ---------------------------------------------------------

def test_bisection_brackets_the_known_capacity():
    # p99 TTFT = 10 ms × rate meets 100 ms up to exactly 10 req/s.
    result = search_capacity(linear_latency(10.0), SLO(ttft_p99_ms=100), low=1, high=4,
                             tolerance=0.01)
    assert result.converged
    assert result.capacity <= 10.0 < result.lowest_violating <= result.capacity * 1.01
    rates = [probe.rate for probe in result.probes]
    assert rates[:3] == [1, 4, 8]  # high doubled while it still met the SLO


def test_low_is_halved_until_it_meets_the_slo():
    result = search_capacity(linear_latency(10.0), SLO(ttft_p99_ms=100), low=40, high=80,
                             tolerance=0.05)
    assert [probe.rate for probe in result.probes][:3] == [40, 20, 10]
    assert result.converged and result.capacity <= 10.0 < result.lowest_violating


def test_an_slo_met_nowhere_has_no_capacity():
    result = search_capacity(linear_latency(10.0), SLO(ttft_p99_ms=1e-9), low=1, high=2,
                             max_iters=5)
    assert result.capacity is None and not result.converged and len(result.probes) == 5


def test_the_probe_budget_is_kept():
    result = search_capacity(linear_latency(10.0), SLO(ttft_p99_ms=100), low=1, high=2,
                             tolerance=1e-6, max_iters=6)
    assert len(result.probes) == 6 and not result.converged
    assert result.capacity <= 10.0 < result.lowest_violating


# ---- on the simulator ----------------------------------------------------------------------------

def slo_met_at(rate: float) -> bool:
    summary = run_experiment(compose_config([*CONFIG, f"workload.rate={rate}"])).summary
    return SLO_UNDER_TEST.is_met(summary)


@pytest.fixture(scope="module")
def strict_capacity():
    return find_capacity(CONFIG, SLO_UNDER_TEST, low=2, high=8, tolerance=TOLERANCE)


def test_capacity_meets_the_slo_and_just_above_does_not(strict_capacity):
    result = strict_capacity
    assert result.converged
    at_capacity = next(probe for probe in result.probes if probe.rate == result.capacity)
    assert at_capacity.meets_slo and slo_met_at(result.capacity)
    assert not slo_met_at(result.capacity * (1 + 2 * TOLERANCE))
    # The per-request view rides along: at capacity nearly every request met the SLO.
    assert at_capacity.summary["slo_attainment"] >= 0.95


def test_a_looser_slo_gives_a_higher_capacity(strict_capacity):
    loose = find_capacity(CONFIG, SLO(ttft_p99_ms=1000, tpot_p99_ms=150), low=2, high=8,
                          tolerance=TOLERANCE)
    assert loose.capacity > strict_capacity.lowest_violating


def test_cli_writes_json_and_plot(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "sim.tools.capacity", "workload.num_requests=100", "--ttft-p99-ms",
         "1000", "--tpot-p99-ms", "100", "--low", "8", "--high", "16", "--tolerance", "0.3",
         "--out", "out"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "out" / "capacity.json").read_text())
    assert report["slo"] == {"ttft_p99_ms": 1000.0, "tpot_p99_ms": 100.0}
    assert report["converged"] and report["capacity"] is not None
    assert report["capacity"] in [probe["rate"] for probe in report["probes"] if probe["meets_slo"]]
    assert (tmp_path / "out" / "capacity.png").stat().st_size > 0
    assert "capacity:" in result.stdout


# ---- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    ({"low": 0}, "--low"),
    ({"low": 4, "high": 2}, "--high"),
    ({"tolerance": 0}, "--tolerance"),
    ({"max_iters": 1}, "--max-iters"),
])
def test_bad_search_arguments_name_the_option(kwargs, message):
    with pytest.raises(ValueError, match=message):
        find_capacity(CONFIG, SLO_UNDER_TEST, **kwargs)


def test_bad_slo_and_config_are_refused():
    with pytest.raises(ValueError, match="at least one SLO"):
        SLO()
    with pytest.raises(ValueError, match="tpot_p99_ms"):
        SLO(ttft_p99_ms=100, tpot_p99_ms=-1)
    with pytest.raises(ValueError, match="workload.rate is what the search varies"):
        find_capacity(["workload.rate=5"], SLO_UNDER_TEST)
    with pytest.raises(ValueError, match="no rate to search"):
        find_capacity(["workload=trace"], SLO_UNDER_TEST)


@pytest.mark.parametrize("args, message", [
    (["--low", "abc"], "--low"),                                # argparse's own errors
    (["workload.num_requests=20"], "at least one SLO"),           # ours
    (["scheduler=fastest", "--ttft-p99-ms", "100"], "scheduler"),  # Hydra's
    (["workload.num_requests=-3", "--ttft-p99-ms", "100"], "workload.num_requests"),  # the run's
])
def test_cli_errors_are_one_line(tmp_path, args, message):
    result = subprocess.run([sys.executable, "-m", "sim.tools.capacity", *args, "--out", "out"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
