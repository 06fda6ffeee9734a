"""The GPU cost model as the default: the roofline fallback where no GPU measurement reaches,
the expected error in the summary, workstation boards' efficiencies and fitted-terms files."""
from __future__ import annotations

import dataclasses
import json

import pytest

from runtime.policy_config import CONF_DIR
import sim.core.say_once as say_once_module
from sim.core.experiment import run_experiment
from sim.cost.roofline import RooflineCostModel
from runtime.specs import HardwareSpec
from sim.cost.gpu.cost_model import GPUCostModel

from factories import decode_plan, hardware_spec, make_cfg, model_spec


def test_the_default_cost_model_is_the_gpu_one_with_its_expected_error():
    result = run_experiment(make_cfg("workload.num_requests=20"), plots=False)
    assert isinstance(result.replicas[0].executor.cost_model, GPUCostModel)
    stated = result.replicas[0].executor.cost_model.expected_error_pct
    for metric in ("ttft", "tpot", "e2e"):
        assert result.summary[f"expected_{metric}_error_pct"] == pytest.approx(stated[metric])
    assert str(stated["checks"]) in result.summary["expected_error_basis"]
    assert result.summary["cost_model_kernels"] == "vLLM 0.14.0 on a100_sxm"   # the default A100


def test_hardware_without_gpu_measurements_falls_back_to_the_roofline_saying_so(capsys,
                                                                                monkeypatch):
    monkeypatch.setattr(say_once_module, "_SAID", set())
    overrides = ("model=tiny-llama", "hardware=cpu", "workload.num_requests=5",
                 "kv_cache.block_size=8")
    first = run_experiment(make_cfg(*overrides), plots=False)
    cost_model = first.replicas[0].executor.cost_model
    assert type(cost_model) is RooflineCostModel and cost_model.block_size == 8
    assert "expected_tpot_error_pct" not in first.summary
    run_experiment(make_cfg(*overrides), plots=False)
    lines = [line for line in capsys.readouterr().err.splitlines() if "cost_model=roofline" in line]
    assert len(lines) == 1 and "hardware=cpu" in lines[0]   # once a process


def test_a_named_roofline_says_nothing(capsys, monkeypatch):
    monkeypatch.setattr(say_once_module, "_SAID", set())
    run_experiment(make_cfg("cost_model=roofline", "model=tiny-llama", "hardware=cpu",
                            "workload.num_requests=5"), plots=False)
    assert "roofline" not in capsys.readouterr().err


def test_the_fallback_carries_the_settings_the_roofline_takes(monkeypatch, tmp_path):
    """cost_model.* overrides of the GPU model reach the roofline it falls back to, a terms
    file's terms among them, as they reach a named roofline."""
    monkeypatch.setattr(say_once_module, "_SAID", set())
    run = ("model=tiny-llama", "hardware=cpu", "workload.num_requests=5")
    named = run_experiment(make_cfg(*run, "cost_model=roofline", "cost_model.step_overhead_s=0.02",
                                    "cost_model.compute_efficiency=0.3"), plots=False)
    fell_back = run_experiment(make_cfg(*run, "cost_model.step_overhead_s=0.02",
                                        "+cost_model.compute_efficiency=0.3"), plots=False)
    cost_model = fell_back.replicas[0].executor.cost_model
    assert type(cost_model) is RooflineCostModel and cost_model.step_overhead_s == 0.02
    assert fell_back.summary["mean_ttft_ms"] == named.summary["mean_ttft_ms"]
    terms = tmp_path / "fit.json"
    terms.write_text(json.dumps({"terms": {"per_sequence_overhead_s": 0.001}}))
    from_file = run_experiment(make_cfg(*run, f"cost_model.terms_file={terms}"), plots=False)
    assert from_file.replicas[0].executor.cost_model.per_sequence_overhead_s == 0.001


