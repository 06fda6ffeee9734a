"""twinserve-serve and twinserve-bench: the engine's step-by-step API against generate, the
OpenAI-compatible server (started here on 127.0.0.1, tiny-llama with small pools) against the
engine's own outputs, its bad-request answers, and the benchmark client's run file."""
import argparse
import asyncio
import contextlib
import json
import signal
import socket
import threading
import time

import httpx
import numpy as np
import pytest
import torch
import uvicorn

from engine import LLM, SamplingParams
from engine import server as server_module
from engine.server import API_KEY_ENV, create_app
from engine.server_guard import DrainingServer
from engine.serving_loop import ServingLoop, _Submission
from sim.tools.bench_client import bench, workload_requests
from sim.tools.bench_run_file import RequestRecord, build_run_file

ENGINE_ARGS = dict(num_gpu_blocks=128, max_num_seqs=8, seed=0)
PROMPT = [5, 17, 99, 3, 250, 41, 7]
STARTUP_TIMEOUT_S = 30.0
GREEDY = dict(temperature=0.0, ignore_eos=True)
# A small workload: short prompts and outputs, a few requests a second.
WORKLOAD = ["workload.num_requests=8", "workload.rate=4", "workload.prompt_len.mean=48",
            "workload.prompt_len.max=128", "workload.output_len.mean=12",
            "workload.output_len.max=32"]


@pytest.fixture(scope="module")
def reference_llm():
    torch.set_num_threads(1)
    return LLM("tiny-llama", **ENGINE_ARGS)


def reference_tokens(llm: LLM, prompt: list[int], max_tokens: int) -> list[int]:
    [output] = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, **GREEDY),
                            use_tqdm=False)
    return output.outputs[0].token_ids


def running(app):
    """`app` served in a thread of this process, on a free port of 127.0.0.1: its base URL;
    stopped after."""
    return serving_in_thread(uvicorn.Server(uvicorn.Config(app, log_level="warning")))


