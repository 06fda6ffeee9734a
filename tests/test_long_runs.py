"""Long runs in bounded memory (issue 41): a run of more than metrics.max_kept_requests folds its
finished requests into running totals and quantile sketches and drops them; its summary equals
the exact one but for the sketched percentiles, within the sketch's stated bound."""
import csv
import gc

import numpy as np
import pytest
from factories import make_cfg

from policies.routing import RoundRobinRouter
from policies.types import Request
from sim.core.experiment import run_experiment
from runtime.metrics import recorder, streaming
from runtime.metrics.streaming import RELATIVE_ACCURACY, QuantileSketch

WORKLOAD = ["workload.num_requests=1200", "workload.rate=40", "cluster.num_replicas=2",
            "++workload.classes=[{share: 0.5, tenant: a, priority: 1}, "
            "{share: 0.5, tenant: b, slo_ttft_ms: 100}]", "slo.tpot_ms=40"]
# Keys only the exact run has (the windowed fairness needs every request's times) or only the
# streamed one has.
EXACT_ONLY = ("fairness_window_s", "fairness_windows", "max_backlogged_service_diff",
              "windowed_jain_fairness", "backlogged_windows", "mean_backlogged_service")
# Short requests at a rate one replica keeps up with: few are unfinished at any time.
SHORT_REQUESTS = ("++workload.prompt_len={dist: fixed, value: 64}",
                  "++workload.output_len={dist: fixed, value: 16}")
STREAMED_ONLY = ("streamed_requests", "quantile_relative_accuracy")
SKETCHED = ("median_", "p90_", "p99_")


def within_bound(sketched: float, exact: float) -> bool:
    return abs(sketched - exact) <= RELATIVE_ACCURACY * abs(exact) * (1 + 1e-9)


@pytest.mark.parametrize("weighted", [False, True])
def test_the_sketch_is_within_its_relative_accuracy_of_numpys_percentiles(weighted):
    rng = np.random.default_rng(0)
    values = rng.lognormal(-3.0, 1.5, 20_000)
    weights = rng.integers(1, 5, values.size) if weighted else None
    sketch = QuantileSketch()
    for chunk in range(0, values.size, 3000):   # added in pieces, as a run folds them
        sketch.add(values[chunk:chunk + 3000],
                   None if weights is None else weights[chunk:chunk + 3000])
    percentiles = [0, 1, 50, 90, 99, 99.9, 100]
    exact = np.percentile(np.repeat(values, weights) if weighted else values, percentiles)
    assert all(map(within_bound, sketch.percentiles(percentiles), exact))
    expanded = np.repeat(values, weights) if weighted else values
    assert sketch.mean() == pytest.approx(expanded.mean(), rel=1e-12)
    assert len(sketch.bucket_counts) < 8000   # its size is the buckets met, not the count


def flat(summary: dict, prefix: str = "") -> dict:
    items = {}
    for key, value in summary.items():
        if isinstance(value, dict):
            items.update(flat(value, f"{prefix}{key}."))
        else:
            items[prefix + key] = value
    return items


@pytest.fixture
def small_chunks(monkeypatch):
    """Fold and spill in small pieces, so that a small run does it many times."""
    monkeypatch.setattr(streaming, "FOLD_CHUNK", 64)
    monkeypatch.setattr(recorder, "SPILL_AT_ROWS", 200)
    monkeypatch.setattr(recorder, "SPILL_KEEP_ROWS", 100)


def csv_rows(path) -> list:
    with open(path, newline="") as file:
        return sorted(map(tuple, csv.reader(file)))


def late_second_tenant_trace(path) -> list[str]:
    """A trace whose second tenant and priority first come after a few folded chunks."""
    rows = ["arrival_time,prompt_len,output_len,tenant,priority"]
    for index in range(800):
        late = index >= 300 and index % 2
        rows.append(f"{index * 0.05:.2f},{64 + index % 200},{8 + index % 50},"
                    f"{'b' if late else 'a'},{1 if late else 0}")
    path.write_text("\n".join(rows) + "\n")
    return ["workload=trace", f"workload.trace_path={path}", "cluster.num_replicas=2"]


