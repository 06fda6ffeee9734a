"""SamplingParams are checked when built, as vLLM's are (one line naming the argument), and
generate takes a dict of their fields; what can only fail per request comes back as `.error`."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.openai_protocol import BadRequest, CompletionRequest, engine_request


@pytest.mark.parametrize("arguments, message", [
    ({"temperature": -1}, "temperature must be a number >= 0, got -1"),
    ({"max_tokens": 0}, "max_tokens must be a positive integer, got 0"),
    ({"top_p": 2}, r"top_p must be a number in \(0, 1\], got 2"),
    ({"n": 0}, "n must be a positive integer, got 0"),
    ({"top_k": -2}, "top_k must be -1 .off. or a non-negative integer, got -2"),
    ({"seed": "1"}, "seed must be an integer or None, got '1'"),
    ({"ignore_eos": "yes"}, "ignore_eos must be"),
])
def test_bad_sampling_params_fail_when_built(arguments, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        SamplingParams(**arguments)


def test_the_server_answers_a_bad_field_with_a_400():
    with pytest.raises(BadRequest, match="^top_p must be a number in"):
        engine_request(CompletionRequest(prompt=[1, 2], top_p=2.0))


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", num_gpu_blocks=64, seed=0)


def test_generate_takes_a_dict_of_sampling_params_fields(llm):
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    as_dict = llm.generate(prompts, {"temperature": 0, "max_tokens": 3, "ignore_eos": True},
                           use_tqdm=False)
    as_params = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3,
                                                     ignore_eos=True), use_tqdm=False)
    assert [out.outputs[0].token_ids for out in as_dict] == \
        [out.outputs[0].token_ids for out in as_params]
    assert all(len(out.outputs[0].token_ids) == 3 for out in as_dict)
    per_prompt = llm.generate(prompts, [{"temperature": 0, "max_tokens": 2, "ignore_eos": True},
                                        SamplingParams(temperature=0, max_tokens=1,
                                                       ignore_eos=True)], use_tqdm=False)
    assert [len(out.outputs[0].token_ids) for out in per_prompt] == [2, 1]


def test_what_generate_cannot_take_is_one_line(llm):
    with pytest.raises(ValueError, match=r"^sampling_params: SamplingParams has no field "
                                         r"max_new_tokens; its fields: temperature, top_k"):
        llm.generate([[1, 2]], {"max_new_tokens": 3})
    with pytest.raises(ValueError, match=r"^max_tokens must be a positive integer, got 0"):
        llm.generate([[1, 2]], {"max_tokens": 0})
    with pytest.raises(ValueError, match=r"^sampling_params must be a SamplingParams or a dict "
                                         r"of its fields, got int"):
        llm.generate([[1, 2]], 3)
    with pytest.raises(ValueError, match=r"^sampling_params\[1\] must be a SamplingParams or a "
                                         r"dict of its fields, got str"):
        llm.generate([[1, 2], [3]], [{"max_tokens": 2}, "max_tokens"])


def test_a_prompt_that_cannot_run_comes_back_with_its_error(llm):
    """README's `outs[0].outputs[0]`: a request that runs has outputs; one that cannot has
    `error` and none."""
    ok, empty = llm.generate([[1, 2, 3], []], SamplingParams(max_tokens=2), use_tqdm=False)
    assert ok.error is None and len(ok.outputs[0].token_ids) == 2
    assert empty.error == "the prompt is empty" and empty.outputs == []