@contextlib.contextmanager
def serving_in_thread(server: uvicorn.Server):
    """`server` run in a thread of this process, on a free port of 127.0.0.1: its base URL;
    stopped after (it must end)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "the server did not start"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(STARTUP_TIMEOUT_S)
        sock.close()
    assert not thread.is_alive(), "the server did not stop"


@pytest.fixture(scope="module")
def server_app():
    torch.set_num_threads(1)
    return create_app(LLM("tiny-llama", **ENGINE_ARGS))


@pytest.fixture(scope="module")
def server_url(server_app):
    with running(server_app) as url:
        yield url


@pytest.fixture()
def client(server_url):
    with httpx.Client(base_url=server_url, timeout=60) as client:
        yield client


def test_step_by_step_equals_generate(reference_llm):
    llm = LLM("tiny-llama", **ENGINE_ARGS)
    params = SamplingParams(max_tokens=6, **GREEDY)
    prompts = [PROMPT, [1, 2, 3]]
    outputs = [llm.add_request(prompt, params) for prompt in prompts]
    assert llm.add_request([], params).error == "the prompt is empty"
    streamed = {output.request_id: [] for output in outputs}
    finished = {}
    for _ in range(100):   # (bounded: 6 tokens take a few steps)
        if not llm.has_unfinished_requests():
            break
        for step_output in llm.step():
            streamed[step_output.request_id] += step_output.new_token_ids[0]
            if step_output.finished is not None:
                finished[step_output.request_id] = step_output.finished.outputs[0].token_ids
    expected = [reference_tokens(reference_llm, prompt, 6) for prompt in prompts]
    assert [streamed[output.request_id] for output in outputs] == expected
    assert [finished[output.request_id] for output in outputs] == expected


def test_health_models_and_settings(client):
    assert client.get("/health").json() == {"status": "ok"}
    [model] = client.get("/v1/models").json()["data"]
    assert model["id"] == "tiny-llama"
    settings = client.get("/v1/engine_settings").json()
    assert model["engine_settings"] == settings
    assert settings["num_gpu_blocks"] == 128 and settings["max_num_seqs"] == 8
    assert settings["model"] == "tiny-llama" and settings["hardware"] == "cpu"


def test_completion_equals_generate(client, reference_llm):
    response = client.post("/v1/completions", json={
        "model": "tiny-llama", "prompt": PROMPT, "max_tokens": 9, **GREEDY})
    assert response.status_code == 200
    body = response.json()
    [choice] = body["choices"]
    assert choice["token_ids"] == reference_tokens(reference_llm, PROMPT, 9)
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 9,
                             "total_tokens": len(PROMPT) + 9}


def test_streamed_completion_equals_generate(client, reference_llm):
    payload = {"prompt": PROMPT, "max_tokens": 8, "min_tokens": 8, "temperature": 0.0,
               "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=payload) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    token_chunks, finish, usage = chunks[:-2], chunks[-2], chunks[-1]
    # One chunk a step, one token each; min_tokens = max_tokens ignores EOS.
    assert [len(chunk["choices"][0]["token_ids"]) for chunk in token_chunks] == [1] * 8
    streamed = [token for chunk in token_chunks for token in chunk["choices"][0]["token_ids"]]
    assert streamed == reference_tokens(reference_llm, PROMPT, 8)
    assert finish["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8
    assert len({chunk["id"] for chunk in chunks}) == 1


@pytest.mark.parametrize("body, status, phrase", [
    ({"prompt": "hello"}, 400, "no tokenizer: give the prompt as token ids"),
    ({"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens must be a positive integer"),
    ({"prompt": [1, 512]}, 400, "token 512 at position 1 is not a token id"),
    ({"prompt": [True, 2]}, 400, "prompt: must be a string or a list of token ids"),
    ({"prompt": [[1], [2]]}, 400, "one prompt per request, got a batch of 2"),
    ({"prompt": PROMPT, "max_tokens": 8, "min_tokens": 3}, 400, "min_tokens=3"),
    ({"prompt": PROMPT, "logprobs": 2}, 400, "logprobs: not supported"),
    ({"prompt": PROMPT, "temperature": -1}, 400, "temperature"),
    ({"max_tokens": 4}, 400, "prompt: Field required"),
    ({"prompt": PROMPT, "model": "gpt-4"}, 404, "'gpt-4' is not served here"),
])
def test_bad_requests_are_named(client, body, status, phrase):
    response = client.post("/v1/completions", json=body)
    assert response.status_code == status
    assert phrase in response.json()["error"]["message"]


def bench_args(server_url, tmp_path, *overrides, model=None, settings=(), warmup=0):
    return argparse.Namespace(endpoint=server_url, out=str(tmp_path / "run.json"), model=model,
                              engine_setting=list(settings), request_timeout=60.0, timeout=120.0,
                              warmup=warmup, overrides=list(overrides))


def test_bench_client_run_file(server_url, tmp_path):
    bench(bench_args(server_url, tmp_path, *WORKLOAD, settings=["hardware=cpu-test"]))
    run = json.loads((tmp_path / "run.json").read_text())
    _, _, requests = workload_requests(WORKLOAD, "tiny-llama")
    assert run["num_prompts"] == run["completed"] == 8 and run["failed"] == 0
    assert run["errors"] == [""] * 8
    assert run["input_lens"] == [request.prompt_len for request in requests]
    assert run["output_lens"] == run["expected_output_lens"] == [
        request.output_len for request in requests]
    assert run["total_output_tokens"] == sum(request.output_len for request in requests)
    # Sent in order, never before the request's arrival time.
    starts = run["start_times"]
    assert starts == sorted(starts)
    assert all(start >= request.arrival_time for start, request in zip(starts, requests))
    for ttft, e2el, itls, output_len in zip(run["ttfts"], run["e2els"], run["itls"],
                                            run["output_lens"]):
        assert 0 < ttft <= e2el
        assert len(itls) == output_len - 1 and all(itl >= 0 for itl in itls)
        assert ttft + sum(itls) == pytest.approx(e2el)
    assert run["mean_ttft_ms"] == pytest.approx(1000 * np.mean(run["ttfts"]))
    assert run["p99_e2el_ms"] == pytest.approx(1000 * np.percentile(run["e2els"], 99))
    assert max(s + e for s, e in zip(starts, run["e2els"])) <= run["duration"]
    settings = run["engine_settings"]
    assert settings["num_gpu_blocks"] == 128 and settings["hardware"] == "cpu-test"
    assert run["request_rate"] == 4.0 and run["model_id"] == "tiny-llama"


def test_bench_client_records_refused_requests(server_url, tmp_path):
    run = bench(bench_args(server_url, tmp_path, "workload.num_requests=3", "workload.rate=inf",
                           "workload.prompt_len.max=64", "workload.output_len.max=8",
                           model="not-served"))
    assert run["completed"] == 0 and run["failed"] == 3
    assert all(error.startswith("HTTP 404: model: 'not-served'") for error in run["errors"])
    assert run["ttfts"] == [0.0] * 3 and run["output_lens"] == [0] * 3
    assert run["request_rate"] == "inf"


def test_run_file_aggregates_completed_requests_only():
    done = RequestRecord(prompt_len=10, expected_output_len=3, start_time=1.0,
                         token_times=[1.5, 1.7, 2.0], num_tokens=3)
    failed = RequestRecord(prompt_len=20, expected_output_len=3, start_time=1.2,
                           error="HTTP 503: busy")
    run = build_run_file([done, failed], duration_s=4.0, info={"model_id": "m"})
    assert run["completed"] == 1 and run["total_input_tokens"] == 10
    assert run["ttfts"] == [0.5, 0.0] and run["e2els"] == [1.0, 0.0]
    assert run["itls"] == [pytest.approx([0.2, 0.3]), []]
    assert run["mean_tpot_ms"] == pytest.approx(250.0)   # (1.0 - 0.5) / (3 - 1)
    assert run["request_throughput"] == 0.25 and run["model_id"] == "m"


def sse_client(*chunks) -> httpx.AsyncClient:
    """A client whose every POST streams `chunks` as server-sent events, then [DONE]."""
    body = "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks) + "data: [DONE]\n\n"
    transport = httpx.MockTransport(lambda request: httpx.Response(200, text=body))
    return httpx.AsyncClient(transport=transport)


@pytest.mark.parametrize("chunks, output_len, num_itls", [
    # token_ids counted exactly, a chunk of two tokens one ITL (as vLLM counts chunks)
    ([{"choices": [{"index": 0, "text": "", "token_ids": [4]}]},
      {"choices": [{"index": 0, "text": "", "token_ids": [8, 9]}]},
      {"choices": [], "usage": {"completion_tokens": 99}}], 3, 1),
    # no token_ids (vLLM without return_token_ids): the server's usage
    ([{"choices": [{"index": 0, "text": "a"}]}, {"choices": [{"index": 0, "text": "bc"}]},
      {"choices": [], "usage": {"completion_tokens": 3}}], 3, 1),
])
def test_stream_parsing_counts_tokens(chunks, output_len, num_itls):
    from sim.tools.bench_client import stream_completion

    async def run():
        async with sse_client(*chunks) as client:
            await stream_completion(client, "http://server/v1/completions", {}, record, 0.0)

    record = RequestRecord(prompt_len=1, expected_output_len=3, start_time=0.0)
    asyncio.run(run())
    assert record.error == ""
    assert record.output_len == output_len and len(record.itls) == num_itls


@pytest.mark.parametrize("streamed", [True, False])
def test_bench_sends_timeout_s_and_records_a_408_as_abandoned(streamed):
    """twinserve-serve answers a request whose timeout_s passed with 408: as a status before
    the stream, or as an error chunk in it. The client sent the deadline and records either as
    an abandoned request, not a failure."""
    from engine.openai_protocol import error_body
    from policies.types import Request
    from sim.tools.bench_client import completion_payload, stream_completion

    abandoned = error_body("timeout_s=2.5: the request was abandoned", 408, "timeout_s")
    sent = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        if not streamed:
            return httpx.Response(408, json=abandoned)
        return httpx.Response(200, text=f"data: {json.dumps(abandoned)}\n\ndata: [DONE]\n\n")

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            await stream_completion(client, "http://server/v1/completions",
                                    completion_payload(request, "m"), record, 0.0)

    request = Request(request_id=0, arrival_time=0.0, prompt_len=2, output_len=3,
                      prompt_token_ids=[1, 2], timeout_s=2.5)
    record = RequestRecord(prompt_len=2, expected_output_len=3, start_time=0.0, timeout_s=2.5)
    asyncio.run(run())
    assert sent[0]["timeout_s"] == 2.5
    assert record.error == "" and record.abandoned_time is not None and not record.success
    run_file = build_run_file([record], duration_s=1.0, info={})
    assert (run_file["failed"], run_file["abandoned"], run_file["completed"]) == (0, 1, 0)
    assert run_file["timeout_s"] == [2.5] and run_file["abandoned_times"] == [
        record.abandoned_time]
    # Without a deadline the payload carries none (a server without deadlines never sees it).
    assert "timeout_s" not in completion_payload(
        Request(request_id=1, arrival_time=0.0, prompt_len=1, output_len=1,
                prompt_token_ids=[1]), "m")


def test_min_tokens_equal_to_max_tokens_ignores_eos():
    from engine.openai_protocol import CompletionRequest, engine_request

    _, params = engine_request(CompletionRequest(prompt=[1], max_tokens=8, min_tokens=8))
    assert params.ignore_eos and params.max_tokens == 8
    _, params = engine_request(CompletionRequest(prompt=[1], max_tokens=8))
    assert not params.ignore_eos


def test_bench_client_warms_up_unrecorded(server_url, tmp_path, monkeypatch):
    from sim.tools import bench_client

    warmed = []
    real_warm_up = bench_client.warm_up

    async def recording_warm_up(client, url, model, requests, request_timeout_s):
        warmed.extend(requests)
        await real_warm_up(client, url, model, requests, request_timeout_s)

    monkeypatch.setattr(bench_client, "warm_up", recording_warm_up)
    run = bench(bench_args(server_url, tmp_path, *WORKLOAD, warmup=2))
    _, _, requests = workload_requests(WORKLOAD, "tiny-llama")
    assert [r.prompt_token_ids for r in warmed] == [r.prompt_token_ids for r in requests[:2]]
    assert run["warmup_requests"] == 2
    assert run["num_prompts"] == run["completed"] == 8   # the warm-up is not in the run


def test_bench_client_refuses_negative_warmup(tmp_path):
    with pytest.raises(ValueError, match="--warmup must be >= 0, got -1"):
        bench(bench_args("http://127.0.0.1:9", tmp_path, warmup=-1))


def test_warm_up_sends_every_request_at_once():
    from policies.types import Request
    from sim.tools.bench_client import warm_up

    posted = []

    def handler(request):
        posted.append(json.loads(request.content))
        body = ('data: {"choices": [{"index": 0, "text": "", "token_ids": [5]}]}\n\n'
                "data: [DONE]\n\n")
        return httpx.Response(200, text=body)

    requests = [Request(request_id=i, arrival_time=10.0 * (i + 1), prompt_len=2, output_len=1,
                        prompt_token_ids=[3 + i, 4]) for i in range(3)]

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            # Arrival times of 10-30 s are ignored: a bound of 5 s would fail a paced send.
            await asyncio.wait_for(warm_up(client, "http://server/v1/completions", "m",
                                           requests, 60.0), timeout=5.0)

    asyncio.run(run())
    assert sorted(body["prompt"] for body in posted) == [[3, 4], [4, 4], [5, 4]]


def test_failed_warm_up_is_named():
    from policies.types import Request
    from sim.tools.bench_client import warm_up

    transport = httpx.MockTransport(
        lambda request: httpx.Response(503, json={"error": {"message": "busy"}}))

    async def run():
        async with httpx.AsyncClient(transport=transport) as client:
            await warm_up(client, "http://server/v1/completions", "m",
                          [Request(request_id=0, arrival_time=0.0, prompt_len=1, output_len=1,
                                   prompt_token_ids=[3])], 60.0)

    with pytest.raises(ValueError, match="--warmup: warm-up request 0 failed: HTTP 503: busy"):
        asyncio.run(run())


# ---- a client that goes away; /metrics; error bodies; the API key and the body cap ----------

# Far more tokens than the test waits for: a request that is not aborted runs for many seconds.
LONG_REQUEST = {"prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "temperature": 0.0}
ABORT_TIMEOUT_S = 30.0


def wait_until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def engine_is_idle(llm: LLM) -> bool:
    """No request left anywhere in the engine, every KV block back in the pool."""
    scheduler = llm.scheduler
    return (not llm.has_unfinished_requests() and not scheduler.has_unfinished()
            and scheduler.num_running_seqs == 0
            and scheduler.kv_cache.num_free_blocks() == scheduler.kv_cache.num_blocks)


def test_abort_request_frees_running_and_waiting_requests(reference_llm):
    llm = LLM("tiny-llama", **{**ENGINE_ARGS, "max_num_seqs": 3, "scheduler": "chunked_prefill",
                               "max_num_batched_tokens": 16})
    long = SamplingParams(max_tokens=500, **GREEDY)
    running = llm.add_request(PROMPT, long)
    # n=2 with a prompt longer than a step's budget: mid-prefill, unforked, it holds two seats.
    forking = llm.add_request(list(range(40)), SamplingParams(max_tokens=500, n=2, **GREEDY))
    waiting = llm.add_request([7, 8], long)   # max_num_seqs=3: no seat left, it waits
    llm.step()
    assert llm.scheduler.queue_lengths() == (1, 2, 0)
    assert all(llm.abort_request(output.request_id) for output in (waiting, forking))
    assert not llm.abort_request(forking.request_id)   # (already gone)
    for _ in range(3):
        step_outputs = llm.step()
        assert {out.request_id for out in step_outputs} == {running.request_id}
    assert llm.abort_request(running.request_id)
    assert engine_is_idle(llm)
    # The engine serves on as before.
    kept = llm.add_request(PROMPT, SamplingParams(max_tokens=5, **GREEDY))
    finished = None
    for _ in range(50):
        finished = finished or next((out.finished for out in llm.step() if out.finished), None)
        if not llm.has_unfinished_requests():
            break
    assert finished.request_id == kept.request_id
    assert finished.outputs[0].token_ids == reference_tokens(reference_llm, PROMPT, 5)


def test_aborting_a_preempted_member_of_a_static_batch_does_not_stall_it():
    llm = LLM("tiny-llama", num_gpu_blocks=4, seed=0, scheduler="static", preemption="recompute")
    params = SamplingParams(max_tokens=50, **GREEDY)   # two fit 4 blocks only at first
    outputs = [llm.add_request(prompt, params) for prompt in (PROMPT, [1, 2, 3])]
    for _ in range(100):
        llm.step()
        if llm.scheduler.waiting:
            break
    [preempted] = llm.scheduler.waiting
    assert llm.abort_request(preempted.request_id)
    later = llm.add_request([4, 5], SamplingParams(max_tokens=3, **GREEDY))
    finished = []
    for _ in range(200):   # (bounded: the rest of one request, then the next batch)
        finished += [out.request_id for out in llm.step() if out.finished]
        if not llm.has_unfinished_requests():
            break
    survivor = next(out for out in outputs if out.request_id != preempted.request_id)
    assert finished == [survivor.request_id, later.request_id]
    assert engine_is_idle(llm)


@pytest.mark.parametrize("abort_before_added", [True, False])
def test_serving_loop_aborts_before_and_after_adding(abort_before_added):
    """The engine thread's side, driven here step by step (its thread not started): a request
    aborted before the engine took it is never added; one aborted after leaves it."""
    serving = ServingLoop(LLM("tiny-llama", **ENGINE_ARGS))
    event_loop = asyncio.new_event_loop()
    try:
        submission = _Submission(PROMPT, SamplingParams(max_tokens=500, **GREEDY), event_loop,
                                 asyncio.Queue())
        serving._submissions.put(submission)
        if abort_before_added:
            serving.abort(submission)
        serving._add_submissions(block=False)
        assert serving.llm.has_unfinished_requests() != abort_before_added
        serving.abort(submission)
        serving._apply_aborts()
        assert engine_is_idle(serving.llm)
        assert serving.num_aborted == (0 if abort_before_added else 1)
        # /metrics counts it as vLLM counts a request its client aborted.
        assert serving.stats.num_finished["abort"] == serving.num_aborted
        assert ('vllm:request_success_total{model_name="m",finished_reason="abort"} '
                f'{serving.num_aborted}') in serving.stats.render("m")
    finally:
        event_loop.close()


@pytest.mark.parametrize("stream", [True, False])
def test_client_that_disconnects_aborts_its_request(server_app, server_url, stream):
    serving = server_app.state.serving
    llm = serving.llm
    assert wait_until(lambda: engine_is_idle(llm), ABORT_TIMEOUT_S)
    steps_before, aborted_before = serving.num_steps, serving.num_aborted
    body = json.dumps({**LONG_REQUEST, "stream": stream}).encode()
    host, port = server_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n"
                       b"Content-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert wait_until(lambda: serving.num_steps > steps_before + 2, ABORT_TIMEOUT_S)
    # The connection is closed: within a step the request is gone and its blocks are back.
    assert wait_until(lambda: engine_is_idle(llm), ABORT_TIMEOUT_S)
    assert serving.num_aborted == aborted_before + 1
    assert serving.num_steps - steps_before < LONG_REQUEST["max_tokens"] // 2


def metric_samples(text: str) -> dict[str, float]:
    """Prometheus text: sample name with labels -> value; checks every line's shape."""
    samples = {}
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            continue
        name, value = line.rsplit(" ", 1)
        samples[name] = float(value)
    return samples


