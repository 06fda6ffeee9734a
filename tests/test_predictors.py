"""Output-length predictors (policies/prediction): what each built-in predicts and how wrong it is
asked to be, its bad arguments, and the wiring: the simulator's arrivals (before routing) and
the engine's generate set `Request.predicted_output_len`, and no prediction changes no run."""
from __future__ import annotations

import math
import random
import statistics
import textwrap

import pytest
from omegaconf import OmegaConf

from policies.prediction import (BucketPredictor, LengthPredictor, NoisyPredictor, NoPredictor,
                                 OnlineLengthPredictor, OraclePredictor, refine)
from policies.types import Request
from runtime.assembly import build_predictor
from sim.core.experiment import run_experiment

from factories import make_cfg, summary_without_wall_time

NUM_REQUESTS = 5000


def requests_with_lengths(lengths) -> list[Request]:
    return [Request(request_id=i, arrival_time=0.0, prompt_len=8, output_len=length)
            for i, length in enumerate(lengths)]


def spread_requests(low: int, high: int, seed: int = 1) -> list[Request]:
    """NUM_REQUESTS requests with output lengths log-uniform in [low, high]."""
    rng = random.Random(seed)
    return requests_with_lengths(round(math.exp(rng.uniform(math.log(low), math.log(high))))
                                 for _ in range(NUM_REQUESTS))


def run(*overrides: str):
    return run_experiment(make_cfg("workload.num_requests=200", *overrides))


# ---- the built-in predictors ---------------------------------------------------------------

def test_built_ins_answer_the_protocol():
    for predictor in (NoPredictor(), OraclePredictor(), NoisyPredictor(0.3), BucketPredictor()):
        assert isinstance(predictor, LengthPredictor)


def test_none_predicts_nothing_and_oracle_the_true_length():
    requests = spread_requests(1, 4000)
    assert all(NoPredictor().predict(r) is None for r in requests)
    assert [OraclePredictor().predict(r) for r in requests] == [r.output_len for r in requests]


@pytest.mark.parametrize("relative_error", [0.1, 0.5, 2.0])
def test_noisy_median_error_is_the_relative_error_asked(relative_error):
    """Half the predictions lie within a factor 1 + relative_error of the truth, either way,
    and the factor is as often above 1 as below."""
    predictor = NoisyPredictor(relative_error, seed=0)
    requests = spread_requests(500, 4000)  # long enough that rounding barely matters
    ratios = [predictor.predict(r) / r.output_len for r in requests]
    symmetric_errors = [max(ratio, 1 / ratio) - 1 for ratio in ratios]
    # The sample median of 5,000 is within 2-3 % of the median (one standard error).
    assert statistics.median(symmetric_errors) == pytest.approx(relative_error, rel=0.1)
    assert statistics.median(ratios) == pytest.approx(1.0, abs=0.04 * (1 + relative_error))
    if relative_error <= 0.1:  # the plain |error| is close too while errors are small
        plain = statistics.median(abs(ratio - 1) for ratio in ratios)
        assert plain == pytest.approx(relative_error, rel=0.1)


def test_noisy_with_no_error_is_the_oracle_and_never_below_one():
    requests = spread_requests(1, 4000)
    assert [NoisyPredictor(0.0, seed=5).predict(r) for r in requests] == \
        [r.output_len for r in requests]
    wild = NoisyPredictor(20.0, seed=0)
    assert min(wild.predict(r) for r in requests_with_lengths([1] * 1000)) == 1


def test_noisy_is_reproducible_by_seed():
    requests = spread_requests(10, 1000)
    first = [NoisyPredictor(0.5, seed=3).predict(r) for r in requests]
    assert first == [NoisyPredictor(0.5, seed=3).predict(r) for r in requests]
    assert first != [NoisyPredictor(0.5, seed=4).predict(r) for r in requests]


def test_bucket_predicts_the_class_value():
    predictor = BucketPredictor([64, 256, 1024], confusion_rate=0.0)
    assert predictor.values == [32, 160, 640, 2048]
    expected = {1: 32, 64: 32, 65: 160, 256: 160, 257: 640, 1024: 640, 1025: 2048, 9999: 2048}
    assert {length: predictor.predict(r) for length, r in
            zip(expected, requests_with_lengths(expected))} == expected
    custom = BucketPredictor([100], values=[50, 400])
    assert [custom.predict(r) for r in requests_with_lengths([3, 100, 101])] == [50, 50, 400]


