"""Clients that give up, in the engine: a request added with `timeout_s` is abandoned by the first
step at or after its deadline, waiting or running, through the scheduler's abort (its blocks back,
the engine serving on), and the API takes `timeout_s` as a positive number, answering 408 when it
passes."""
from __future__ import annotations

import httpx
import pytest
import torch

from engine import LLM, SamplingParams
from engine.server import create_app
from test_server import (ENGINE_ARGS, GREEDY, PROMPT, engine_is_idle, metric_samples,
                         reference_tokens, running)

LONG = SamplingParams(max_tokens=500, **GREEDY)


@pytest.fixture(scope="module")
def reference_llm():
    torch.set_num_threads(1)
    return LLM("tiny-llama", **ENGINE_ARGS)


def test_a_request_whose_timeout_passes_is_abandoned_and_frees_its_blocks(reference_llm,
                                                                          monkeypatch):
    llm = LLM("tiny-llama", **{**ENGINE_ARGS, "max_num_seqs": 1})
    clock = [0.0]   # the engine's clock, moved by the test: deadlines pass when it says
    monkeypatch.setattr(llm, "_now", lambda: clock[0])
    running_output = llm.add_request(PROMPT, LONG, timeout_s=1.0)
    waiting_output = llm.add_request([7, 8], LONG, timeout_s=2.0)   # max_num_seqs=1: it waits
    kept = llm.add_request([1, 2, 3], SamplingParams(max_tokens=4, **GREEDY))   # never gives up
    for _ in range(3):
        llm.step()
    scheduler = llm.scheduler
    assert scheduler.queue_lengths() == (2, 1, 0) and scheduler.kv_cache.num_used_blocks() > 0
    [running_request] = scheduler.running

    clock[0] = 1.0   # the running request's deadline: the next step drops it first
    step_outputs = {out.request_id: out for out in llm.step()}
    abandoned = step_outputs[running_output.request_id].finished
    assert abandoned.abandoned and abandoned.outputs == []
    assert abandoned.error.startswith("timeout_s=1: the request was abandoned")
    assert running_request.abandoned_time == 1.0 and running_request.finish_time is None
    assert [request.request_id for request in scheduler.running] == [waiting_output.request_id]

    clock[0] = 2.5   # the other one's, admitted meanwhile
    step_outputs = {out.request_id: out for out in llm.step()}
    assert step_outputs[waiting_output.request_id].finished.abandoned
    finished = None
    for _ in range(50):   # (bounded: the kept request's 4 tokens)
        finished = finished or next((out.finished for out in llm.step() if out.finished), None)
        if not llm.has_unfinished_requests():
            break
    assert finished.request_id == kept.request_id and finished.error is None
    assert finished.outputs[0].token_ids == reference_tokens(reference_llm, [1, 2, 3], 4)
    assert engine_is_idle(llm)


@pytest.mark.parametrize("timeout_s", [0, -1.5, "5", True])
def test_add_request_refuses_a_timeout_that_is_not_a_positive_number(reference_llm, timeout_s):
    with pytest.raises(ValueError, match=r"^timeout_s must be a positive number"):
        reference_llm.add_request(PROMPT, LONG, timeout_s=timeout_s)


@pytest.fixture(scope="module")
def server_url():
    torch.set_num_threads(1)
    with running(create_app(LLM("tiny-llama", **ENGINE_ARGS))) as url:
        yield url


@pytest.mark.parametrize("stream", [False, True])
def test_the_api_answers_408_when_timeout_s_passes(server_url, stream):
    # 2000 tokens take far longer than a millisecond on any machine: the deadline passes first.
    body = {"prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "temperature": 0.0,
            "timeout_s": 0.001, "stream": stream}
    aborted = '{model_name="tiny-llama",finished_reason="abort"}'
    with httpx.Client(base_url=server_url, timeout=60) as client:
        aborted_before = metric_samples(client.get("/metrics").text)[
            f"vllm:request_success_total{aborted}"]
        response = client.post("/v1/completions", json=body)
        # /metrics counts it under vLLM's finish reason for a request stopped before its end.
        assert metric_samples(client.get("/metrics").text)[
            f"vllm:request_success_total{aborted}"] == aborted_before + 1
        if stream:
            assert response.status_code == 200
            assert '"type": "RequestTimeoutError", "param": "timeout_s", "code": 408' in \
                response.text
        else:
            assert response.status_code == 408
            error = response.json()["error"]
            assert error["param"] == "timeout_s" and error["type"] == "RequestTimeoutError"
            assert error["message"].startswith("timeout_s=0.001: the request was abandoned")
        # A patient request is served as ever.
        response = client.post("/v1/completions", json={**body, "max_tokens": 3,
                                                        "timeout_s": 600, "stream": False})
        assert response.status_code == 200, response.text


@pytest.mark.parametrize("timeout_s", ["5", True, -1, 0, [1]])
def test_the_api_refuses_a_timeout_s_of_the_wrong_type_naming_it(server_url, timeout_s):
    with httpx.Client(base_url=server_url, timeout=60) as client:
        response = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3,
                                                        "timeout_s": timeout_s})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "timeout_s" and error["message"].startswith("timeout_s: ")