def test_metrics_in_prometheus_text_under_vllm_names(client):
    labels = '{model_name="tiny-llama"}'
    before = metric_samples(client.get("/metrics").text)
    assert client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4,
                                                **GREEDY}).status_code == 200
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in response.text
    assert "# TYPE vllm:num_preemptions_total counter" in response.text
    after = metric_samples(response.text)
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert 0 <= after[f"vllm:{gauge}{labels}"] <= (1 if gauge == "kv_cache_usage_perc"
                                                         else ENGINE_ARGS["max_num_seqs"])
    assert after[f"vllm:num_preemptions_total{labels}"] >= 0
    for histogram in ("time_to_first_token_seconds", "time_per_output_token_seconds",
                      "e2e_request_latency_seconds"):
        count = f"vllm:{histogram}_count{labels}"
        assert after[count] == before[count] + 1
        assert after[f'vllm:{histogram}_bucket{{model_name="tiny-llama",le="+Inf"}}'] == (
            after[count])
        assert after[f"vllm:{histogram}_sum{labels}"] > before[f"vllm:{histogram}_sum{labels}"]
    assert (after[f"vllm:generation_tokens_total{labels}"]
            == before[f"vllm:generation_tokens_total{labels}"] + 4)


def assert_openai_error(response, status: int, param=None, phrase: str = "") -> None:
    assert response.status_code == status
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == param and body["error"]["code"] == status
    assert phrase in body["error"]["message"]


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/v1/chat", 404), ("POST", "/nowhere", 404), ("GET", "/v1/completions", 405)])
def test_every_route_answers_openai_errors(client, method, path, status):
    assert_openai_error(client.request(method, path), status, None, path)