def test_the_fallback_refuses_in_one_line_the_settings_the_roofline_does_not_take():
    with pytest.raises(ValueError) as refused:
        run_experiment(make_cfg("model=tiny-llama", "hardware=cpu", "workload.num_requests=5",
                                "cost_model.kernel_tables=vidur", "cost_model.step_overhead_s=0.02",
                                "cost_model.cuda_graph_max_tokens=0"), plots=False)
    message = str(refused.value)
    assert message.startswith("cost_model.kernel_tables, cost_model.cuda_graph_max_tokens: not "
                              "a setting of cost_model=roofline") and "\n" not in message
    assert "step_overhead_s" not in message and "hardware=cpu" in message


def workstation(name: str = "a100-80gb") -> HardwareSpec:
    return dataclasses.replace(hardware_spec(name), name="a100-as-workstation",
                               board="workstation")


def test_workstation_efficiencies_scale_only_workstation_boards():
    plan = decode_plan(8, 500)
    # The Vidur tables' path: the workstation efficiency scales their transfer to a board.
    terms = dict(step_overhead_s=0.0, per_sequence_overhead_s=0.0, kernel_tables="vidur")
    datacenter = GPUCostModel(model_spec("llama-3-8b"), hardware_spec("a100-80gb"), **terms)
    assert GPUCostModel(model_spec("llama-3-8b"), hardware_spec("a100-80gb"),
                        workstation_bandwidth_efficiency=2.0, **terms
                        ).step_time(plan) == datacenter.step_time(plan)
    # The same chip called a workstation board, at efficiency 1, is predicted as measured (but
    # for the transfer off its own table's name); at 2, its memory-bound decode is much faster.
    same = GPUCostModel(model_spec("llama-3-8b"), workstation(), **terms).step_time(plan)
    faster = GPUCostModel(model_spec("llama-3-8b"), workstation(),
                          workstation_bandwidth_efficiency=2.0, **terms).step_time(plan)
    assert same == pytest.approx(datacenter.step_time(plan), rel=0.02)
    assert 0.45 < faster / same < 0.7


def test_a_terms_file_replaces_the_configured_terms(tmp_path):
    path = tmp_path / "fit.json"
    path.write_text(json.dumps({"terms": {"step_overhead_s": 0.004,
                                          "workstation_bandwidth_efficiency": 1.5}}))
    model = GPUCostModel(model_spec("llama-3.1-8b"), hardware_spec("rtx-4090"),
                         step_overhead_s=0.001, terms_file=str(path))
    assert model.step_overhead_s == 0.004 and model.workstation_bandwidth_efficiency == 1.5
    assert str(path) in model.describe()["engine"]
    path.write_text(json.dumps({"step_overhead_s": 1}))
    with pytest.raises(ValueError, match="terms_file=.*not a twinserve-calibrate profile"):
        GPUCostModel(model_spec("llama-3.1-8b"), hardware_spec("rtx-4090"), terms_file=str(path))
    # A calibrated whole-config key is not dropped without a word: it goes on the command line.
    path.write_text(json.dumps({"terms": {"step_overhead_s": 0.004,
                                          "cluster.frontend_latency_s": 0.03}}))
    with pytest.raises(ValueError, match=r"terms_file=.*: cluster.frontend_latency_s not a term "
                                         r".*command line instead: cluster.frontend_latency_s=0.03"):
        GPUCostModel(model_spec("llama-3.1-8b"), hardware_spec("rtx-4090"), terms_file=str(path))
    with pytest.raises(ValueError, match="terms_file=.*no such file"):
        GPUCostModel(model_spec("llama-3.1-8b"), hardware_spec("rtx-4090"),
                     terms_file=str(tmp_path / "missing.json"))


def test_board_is_checked_by_name():
    with pytest.raises(ValueError, match="board must be one of"):
        dataclasses.replace(hardware_spec("a100-80gb"), board="laptop")
    assert hardware_spec("rtx-4090").board == "workstation"
    assert hardware_spec("h100-80gb").board == "datacenter"


def test_shipped_files_are_found_from_any_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = GPUCostModel(model_spec("llama-3.1-8b"), hardware_spec("rtx-4090"),
                         terms_file="profiles/gpu/vllm-0.19.json")
    shipped = json.loads((CONF_DIR.parent / "profiles" / "gpu" / "vllm-0.19.json")
                         .read_text())["terms"]
    assert model.step_overhead_s == shipped["step_overhead_s"]
