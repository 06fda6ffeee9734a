"""Energy per token (sim/core/energy, docs/energy.md): the step's work against a hand-written
reference, the power model's idle floor, cap and busy terms, tensor parallelism's boards, the
summary keys of every run (sim and engine backends, pools), and config errors by key."""
from __future__ import annotations

import math

import pytest
from omegaconf import OmegaConf

from policies.types import StepPlan
from sim.core.energy.meter import EnergyMeter, build_energy_meter, build_power_model
from sim.core.energy.power import UtilisationPowerModel
from sim.core.energy.summary import energy_summary
from sim.cost.work import ModelStepWork
from sim.core.experiment import run_experiment
from sim.cost.roofline import RooflineCostModel
from runtime.specs import HardwareSpec
from tests.factories import decode_plan, hardware_spec, make_cfg, model_spec

ENERGY_KEYS = ("energy_j", "avg_power_w", "joules_per_output_token", "tokens_per_joule")


def prefill_plan(num_tokens: int) -> StepPlan:
    """One whole prompt of `num_tokens` tokens, nothing cached."""
    return StepPlan(num_prefill_tokens=num_tokens, num_prefill_seqs=1,
                    prefill_attention_work=num_tokens * num_tokens,
                    prefill_context_tokens=num_tokens,
                    sum_squared_prefill_chunks=num_tokens * num_tokens)


def reference_decode_work(model, num_seqs: int, context_len: int) -> tuple[float, float]:
    """A dense model's decode step counted term by term: every weight read once, 2 FLOPs per
    weight per token, QK^T and PV over the context, the context's K/V read and one token's
    written per sequence."""
    weights = model.num_layers * model.linear_parameters_per_layer + model.lm_head_parameters
    flops = 2 * weights * num_seqs
    flops += 2 * 2 * model.num_layers * model.num_attention_heads * model.head_dim * (
        num_seqs * context_len)
    bytes_moved = weights * model.dtype_bytes + model.kv_bytes_per_token * num_seqs * (
        context_len + 1)
    return flops, bytes_moved


def test_a_decode_steps_work_is_the_hand_count():
    model = model_spec("llama-2-7b")
    flops, bytes_moved = ModelStepWork(model).step_work(decode_plan(8, 500))
    ref_flops, ref_bytes = reference_decode_work(model, 8, 500)
    assert flops == pytest.approx(ref_flops, rel=1e-12)
    assert bytes_moved == pytest.approx(ref_bytes, rel=1e-12)


def test_a_run_of_repeated_steps_counts_as_its_steps_one_by_one():
    """A run of repeated steps (one event) adds, bit for bit, what its steps would add
    one at a time, every decode's context a token longer each step."""
    model, hardware = model_spec("llama-2-7b"), hardware_spec("a100-80gb")
    durations = [0.0131, 0.0133, 0.0129, 0.0137, 0.0135]

    def meter():
        return build_energy_meter(None, model, hardware, 2, 16,
                                  RooflineCostModel(model, hardware, tensor_parallel_size=2))

    together, one_by_one = meter(), meter()
    plan = decode_plan(5, 300)
    together.add_repeated_steps(plan, durations)
    assert plan.decode_context_tokens == 5 * 300   # the plan is left as it was
    for step, duration in enumerate(durations):
        one_by_one.add_step(decode_plan(5, 300 + step), duration)
    assert (together.busy_s, together.busy_j) == (one_by_one.busy_s, one_by_one.busy_j)


class DoubledFlopsCostModel:
    """A user's cost model (not the roofline) whose steps do twice the model's FLOPs, saying so
    through both work protocols; it counts its step_work calls."""

    def __init__(self, model):
        self.work, self.step_work_calls = ModelStepWork(model), 0

    def step_time(self, plan: StepPlan) -> float:
        return 0.01

    def step_work(self, plan: StepPlan) -> tuple[float, float]:
        self.step_work_calls += 1
        flops, bytes_moved = self.work.step_work(plan)
        return 2 * flops, bytes_moved

    def decode_work_terms(self):
        per_decode, per_context, weight_bytes, per_token = self.work.decode_work_terms()
        return 2 * per_decode, 2 * per_context, weight_bytes, per_token


