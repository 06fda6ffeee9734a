"""The windowed fairness of the summary (runtime/metrics/fairness.py): its per-window service is
what VTC's own counters charged, window by window; it separates FCFS from VTC where the
whole-run Jain index cannot, with VTC inside the bound of its paper and FCFS outside it; its
backlog test, keys, console rows, report labels and config check."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from factories import make_cfg
from policies.batching import VirtualTokenCounterScheduler
from policies.batching.vtc import INPUT_WEIGHT, OUTPUT_WEIGHT
from policies.types import Request, Sequence, SequenceStatus
from sim.core.experiment import run_experiment
from runtime.metrics import MetricsCollector
from runtime.metrics.fairness import (backlogged_by_window, decode_step_ends, service_by_window,
                                       window_edges)
from sim.tools.console_summary import format_summary_table
from sim.tools.report_labels import metric_heading, metric_label

torch.set_num_threads(1)

PROMPT_LEN = OUTPUT_LEN = 128
MAX_NUM_SEQS = 8
# 8 sequences of fixed lengths offered about 4x what they serve: both tenants stay backlogged.
OVERLOADED = ["workload.num_requests=600", "workload.rate=20",
              f"scheduler.max_num_seqs={MAX_NUM_SEQS}",
              f"++workload.prompt_len={{dist: fixed, value: {PROMPT_LEN}}}",
              f"++workload.output_len={{dist: fixed, value: {OUTPUT_LEN}}}",
              "++workload.classes=[{share: 0.8, tenant: heavy}, {share: 0.2, tenant: light}]"]


def vtc_bound(num_kv_blocks: int, block_size: int) -> float:
    """VTC's bound on two backlogged tenants' service difference over any interval (Sheng et
    al., OSDI 2024, Theorem 4.4): 2 max(w_p L_input, w_q M), M the tokens a running batch can
    hold; here at most max_num_seqs requests of PROMPT_LEN + OUTPUT_LEN (and the KV pool)."""
    batch_tokens = min(num_kv_blocks * block_size, MAX_NUM_SEQS * (PROMPT_LEN + OUTPUT_LEN))
    return 2 * max(INPUT_WEIGHT * PROMPT_LEN, OUTPUT_WEIGHT * batch_tokens)


def test_per_window_service_is_what_vtc_charged(monkeypatch):
    """The summary's service per tenant and window, from request times and step rows, equals
    the sum of the scheduler's own counter charges in the window (each step its own event, so
    that every charge has its step's time)."""
    charges = []
    schedule, update, charge = (VirtualTokenCounterScheduler.schedule,
                                VirtualTokenCounterScheduler.update,
                                VirtualTokenCounterScheduler._charge)

    def timed_schedule(self, now):
        self.charge_time = now
        return schedule(self, now)

    def timed_update(self, plan, result, now):
        self.charge_time = now
        return update(self, plan, result, now)

    def logged_charge(self, tenant, service):
        charges.append((self.charge_time, tenant, service))
        charge(self, tenant, service)

    monkeypatch.setattr(VirtualTokenCounterScheduler, "schedule", timed_schedule)
    monkeypatch.setattr(VirtualTokenCounterScheduler, "update", timed_update)
    monkeypatch.setattr(VirtualTokenCounterScheduler, "_charge", logged_charge)
    result = run_experiment(make_cfg("scheduler=vtc", "backend.repeated_steps=false",
                                     *OVERLOADED), plots=False)
    assert result.summary["num_preemptions"] == 0   # where the even spread is exact
    edges = window_edges(result.requests, 7.0)
    assert len(edges) > 5
    estimated = service_by_window(result.requests, decode_step_ends(result.metrics), edges)
    times = np.array([time for time, _, _ in charges])
    for tenant in ("heavy", "light"):
        amounts = np.array([amount if who == tenant else 0 for _, who, amount in charges])
        charged = np.diff([amounts[times <= edge].sum() for edge in edges])
        np.testing.assert_allclose(estimated[tenant], charged, rtol=1e-9)