@pytest.mark.parametrize("field, value", [
    ("max_tokens", "5"), ("max_tokens", True), ("max_tokens", 5.0), ("temperature", "0.5"),
    ("temperature", True), ("n", "1"), ("n", True), ("stream", "true"), ("stream", 1),
    ("top_p", "1"), ("top_k", "1"), ("seed", "1"), ("ignore_eos", 1), ("min_tokens", "0"),
    ("stream_options", {"include_usage": "yes"}), ("model", 1)])
def test_wrong_field_types_are_named(client, field, value):
    response = client.post("/v1/completions", json={"prompt": PROMPT, field: value})
    assert_openai_error(response, 400, field, f"{field}:")


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": PROMPT, "temperature": -1}, 400, "temperature"),
    ({"prompt": [1, 512]}, 400, "prompt"),
    ({"prompt": PROMPT, "logprobs": 2}, 400, "logprobs"),
    ({"prompt": PROMPT, "max_tokens": 8, "min_tokens": 3}, 400, "min_tokens"),
    ({"prompt": PROMPT, "model": "gpt-4"}, 404, "model")])
def test_bad_values_name_their_param(client, body, status, param):
    assert_openai_error(client.post("/v1/completions", json=body), status, param)


API_KEY = "test-key"
MAX_BODY_BYTES = 2048