class PerStepPowerModel:
    """A user's power model with busy_energy_j alone (no run of steps in one call)."""

    def __init__(self, hardware):
        self.model = UtilisationPowerModel(hardware)
        self.idle_power_w = self.model.idle_power_w

    def busy_energy_j(self, duration_s: float, flops: float, bytes_moved: float) -> float:
        return self.model.busy_energy_j(duration_s, flops, bytes_moved)

    def describe(self) -> str:
        return "per step"


def test_the_meter_charges_the_work_a_cost_model_states_whatever_its_class():
    """A run of repeated steps is charged from the cost model's decode_work_terms in one call,
    bit for bit its step_work one step at a time, and not the model shape's work; a power model
    without the run call charges the same joules step by step."""
    model, hardware = model_spec("llama-2-7b"), hardware_spec("a100-80gb")
    durations = [0.0131, 0.0133, 0.0129]
    cost_model = DoubledFlopsCostModel(model)
    together, one_by_one = (build_energy_meter(None, model, hardware, 1, 16, cost_model)
                            for _ in range(2))
    shape_only = build_energy_meter(None, model, hardware, 1, 16, None)
    step_by_step = EnergyMeter(PerStepPowerModel(hardware), cost_model)
    together.add_repeated_steps(decode_plan(4, 2000), durations)
    assert cost_model.step_work_calls == 0
    step_by_step.add_repeated_steps(decode_plan(4, 2000), durations)
    for step, duration in enumerate(durations):
        one_by_one.add_step(decode_plan(4, 2000 + step), duration)
        shape_only.add_step(decode_plan(4, 2000 + step), duration)
    assert together.busy_j == one_by_one.busy_j == step_by_step.busy_j > shape_only.busy_j


def test_a_mixture_reads_fewer_experts_in_small_batches():
    work = ModelStepWork(model_spec("mixtral-8x7b"))
    one = work.step_work(decode_plan(1, 100))[1]
    many = work.step_work(decode_plan(256, 100))[1]
    model = model_spec("mixtral-8x7b")
    every_expert = (model.num_layers * model.linear_parameters_per_layer
                    + model.lm_head_parameters) * model.dtype_bytes
    assert one < 0.5 * every_expert
    assert many == pytest.approx(every_expert + model.kv_bytes_per_token * 256 * 101, rel=1e-6)


def test_the_cost_models_report_the_same_work():
    model, hardware = model_spec("llama-2-7b"), hardware_spec("a100-80gb")
    plan = prefill_plan(512)
    assert RooflineCostModel(model, hardware).step_work(plan) == ModelStepWork(
        model).step_work(plan)


def test_nothing_running_draws_idle_power():
    hardware = hardware_spec("a100-80gb")
    meter = EnergyMeter(UtilisationPowerModel(hardware), ModelStepWork(model_spec("llama-2-7b")))
    assert meter.energy_j(10.0) == pytest.approx(hardware.idle_power_w * 10.0)
    meter.add_step(StepPlan(), 0.5)   # a step with no work: idle power while it lasts
    assert meter.energy_j(10.0) == pytest.approx(hardware.idle_power_w * 10.0)


def test_a_compute_bound_step_draws_more_than_a_memory_light_one():
    model, hardware = model_spec("llama-2-7b"), hardware_spec("a100-80gb")
    cost_model = RooflineCostModel(model, hardware)
    power = UtilisationPowerModel(hardware)

    def watts(plan):
        seconds = cost_model.step_time(plan)
        return power.busy_energy_j(seconds, *cost_model.step_work(plan)) / seconds

    prefill, decode = watts(prefill_plan(4096)), watts(decode_plan(1, 100))
    assert hardware.idle_power_w < decode < prefill
    assert prefill == pytest.approx(hardware.max_power_w)   # saturated: capped at the board's


def test_busy_power_follows_the_stated_model():
    hardware = hardware_spec("h100-80gb")
    power = UtilisationPowerModel(hardware, compute_saturation=0.5, memory_weight=0.6)
    flops, bytes_moved, seconds = 0.1 * hardware.peak_flops, 0.5 * hardware.memory_bandwidth, 1.0
    expected = hardware.idle_power_w + (hardware.max_power_w - hardware.idle_power_w) * (
        0.1 / 0.5 + 0.6 * 0.5)
    assert power.busy_energy_j(seconds, flops, bytes_moved) == pytest.approx(expected)


