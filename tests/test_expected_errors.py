"""Stated expected errors come from leave-out checks of the run's kind (sim/cost/gpu/expected_errors.py),
and a version's engine terms are the ones that close its rows' TPOT gap (calibration/engine_terms.py)."""
import pytest

import calibration.engine_terms as engine_terms
from sim.cost.gpu.expected_errors import (expected_errors_for, kind_of, leave_one_out_coverage,
                                     percentile_abs)


def check(errors, **kind):
    base = kind_of("vllm", True, 2, False, False)
    base.update(kind)
    return {"check": "hand-made", "kind": base,
            "error_pct": {"ttft": errors[0], "tpot": errors[1], "e2e": errors[2]}}


def test_the_stated_error_is_the_rank_that_covers_a_new_run_eight_times_in_ten():
    # ceil(0.8 x 11) = 9: the 9th of 10, where the plain 80th percentile (8.2) covers less.
    assert percentile_abs([1, -2, 3, -4, 5, 6, -7, 8, 9, -10]) == 9
    assert percentile_abs([1, 2, 3, 4, 5, 6, 7, 8, 9]) == 8   # ceil(0.8 x 10) = 8, exactly
    assert percentile_abs([5, 1, 2, 3, 4]) == 5                # ceil(4.8) = 5
    assert percentile_abs([-3, 1]) == 3   # fewer than five: the largest


def test_leave_one_out_coverage_reaches_the_promise_on_any_errors():
    for count in (5, 9, 10, 37, 150):
        checks = [check((e, e, e)) for e in range(1, count + 1)]
        assert leave_one_out_coverage(checks)["ttft"] >= 0.8


def test_coverage_judges_each_check_on_what_the_others_state():
    # Each of five is judged on the other four's largest |error|: all but the largest within.
    checks = [check((e, -e, 2 * e)) for e in (1, 2, 3, 4, 5)]
    assert leave_one_out_coverage(checks) == {"ttft": 0.8, "tpot": 0.8, "e2e": 0.8}
    # A check whose kernels no other shares has nothing stated for it: not covered.
    alone = check((0.1, 0.1, 0.1), kernels="vidur")
    assert leave_one_out_coverage([*checks, alone])["ttft"] == pytest.approx(4 / 6)


def test_a_run_takes_the_checks_of_its_own_kind():
    checks = ([check((10, 2, 3)) for _ in range(5)]
              + [check((50, 20, 30), precision="fp8") for _ in range(5)])
    bf16 = expected_errors_for(kind_of("vllm", True, 2, False, False), checks)
    fp8 = expected_errors_for(kind_of("vllm", True, 2, False, True), checks)
    assert (bf16["ttft"], bf16["tpot"], bf16["e2e"], bf16["checks"]) == (10, 2, 3, 5)
    assert (fp8["ttft"], fp8["tpot"]) == (50, 20)
    assert fp8["basis"] == "vllm, open, fp8, dense, exact, tp>1"


def test_too_few_of_its_kind_widens_to_the_leading_keys():
    checks = [check((10, 2, 3)) for _ in range(4)] + [check((40, 8, 9), tp="tp1")]
    stated = expected_errors_for(kind_of("vllm", True, 2, False, False), checks)
    assert stated["checks"] == 5 and stated["basis"] == "vllm, open, bf16, dense, exact"
    assert stated["tpot"] == 8   # ceil(0.8 x 6) = 5th of 2, 2, 2, 2 and the tp1 8
    assert expected_errors_for(kind_of("vidur", True, 1, False, False), checks) is None


def test_open_arrivals_are_judged_on_open_checks_while_any_exists():
    """A run whose queue sets its latencies is not judged on closed-loop benchmarks, however
    many: two open checks state their largest |error|."""
    closed = [check((10, 2, 3), arrivals="closed") for _ in range(20)]
    open_checks = [check((-30, 9, -12)), check((15, -4, 6))]
    stated = expected_errors_for(kind_of("vllm", True, 2, False, False), closed + open_checks)
    assert (stated["ttft"], stated["tpot"], stated["e2e"], stated["checks"]) == (30, 9, 12, 2)
    assert stated["basis"] == "vllm, open"
    loop = expected_errors_for(kind_of("vllm", True, 2, False, False, closed_loop=True),
                               closed + open_checks)
    assert (loop["tpot"], loop["checks"]) == (2, 20)


def test_a_closed_loop_run_states_the_closed_loop_checks():
    from factories import make_cfg
    from sim.core.experiment import run_experiment
    common = ("hardware=h100-80gb", "model=llama-2-7b", "workload.num_requests=20")
    runs = {name: run_experiment(make_cfg(*common, *overrides)).summary for name, overrides in (
        ("open", ()), ("closed", ("workload=closed_loop", "workload.num_requests=20")))}
    assert "closed" in runs["closed"]["expected_error_basis"]
    assert "open" in runs["open"]["expected_error_basis"]


def test_the_shipped_checks_state_an_error_for_an_h100_run():
    from factories import hardware_spec, model_spec
    from sim.cost.gpu.cost_model import GPUCostModel
    model = GPUCostModel(model_spec("llama-2-70b"), hardware_spec("h100-80gb"), 4)
    stated = model.expected_error_pct
    assert stated["checks"] >= 2 and stated["tpot"] > 0 and stated["ttft"] > 0
    assert stated["basis"].startswith("vllm, open")
    assert model.prediction_kind["kernels"] == "vllm"


def test_engine_terms_close_the_tpot_gap(monkeypatch):
    """Rows whose zero-overhead replay is short of the truth by a + b x concurrency give back
    a and b."""
    step_s, per_sequence_s = 1.2e-3, 30e-6
    rows = [{"concurrency": c, "real_tpot_ms": real, "sim_tpot_ms":
             real - 1e3 * (step_s + per_sequence_s * c)}
            for c, real in ((8, 18.0), (16, 20.0), (64, 40.0), (128, 55.0))]
    monkeypatch.setattr(engine_terms, "compare_rows", lambda _rows, overrides: {"rows": rows})
    fitted = engine_terms.fit_terms(["four rows"])
    assert fitted == pytest.approx((step_s, per_sequence_s), rel=1e-9)