@pytest.fixture(scope="module")
def guarded_url(reference_llm):
    with running(create_app(reference_llm, api_key=API_KEY,
                            max_body_bytes=MAX_BODY_BYTES)) as url:
        yield url


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": API_KEY}])
def test_api_key_is_required_on_v1_routes(guarded_url, headers):
    with httpx.Client(base_url=guarded_url, timeout=60) as guarded:
        assert_openai_error(guarded.get("/v1/models", headers=headers), 401, None, "API key")
        assert_openai_error(guarded.post("/v1/completions", headers=headers,
                                         json={"prompt": PROMPT}), 401)
        assert guarded.get("/health").status_code == 200
        good = {"Authorization": f"Bearer {API_KEY}"}
        assert guarded.get("/v1/models", headers=good).status_code == 200
        assert guarded.post("/v1/completions", headers=good, json={
            "prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_body_over_the_cap_is_413(guarded_url):
    body = json.dumps({"prompt": list(range(1000))}).encode()
    assert len(body) > MAX_BODY_BYTES
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    with httpx.Client(base_url=guarded_url, timeout=60) as guarded:
        assert_openai_error(guarded.post("/v1/completions", headers=headers, content=body), 413)
        # Chunked, without a Content-Length: counted as it arrives.
        chunks = (body[start:start + 512] for start in range(0, len(body), 512))
        assert_openai_error(guarded.post("/v1/completions", headers=headers, content=chunks),
                            413)


@pytest.mark.parametrize("host, env_key, warned", [
    ("0.0.0.0", None, True), ("0.0.0.0", "from-env", False), ("127.0.0.1", None, False)])
def test_serving_beyond_localhost_without_a_key_warns(monkeypatch, capsys, host, env_key,
                                                      warned):
    apps = []
    monkeypatch.setattr(server_module, "build_llm", lambda args: None)
    monkeypatch.setattr(server_module, "create_app", lambda *args: apps.append(args))
    monkeypatch.setattr(server_module, "serve", lambda *args: None)
    if env_key is None:
        monkeypatch.delenv(API_KEY_ENV, raising=False)
    else:
        monkeypatch.setenv(API_KEY_ENV, env_key)
    server_module.main(["--host", host])
    assert ("without an API key" in capsys.readouterr().err) == warned
    assert apps[0][2] == env_key


@pytest.mark.parametrize("flag, value", [("--max-body-bytes", "0"),
                                         ("--max-waiting-requests", "-1"),
                                         ("--shutdown-timeout", "-2"),
                                         ("--threads", "0")])
def test_server_options_out_of_range_are_named(monkeypatch, capsys, flag, value):
    monkeypatch.setattr(server_module, "build_llm", lambda args: pytest.fail("built an engine"))
    with pytest.raises(SystemExit) as exit_info:
        server_module.main([flag, value])
    assert exit_info.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"twinserve-serve: error: {flag} must be")


@pytest.mark.parametrize("argv, threads", [([], 1), (["--threads", "2"], 2)])
def test_server_runs_torch_on_the_threads_the_cpu_profiles_were_taken_with(monkeypatch, argv,
                                                                         threads):
    monkeypatch.setattr(server_module, "build_llm", lambda args: None)
    monkeypatch.setattr(server_module, "create_app", lambda *args: None)
    monkeypatch.setattr(server_module, "serve", lambda *args: None)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        server_module.main(argv)
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)