@pytest.mark.parametrize("workload", ["classes", "late second tenant", "clients giving up"])
def test_a_streamed_runs_summary_and_files_equal_the_exact_ones(tmp_path, small_chunks, workload):
    overrides = {"classes": WORKLOAD, "clients giving up": WORKLOAD + ["workload.rate=10",
                                                                       "workload.timeout_s=3"],
                 }.get(workload) or late_second_tenant_trace(tmp_path / "trace.csv")
    exact = run_experiment(make_cfg(*overrides), out_dir=tmp_path / "exact", plots=False)
    assert (exact.summary.get("abandoned", 0) > 0) == (workload == "clients giving up")
    streamed = run_experiment(make_cfg(*overrides, "++metrics.max_kept_requests=100"),
                              out_dir=tmp_path / "streamed", plots=False)
    assert exact.requests and streamed.requests == []
    assert set(exact.summary["per_tenant"]) == {"a", "b"}
    exact_keys, streamed_keys = flat(exact.summary), flat(streamed.summary)
    assert {key for key in exact_keys if key.rsplit(".", 1)[-1] not in EXACT_ONLY} == {
        key for key in streamed_keys if key not in STREAMED_ONLY}
    for key, value in streamed_keys.items():
        name = key.rsplit(".", 1)[-1]
        if name in STREAMED_ONLY or "wall" in name or name == "sim_speedup":
            continue
        if name.startswith(SKETCHED) and name.endswith("_ms"):
            assert within_bound(value, exact_keys[key]), key
        elif isinstance(value, float):
            assert value == pytest.approx(exact_keys[key], rel=1e-12), key
        else:
            assert value == exact_keys[key], key
    assert streamed.summary["streamed_requests"] is True
    # The same rows, in another order (requests as they finished, steps as recorded).
    for name in ("requests.csv", "steps.csv"):
        assert csv_rows(tmp_path / "streamed" / name) == csv_rows(tmp_path / "exact" / name)


class CountingRouter(RoundRobinRouter):
    """Round robin that counts the Request objects alive at every 50th arrival."""

    def __init__(self):
        super().__init__()
        self.num_routed = 0
        self.most_alive = 0

    def route(self, request, replicas):
        self.num_routed += 1
        if self.num_routed % 50 == 0:
            gc.unfreeze()   # (the run froze what it held at its start: count those too)
            alive = sum(1 for thing in gc.get_objects() if isinstance(thing, Request))
            gc.freeze()
            CountingRouter.most_alive = max(CountingRouter.most_alive, alive)
        return super().route(request, replicas)


@pytest.mark.parametrize("streamed", [True, False])
def test_a_streamed_run_holds_a_bounded_number_of_requests(small_chunks, streamed):
    CountingRouter.most_alive = 0
    gc.collect()   # (earlier tests' requests, not this run's)
    limit = 100 if streamed else 10_000
    run_experiment(make_cfg("workload.num_requests=3000", "workload.rate=40", *SHORT_REQUESTS,
                            "cluster.router=test_long_runs.CountingRouter",
                            f"++metrics.max_kept_requests={limit}"))
    if streamed:   # the unfinished ones and a chunk or two waiting to be folded
        assert CountingRouter.most_alive < 600
    else:          # every request, made before the run
        assert CountingRouter.most_alive >= 3000


def test_a_run_under_the_limit_keeps_every_request_and_says_nothing_streamed():
    result = run_experiment(make_cfg("workload.num_requests=200",
                                     "++metrics.max_kept_requests=200"))
    assert len(result.requests) == 200 and "streamed_requests" not in result.summary


def test_a_run_that_needs_every_request_keeps_them_and_says_why(capsys):
    result = run_experiment(make_cfg("workload.num_requests=300", "trace_export=true",
                                     "++metrics.max_kept_requests=100"))
    assert len(result.requests) == 300 and "streamed_requests" not in result.summary
    assert "because of trace_export=true" in capsys.readouterr().err


def test_a_bad_limit_is_refused_naming_its_key():
    with pytest.raises(ValueError, match="metrics.max_kept_requests"):
        run_experiment(make_cfg("workload.num_requests=10", "++metrics.max_kept_requests=0"))