def test_tensor_parallel_replicas_draw_every_boards_power():
    model, hardware = model_spec("llama-2-13b"), hardware_spec("a100-80gb")
    one, two = (build_energy_meter(None, model, hardware, tp, 16) for tp in (1, 2))
    assert two.energy_j(5.0) == pytest.approx(2 * one.energy_j(5.0))
    plan = decode_plan(16, 800)
    two.add_step(plan, 0.02)
    flops, bytes_moved = ModelStepWork(model, 2).step_work(plan)
    board = UtilisationPowerModel(hardware).busy_energy_j(0.02, flops, bytes_moved)
    assert two.busy_j == pytest.approx(2 * board)


def check_energy_keys(summary: dict) -> None:
    for key in ENERGY_KEYS:
        assert summary[key] > 0, key
    assert summary["joules_per_output_token"] == pytest.approx(
        summary["energy_j"] / summary["total_output_tokens"])
    assert summary["tokens_per_joule"] == pytest.approx(1 / summary["joules_per_output_token"])
    assert math.fsum(p["energy_j"] for p in summary["energy_per_pool"].values()) == pytest.approx(
        summary["energy_j"])
    assert math.fsum(r["energy_j"] for r in summary["energy_per_replica"].values()) == \
        pytest.approx(summary["energy_j"])
    assert summary["energy_model"].startswith("modelled, not measured")


@pytest.mark.parametrize("overrides", [
    ("cost_model=roofline",),
    ("cost_model=gpu", "cluster.num_replicas=2"),
    ("cluster=disaggregated",),
])
def test_every_sim_run_reports_joules_per_token(overrides):
    result = run_experiment(make_cfg("workload.num_requests=40", "workload.rate=8", *overrides),
                            plots=False)
    check_energy_keys(result.summary)
    assert result.summary["avg_power_w"] <= sum(
        replica.recorder.energy.num_boards for replica in result.replicas) * 400


def test_engine_runs_report_modelled_joules_per_token():
    overrides = ["backend=engine", "model=tiny-llama", "hardware=cpu", "workload.num_requests=4",
                 "workload.rate=inf", "workload.with_token_ids=true",
                 "++workload.prompt_len={dist: fixed, value: 16}",
                 "++workload.output_len={dist: fixed, value: 4}", "kv_cache.block_size=4"]
    result = run_experiment(make_cfg(*overrides), plots=False)
    check_energy_keys(result.summary)
    assert "(cpu;" in result.summary["energy_model"]


def test_the_run_energy_is_its_replicas_busy_and_idle_joules():
    result = run_experiment(make_cfg("workload.num_requests=30", "workload.rate=2",
                                     "cost_model=roofline"), plots=False)
    meter = result.replicas[0].recorder.energy
    span = result.summary["duration_s"]
    assert span > meter.busy_s   # light load: the replica idles between steps
    expected = meter.busy_j + meter.power_model.idle_power_w * (span - meter.busy_s)
    assert result.summary["energy_j"] == pytest.approx(expected)
    again = energy_summary({0: meter}, {0: "main"}, result.requests, span,
                           result.summary["total_output_tokens"])
    assert again["energy_j"] == result.summary["energy_j"]


def test_config_errors_name_the_key():
    fields = OmegaConf.to_container(OmegaConf.load("conf/hardware/a100-80gb.yaml"))
    with pytest.raises(ValueError, match=r"idle_power_w must be a number in \[0, 400\]"):
        HardwareSpec.from_config({**fields, "idle_power_w": 500})
    with pytest.raises(ValueError, match=r"max_power_w"):
        HardwareSpec.from_config({**fields, "max_power_w": -1})
    hardware = HardwareSpec.from_config(fields)
    with pytest.raises(ValueError, match=r"power.compute_saturation"):
        build_power_model(OmegaConf.create({"compute_saturation": 0}), hardware)
    with pytest.raises(ValueError, match=r"power: unknown key\(s\) \['idle'\]"):
        build_power_model(OmegaConf.create({"idle": 3}), hardware)
    with pytest.raises(ValueError, match=r"power: .* lacks busy_energy_j"):
        build_power_model(OmegaConf.create({"_target_": "tests.test_energy.NotAPowerModel"}),
                          hardware)


def test_hardware_without_power_figures_still_loads():
    fields = OmegaConf.to_container(OmegaConf.load("conf/hardware/a100-80gb.yaml"))
    del fields["idle_power_w"], fields["max_power_w"]
    hardware = HardwareSpec.from_config(fields)
    assert (hardware.idle_power_w, hardware.max_power_w) == (0.0, 0.0)