# ---- the bound on waiting requests; draining on SIGTERM -------------------------------------

class StreamReader(threading.Thread):
    """A streamed completion read in a thread: `answered` is set once its headers came (the
    engine took it), `started` once a chunk carried tokens; `lines` are its data lines."""

    def __init__(self, url: str, max_tokens: int, headers: dict | None = None):
        super().__init__(daemon=True)
        self.url, self.max_tokens, self.headers = url, max_tokens, headers or {}
        self.answered, self.started = threading.Event(), threading.Event()
        self.status, self.lines = None, []

    def run(self):
        payload = {"prompt": PROMPT, "max_tokens": self.max_tokens, "stream": True, **GREEDY}
        with httpx.Client(base_url=self.url, timeout=60) as client:
            with client.stream("POST", "/v1/completions", json=payload,
                               headers=self.headers) as response:
                self.status = response.status_code
                self.answered.set()
                for line in response.iter_lines():
                    if line:
                        self.lines.append(line)
                        self.started.set()

    def chunks(self) -> list[dict]:
        assert self.lines[-1] == "data: [DONE]"
        return [json.loads(line[len("data: "):]) for line in self.lines[:-1]]

    def finished_whole(self) -> bool:
        """Its every token came, then the finish reason "length" and [DONE]."""
        chunks = self.chunks()
        tokens = sum(len(chunk["choices"][0]["token_ids"]) for chunk in chunks)
        return (tokens == self.max_tokens
                and chunks[-1]["choices"][0]["finish_reason"] == "length")


