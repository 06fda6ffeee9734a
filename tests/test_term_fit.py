"""fit_terms: the coordinate search that calibrates cost-model terms against replays."""
import math

import pytest

from calibration.term_fit import fit_terms


def test_recovers_the_minimum_of_a_separable_loss():
    target = {"step_overhead_s": 3.2e-3, "per_sequence_overhead_s": 4.5e-5}

    def loss(terms):
        return sum(math.log(terms[name] / value) ** 2 for name, value in target.items())

    fitted, best = fit_terms(loss, {"step_overhead_s": 1e-3, "per_sequence_overhead_s": 1e-5},
                             {"step_overhead_s": (1e-5, 1e-1),
                              "per_sequence_overhead_s": (1e-7, 1e-3)}, tolerance=0.001)
    for name, value in target.items():
        assert fitted[name] == pytest.approx(value, rel=0.01)
    assert best < 1e-4


def test_coupled_terms_converge_over_passes():
    # Only the sum is determined by the first term alone: the second pass corrects it.
    def loss(terms):
        return (math.log(terms["a"] + terms["b"]) - math.log(3.0)) ** 2 \
            + (math.log(terms["b"]) - math.log(1.0)) ** 2

    fitted, _ = fit_terms(loss, {"a": 0.1, "b": 0.1}, {"a": (0.01, 100), "b": (0.01, 100)},
                          passes=6, tolerance=0.001)
    assert fitted["a"] == pytest.approx(2.0, rel=0.02)
    assert fitted["b"] == pytest.approx(1.0, rel=0.02)


def test_keeps_the_initial_point_when_nothing_is_lower():
    calls = []

    def loss(terms):
        calls.append(dict(terms))
        return 0.0 if terms["a"] == 5.0 else 1.0

    fitted, best = fit_terms(loss, {"a": 5.0}, {"a": (1.0, 10.0)})
    assert fitted == {"a": 5.0} and best == 0.0
    assert len(calls) < 40   # a golden-section search, not a scan


def test_bounds_are_checked_by_name():
    with pytest.raises(ValueError, match="no bounds for term 'b'"):
        fit_terms(lambda terms: 0.0, {"a": 1.0, "b": 1.0}, {"a": (0.1, 10)})
    with pytest.raises(ValueError, match="bounds for 'a'"):
        fit_terms(lambda terms: 0.0, {"a": 1.0}, {"a": (0.0, 10)})