class NotAPowerModel:
    def __init__(self, hardware):
        self.hardware = hardware

    @property
    def idle_power_w(self) -> float:
        return 0.0

    def describe(self) -> str:
        return "half a power model"


def sweep_job(policy: str, rate: float, attainment: float, tokens_per_joule: float):
    from sim.tools.sweep_jobs import Job
    return Job(name=f"{policy}-{rate}", overrides={"policy": policy, "workload.rate": str(rate)},
               values={"policy": policy, "workload.rate": rate},
               summary={"slo_attainment": attainment, "tokens_per_joule": tokens_per_joule,
                        "output_throughput": 1.0, "joules_per_output_token": 1 / tokens_per_joule,
                        "avg_power_w": 300.0})


def test_energy_at_slo_is_at_each_policys_highest_rate_meeting_it():
    from sim.tools.report_energy import energy_at_slo, policies_by_label
    jobs = [sweep_job("a", 4, 0.95, 5.0), sweep_job("a", 2, 1.0, 3.0), sweep_job("a", 8, 0.5, 9.0),
            sweep_job("b", 2, 0.8, 2.0), sweep_job("b", 4, 0.1, 4.0)]
    rows = energy_at_slo(policies_by_label(jobs, "workload.rate"), "workload.rate", 0.9)
    assert rows["policy=a"]["workload.rate"] == 4 and rows["policy=a"]["tokens_per_joule"] == 5.0
    assert rows["policy=b"] == {}


def test_the_energy_presets_numbers():
    """docs/experiments.md section 16: under TTFT 1 s / TPOT 50 ms, continuous batching keeps 90 %
    attainment to 10.5 req/s (9.59 tok/J) but not 11 (75 %); chunked prefill (512) keeps it at 11
    (9.90 tok/J); static batching meets 47 % at 0.25 req/s."""
    def summary(policy: str, rate: float) -> dict:
        return run_experiment(make_cfg("+experiment=energy", f"policy={policy}",
                                       f"workload.rate={rate}"), plots=False).summary

    continuous, overloaded = summary("continuous", 10.5), summary("continuous", 11)
    chunked, static = summary("chunked_512", 11), summary("static", 0.25)
    assert continuous["slo_attainment"] >= 0.9 > overloaded["slo_attainment"]
    assert overloaded["slo_attainment"] == pytest.approx(0.751, abs=0.0005)
    assert continuous["tokens_per_joule"] == pytest.approx(9.59, abs=0.005)
    assert chunked["slo_attainment"] >= 0.9
    assert chunked["tokens_per_joule"] == pytest.approx(9.90, abs=0.005)
    assert static["slo_attainment"] == pytest.approx(0.469, abs=0.0005)


def test_a_mixtures_work_follows_the_cost_models_routing():
    """Skewed routing sends the tokens of a small batch to fewer experts than uniform: the
    roofline's expert layout reaches the work."""
    model, hardware = model_spec("mixtral-8x7b"), hardware_spec("h100-80gb")
    plan = decode_plan(4, 200)
    uniform = RooflineCostModel(model, hardware, tensor_parallel_size=2).step_work(plan)[1]
    skewed = RooflineCostModel(model, hardware, tensor_parallel_size=2,
                               routing="skewed").step_work(plan)[1]
    assert skewed < uniform == ModelStepWork(model, 2).step_work(plan)[1]


def test_verified_drafts_are_tokens_and_queries_over_the_mean_context():
    model = model_spec("llama-2-7b")
    plan = decode_plan(4, 300)
    plan.num_draft_tokens = 12   # 3 drafts a sequence: 16 tokens through the weights
    flops, bytes_moved = ModelStepWork(model).step_work(plan)
    weights = model.num_layers * model.linear_parameters_per_layer + model.lm_head_parameters
    per_pair = 4 * model.num_layers * model.num_attention_heads * model.head_dim
    assert flops == pytest.approx(2 * weights * 16 + per_pair * (4 + 12) * 300, rel=1e-12)
    assert bytes_moved == pytest.approx(weights * model.dtype_bytes + model.kv_bytes_per_token * (
        4 * 300 + 4 + 12), rel=1e-12)