@pytest.fixture(scope="module")
def one_seat_url():
    """A server that runs one request at a time and lets one more wait."""
    torch.set_num_threads(1)
    llm = LLM("tiny-llama", **{**ENGINE_ARGS, "max_num_seqs": 1})
    with running(create_app(llm, max_waiting_requests=1)) as url:
        yield url


def test_requests_past_the_waiting_bound_get_503_with_retry_after(one_seat_url):
    # Long enough to outlast the next three requests; it must still finish whole.
    running_stream = StreamReader(one_seat_url, max_tokens=400)
    running_stream.start()
    assert running_stream.started.wait(STARTUP_TIMEOUT_S)
    waiting_stream = StreamReader(one_seat_url, max_tokens=3)   # no seat: the one waiting
    waiting_stream.start()
    assert waiting_stream.answered.wait(STARTUP_TIMEOUT_S) and waiting_stream.status == 200
    with httpx.Client(base_url=one_seat_url, timeout=60) as client:
        refused = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert_openai_error(refused, 503, None, "--max-waiting-requests 1")
        assert refused.headers["Retry-After"] == str(server_module.RETRY_AFTER_S)
        running_stream.join(ABORT_TIMEOUT_S)
        waiting_stream.join(ABORT_TIMEOUT_S)
        assert running_stream.finished_whole() and waiting_stream.finished_whole()
        # Both gone: the bound lets the next one in.
        assert client.post("/v1/completions", json={"prompt": PROMPT,
                                                    "max_tokens": 2}).status_code == 200