def test_bucket_confuses_adjacent_classes_at_the_asked_rate():
    rate = 0.2
    predictor = BucketPredictor([64, 256, 1024], confusion_rate=rate, seed=0)
    requests = spread_requests(1, 4000)
    values = predictor.values
    confused, up, down = 0, 0, 0
    for request in requests:
        true_class = predictor.bucket(request.output_len)
        predicted_class = values.index(predictor.predict(request))
        assert abs(predicted_class - true_class) <= 1  # only a neighbouring class
        if predicted_class != true_class:
            confused += 1
            if 0 < true_class < len(values) - 1:
                up += predicted_class > true_class
                down += predicted_class < true_class
    # Binomial(5000, 0.2): mean 1000, standard deviation 28; allow 4 of them.
    assert abs(confused - rate * NUM_REQUESTS) < 4 * math.sqrt(NUM_REQUESTS * rate * (1 - rate))
    assert abs(up - down) < 4 * math.sqrt(up + down)  # either neighbour alike


def test_only_a_predictor_with_update_refines():
    from runtime.metrics import MetricsCollector, StepRecorder
    from runtime.step import StepLoop

    (request,) = requests_with_lengths([300])
    request.predicted_output_len = BucketPredictor().predict(request)
    assert refine(HalvingErrorPredictor(), request, 100) == 300 + (640 - 300) // 2

    class PredictOnly:
        def predict(self, request):
            return 7

    def refining(predictor):
        return StepLoop(None, object(), StepRecorder(MetricsCollector()),
                        predictor).refining_predictor

    online = HalvingErrorPredictor()
    assert isinstance(online, OnlineLengthPredictor) and refining(online) is online
    for predictor in (None, PredictOnly(), NoPredictor(), OraclePredictor(), NoisyPredictor(0.3),
                      BucketPredictor()):
        assert not isinstance(predictor, OnlineLengthPredictor) and refining(predictor) is None


# ---- bad arguments -------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    (["predictor=noisy", "predictor.relative_error=-0.5"],
     "predictor.relative_error must be a number >= 0, got -0.5"),
    (["predictor=noisy", "predictor.relative_error=inf"],
     "predictor.relative_error must be a finite number"),
    (["predictor=bucket", "predictor.confusion_rate=1.5"],
     "predictor.confusion_rate must be a probability in [0, 1], got 1.5"),
    (["predictor=bucket", "predictor.boundaries=[256,64]"],
     "predictor.boundaries must be a non-empty list of increasing positive integers, "
     "got [256, 64]"),
    (["predictor=bucket", "predictor.boundaries=[0,64]"], "predictor.boundaries must be"),
    (["predictor=bucket", "predictor.boundaries=[]"], "predictor.boundaries must be"),
    (["predictor=bucket", "predictor.values=[1,2]"],
     "predictor.values must give one value per class, 4 for 3 boundaries, got 2"),
    (["predictor=noisy", "predictor.seed=-1"], "predictor.seed must be a non-negative integer"),
    (["predictor._target_=no_such_module.Predictor"], "predictor._target_=no_such_module"),
    (["predictor._target_=policies.routing.RoundRobinRouter"],
     "predictor: RoundRobinRouter lacks predict (LengthPredictor, policies/protocols.py)"),
])
def test_bad_arguments_are_one_line_naming_the_field(overrides, message):
    with pytest.raises(ValueError) as error:
        run(*overrides)
    # Hydra's own import error goes on in more lines (as for every group's _target_).
    text = str(error.value) if "_target_=" not in message else str(error.value).splitlines()[0]
    assert message in text and "\n" not in text


def test_an_object_without_predict_is_refused():
    with pytest.raises(ValueError, match=r"^predictor: object lacks predict \(LengthPredictor, "):
        build_predictor(object(), seed=0)
    with pytest.raises(ValueError, match=r"^predictor must be one of bucket, noisy, none, oracle"):
        build_predictor("psychic", seed=0)


# ---- the simulator ---------------------------------------------------------------------------

def test_oracle_run_predicts_every_request_before_routing():
    """A router that needs the prediction sees it: predictions are made before routing."""
    result = run("predictor=oracle", "cluster.num_replicas=2",
                 "cluster.router=test_predictors.RouterByPrediction")
    assert all(r.predicted_output_len == r.output_len for r in result.requests)
    assert {r.replica_id for r in result.requests} == {0, 1}


class RouterByPrediction:
    """Long predicted outputs to replica 1, short ones to 0; fails without a prediction."""

    def route(self, request, replicas):
        assert request.predicted_output_len is not None, "routed before its prediction"
        return int(request.predicted_output_len > 128) % len(replicas)


def test_no_predictor_is_todays_run_and_predictions_move_no_other_draw():
    cfg = make_cfg("workload.num_requests=200")
    today = OmegaConf.masked_copy(cfg, [key for key in cfg if key != "predictor"])
    before = run_experiment(today)
    none = run_experiment(cfg)
    assert cfg.predictor._target_ == "policies.prediction.NoPredictor"
    assert summary_without_wall_time(none) == summary_without_wall_time(before)
    assert all(r.predicted_output_len is None for r in none.requests)
    # The built-in schedulers ignore predictions, and a noisy predictor draws from its own
    # generator: the workload and the run stay the same.
    noisy = run("predictor=noisy")
    assert summary_without_wall_time(noisy) == summary_without_wall_time(none)
    assert any(r.predicted_output_len != r.output_len for r in noisy.requests)