def test_windowed_fairness_separates_vtc_from_fcfs_within_vtc_bound():
    """Every request completes, so the whole-run Jain index is the demand ratio under both; in
    the 10 s windows (conf/config.yaml) where both tenants waited, FCFS serves them 4:1 and VTC
    alike, its largest difference inside its bound and FCFS's outside."""
    runs = {scheduler: run_experiment(make_cfg(f"scheduler={scheduler}", *OVERLOADED),
                                      plots=False)
            for scheduler in ("continuous", "vtc")}
    fcfs, vtc = runs["continuous"].summary, runs["vtc"].summary
    assert fcfs["completed"] == vtc["completed"] == 600
    assert fcfs["jain_fairness"] == pytest.approx(vtc["jain_fairness"], rel=1e-12)
    assert vtc["fairness_window_s"] == 10.0
    assert fcfs["fairness_windows"] >= 3 and vtc["fairness_windows"] >= 3
    bound = vtc_bound(vtc["num_kv_blocks"], runs["vtc"].replicas[0].scheduler.kv_cache.block_size)
    assert vtc["max_backlogged_service_diff"] <= bound < fcfs["max_backlogged_service_diff"]
    assert vtc["windowed_jain_fairness"] > 0.98 > fcfs["windowed_jain_fairness"] + 0.15
    light, heavy = fcfs["per_tenant"]["light"], fcfs["per_tenant"]["heavy"]
    assert heavy["mean_backlogged_service"] > 3 * light["mean_backlogged_service"]
    assert light["backlogged_windows"] == fcfs["fairness_windows"]


def done(request_id: int, tenant: str, arrival: float, admitted: float, first_token: float,
         finish: float, prompt_len: int = 10, output_len: int = 5) -> Request:
    request = Request(request_id, arrival, prompt_len, output_len, tenant=tenant)
    seq = Sequence(request_id, request, num_output_tokens=output_len)
    seq.status = SequenceStatus.FINISHED
    request.sequences = [seq]
    request.first_scheduled_time, request.first_token_time = admitted, first_token
    request.finish_time = finish
    return request


def test_backlog_and_service_by_window_by_hand():
    """Windows of 1 s from 0: tenant a waits over [0, 1.2) and [1.1, 2.5) (one backlog, 0 to
    2.5), b over [0.5, 3.2); both wait all of [1, 2) only. Without step rows the later tokens
    are spread evenly in time."""
    requests = [done(0, "a", 0.0, 1.2, 1.4, 1.8),
                done(1, "a", 1.1, 2.5, 2.6, 3.4),
                done(2, "b", 0.5, 3.2, 3.3, 4.3)]
    edges = window_edges(requests, 1.0)
    assert edges.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert backlogged_by_window(requests[:2], edges).tolist() == [True, True, False, False]
    assert backlogged_by_window(requests[2:], edges).tolist() == [False, True, True, False]
    service = service_by_window(requests, {}, edges)
    # Request 0: prompt 10 at 1.2, first token 2 at 1.4, 4 more x 2 over (1.4, 1.8]: all in [1, 2).
    # Request 1: prompt at 2.5, first token at 2.6, the rest 0.4 / 0.8 of the way in [2, 3).
    assert service["a"].tolist() == pytest.approx([0, 20, 10 + 2 + 8 * 0.5, 8 * 0.5])
    assert service["b"].tolist() == pytest.approx([0, 0, 0, 10 + 2 + 8 * 0.7])
    summary = MetricsCollector().summary(requests, 1.0, fairness_window_s=1.0)
    assert summary["fairness_windows"] == 1
    assert summary["max_backlogged_service_diff"] == pytest.approx(20.0)
    assert summary["windowed_jain_fairness"] == pytest.approx(0.5)   # a got it all
    assert summary["per_tenant"]["a"]["mean_backlogged_service"] == pytest.approx(20.0)
    assert summary["per_tenant"]["b"]["backlogged_windows"] == 1


def test_the_table_and_the_report_name_the_windowed_keys():
    summary = run_experiment(make_cfg("scheduler=continuous", *OVERLOADED,
                                      "workload.num_requests=200"), plots=False).summary
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(format_summary_table(summary))
    text = console.export_text()
    assert "windowed Jain 10 s" in text and "max gap 10 s" in text
    assert "tok/window backlogged" in text
    for key in ("windowed_jain_fairness", "max_backlogged_service_diff",
                "per_tenant.light.mean_backlogged_service"):
        assert metric_label(key) != key and metric_heading(key) != key


def test_a_bad_window_names_its_key():
    with pytest.raises(ValueError, match="metrics.fairness_window_s must be a positive number"):
        run_experiment(make_cfg(*OVERLOADED, "workload.num_requests=20",
                                "metrics.fairness_window_s=0"), plots=False)