SHUTDOWN_TIMEOUT_S = 2.0


@pytest.fixture()
def draining_server():
    """A server as twinserve-serve runs it (DrainingServer), with a 2 s shutdown timeout."""
    torch.set_num_threads(1)
    app = create_app(LLM("tiny-llama", **ENGINE_ARGS))
    return DrainingServer(uvicorn.Config(app, log_level="warning"), app.state.serving,
                          SHUTDOWN_TIMEOUT_S)


def test_shutdown_drains_running_requests_and_answers_each(draining_server):
    with serving_in_thread(draining_server) as url:
        # Thousands of steps: still running when the drain's time is up.
        long_stream = StreamReader(url, max_tokens=2000)
        long_stream.start()
        long_plain = {}
        long_plain_thread = threading.Thread(target=lambda: long_plain.update(
            response=httpx.post(f"{url}/v1/completions", timeout=60, json=LONG_REQUEST)))
        long_plain_thread.start()
        assert long_stream.started.wait(STARTUP_TIMEOUT_S)
        short_stream = StreamReader(url, max_tokens=5)   # a few steps: it finishes in the drain
        short_stream.start()
        assert short_stream.started.wait(STARTUP_TIMEOUT_S)
        draining_server.handle_exit(signal.SIGTERM, None)   # (what the signal's handler does)
        assert wait_until(lambda: is_refused(url), ABORT_TIMEOUT_S)   # new ones: no more
        for thread in (long_stream, long_plain_thread, short_stream):
            thread.join(ABORT_TIMEOUT_S)
    assert short_stream.finished_whole()
    # Each aborted client is answered: a stream's last event is an error, then [DONE].
    last = long_stream.chunks()[-1]
    assert last["error"]["code"] == 503 and "shutdown timeout" in last["error"]["message"]
    assert_openai_error(long_plain["response"], 503, None, "shutdown timeout")


@pytest.mark.parametrize("signal_number", [signal.SIGTERM, signal.SIGINT],
                         ids=["SIGTERM", "SIGINT"])
def test_shutdown_signal_is_not_raised_again(draining_server, signal_number):
    """uvicorn raises a signal again once it shut down (SIGTERM's default kills the process,
    status 143): a drained twinserve-serve exits 0 instead."""
    raised_again = []
    previous = signal.signal(signal_number, lambda number, frame: raised_again.append(number))
    try:
        with draining_server.capture_signals():
            signal.raise_signal(signal_number)
            assert draining_server.should_exit
    finally:
        signal.signal(signal_number, previous)
    assert raised_again == []


def is_refused(url: str) -> bool:
    """Whether a new completion is refused: its connection (a closed listener), or a 503."""
    try:
        return httpx.post(f"{url}/v1/completions", timeout=60,
                          json={"prompt": PROMPT, "max_tokens": 1}).status_code == 503
    except httpx.ConnectError:
        return True


def test_a_draining_server_refuses_new_requests():
    torch.set_num_threads(1)
    app = create_app(LLM("tiny-llama", **ENGINE_ARGS))
    with running(app) as url:
        app.state.serving.drain(timeout_s=60)
        response = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT}, timeout=60)
        assert_openai_error(response, 503, None, "shutting down: it takes no new requests")