def test_noisy_run_is_seeded_by_the_run_seed():
    def predictions(*overrides):
        return [r.predicted_output_len for r in run("predictor=noisy", *overrides).requests]

    same_workload_other_seed = predictions("seed=0", "predictor.seed=1")
    assert predictions("seed=0") == predictions("seed=0")
    assert predictions("seed=0") != same_workload_other_seed


def test_user_predictor_by_target(tmp_path, monkeypatch):
    (tmp_path / "my_predictors.py").write_text(textwrap.dedent("""
        class HalfPredictor:
            def predict(self, request):
                return max(1, request.output_len // 2)


        class SeedPredictor:
            def __init__(self, seed):
                self.seed = seed

            def predict(self, request):
                return self.seed + 1
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    half = run("predictor._target_=my_predictors.HalfPredictor")
    assert all(r.predicted_output_len == max(1, r.output_len // 2) for r in half.requests)
    seeded = run("seed=3", "predictor._target_=my_predictors.SeedPredictor", "+predictor.seed=null")
    assert {r.predicted_output_len for r in seeded.requests} == {4}


def test_engine_backend_run_gets_predictions_from_arrivals():
    result = run_experiment(make_cfg(
        "backend=engine", "model=tiny-llama", "hardware=cpu", "workload.num_requests=3",
        "workload.rate=inf", "workload.with_token_ids=true",
        "++workload.prompt_len={dist: fixed, value: 8}",
        "++workload.output_len={dist: fixed, value: 4}", "predictor=oracle"))
    assert [r.predicted_output_len for r in result.requests] == [4, 4, 4]


# ---- the engine ------------------------------------------------------------------------------

def test_llm_generate_predicts_each_request():
    from engine import LLM, SamplingParams

    llm = LLM("tiny-llama", num_gpu_blocks=32, predictor="oracle")
    seen = []
    add_request = llm.scheduler.add_request

    def recording_add_request(request, now):
        seen.append(request.predicted_output_len)
        add_request(request, now)

    llm.scheduler.add_request = recording_add_request
    outputs = llm.generate([[5, 6, 7], [8, 9], [10]],
                           SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                           use_tqdm=False)
    assert seen == [4, 4, 4]
    assert [len(output.outputs[0].token_ids) for output in outputs] == [4, 4, 4]


@pytest.mark.parametrize("predictor, message", [
    ({"_target_": "policies.prediction.NoisyPredictor", "relative_error": -1},
     "predictor.relative_error must be a number >= 0"),
    (object(), "predictor: object lacks predict (LengthPredictor, "),
    ("psychic", "predictor must be one of"),
])
def test_llm_bad_predictor_fails_before_loading(predictor, message, monkeypatch):
    import engine.builder
    from engine import LLM

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the predictor was checked")

    monkeypatch.setattr(engine.builder, "load_model", no_loading)
    with pytest.raises(ValueError) as error:
        LLM("tiny-llama", predictor=predictor)
    assert message in str(error.value)


class HalvingErrorPredictor:
    """Guesses twice the truth at arrival, then halves its error with every token served."""

    refined: list[tuple[int, int]] = []

    def predict(self, request):
        return 2 * request.output_len

    def update(self, request, num_output_tokens):
        HalvingErrorPredictor.refined.append((request.request_id, num_output_tokens))
        error = request.predicted_output_len - request.output_len
        return request.output_len + error // 2


def test_a_predictor_with_update_is_asked_after_every_step_on_both_backends():
    from engine import LLM, SamplingParams
    from sim.core.experiment import run_experiment

    HalvingErrorPredictor.refined.clear()
    result = run_experiment(make_cfg(
        "predictor._target_=test_predictors.HalvingErrorPredictor", "workload.num_requests=20",
        "++workload.output_len={dist: fixed, value: 40}"), plots=False)
    # Refined after every step as the tokens came out: converged to the truth.
    assert all(request.predicted_output_len == 40 for request in result.requests)
    served = [tokens for request_id, tokens in HalvingErrorPredictor.refined if request_id == 0]
    assert served == sorted(served) and served[0] >= 1 and len(served) > 3

    HalvingErrorPredictor.refined.clear()
    llm = LLM("tiny-llama", predictor=HalvingErrorPredictor(), seed=0)
    llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                 use_tqdm=False)
    assert [tokens for _, tokens in HalvingErrorPredictor.refined] == [1, 2, 3, 4, 5]
