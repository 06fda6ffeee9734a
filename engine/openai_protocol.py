"""OpenAI's completions protocol as twinserve-serve speaks it: request, response, stream chunk
and error bodies. Each choice also carries `token_ids` (as vLLM's return_token_ids) so that a
client counts tokens without a tokenizer."""
from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, PositiveFloat, StrictInt

from engine.llm import RequestOutput
from engine.sampling_params import SamplingParams

# Greedy when not given would surprise an OpenAI client; their default is 1.
DEFAULT_TEMPERATURE = 1.0
DEFAULT_MAX_TOKENS = 16   # OpenAI's


class BadRequest(ValueError):
    """A request the server will not run; its message names the field `param` (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class CompletionRequest(BaseModel):
    """The body of POST /v1/completions; unknown fields are ignored, as OpenAI's servers do.
    Types are strict: "5" or true is not an integer, 1 is not a boolean (a float takes an int)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    # One prompt: a string (needs a tokenizer) or token ids; a one-element batch is unwrapped.
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float = 1.0
    top_k: int = -1              # (vLLM's extension) -1: all tokens
    n: int = 1
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False     # (vLLM's extension)
    min_tokens: int = 0          # (vLLM's extension) 0, or max_tokens (then EOS is ignored)
    # (twinserve's) seconds after which the client gives up: the engine aborts the request then
    # and answers 408; None: it waits for the end.
    timeout_s: PositiveFloat | None = None
    # Not supported; rejected when set to anything but their defaults.
    echo: bool = False
    logprobs: int | None = None
    stop: str | list[str] | None = None
    best_of: int | None = None
    suffix: str | None = None


def engine_request(body: CompletionRequest) -> tuple[Any, SamplingParams]:
    """The engine's prompt and SamplingParams for `body`; BadRequest for what the engine does not do."""
    unsupported = [name for name, default in (("echo", False), ("logprobs", None), ("stop", None),
                                              ("suffix", None))
                   if getattr(body, name) not in (default, [])]
    if body.best_of not in (None, body.n):
        unsupported.append("best_of")
    if unsupported:
        raise BadRequest(f"{', '.join(unsupported)}: not supported by twinserve-serve (leave "
                         f"unset)", unsupported[0])
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise BadRequest(f"prompt: give one prompt per request, got a batch of {len(prompt)}",
                             "prompt")
        prompt = prompt[0]
    max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    ignore_eos = body.ignore_eos
    if body.min_tokens and body.min_tokens != max_tokens:
        if not 0 <= body.min_tokens <= max_tokens:
            raise BadRequest(f"min_tokens must be in [0, max_tokens={max_tokens}], got "
                             f"{body.min_tokens}", "min_tokens")
        if not ignore_eos:
            raise BadRequest(f"min_tokens={body.min_tokens}: the engine takes 0 or max_tokens "
                             f"(={max_tokens}), or ignore_eos=true", "min_tokens")
    elif body.min_tokens == max_tokens:
        ignore_eos = True   # (the output cannot stop before max_tokens)
    temperature = DEFAULT_TEMPERATURE if body.temperature is None else body.temperature
    try:   # (SamplingParams checks its fields when built: a bad one is the request's 400)
        params = SamplingParams(temperature=temperature, top_k=body.top_k, top_p=body.top_p,
                                max_tokens=max_tokens, ignore_eos=ignore_eos, n=body.n,
                                seed=body.seed)
    except ValueError as error:
        raise BadRequest(str(error), sampling_param(str(error))) from None
    return prompt, params


class CompletionStream:
    """The chunks of one streamed completion, and the ids that tie them together."""

    def __init__(self, model: str, decode=None):
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self._decode = decode           # the tokenizer's decode, or None: empty text
        self._token_ids: dict[int, list[int]] = {}
        self._texts: dict[int, str] = {}

    def _body(self, choices: list[dict], usage: dict | None = None) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices, "usage": usage}

    def _text_delta(self, index: int, new_token_ids: list[int]) -> str:
        token_ids = self._token_ids.setdefault(index, [])
        token_ids += new_token_ids
        if self._decode is None:
            return ""
        # Decoding the whole sample keeps multi-token characters whole.
        text = self._decode(token_ids)
        delta = text[len(self._texts.get(index, "")):]
        self._texts[index] = text
        return delta

    def tokens_chunk(self, new_token_ids: list[list[int]]) -> dict:
        choices = [{"index": index, "text": self._text_delta(index, token_ids),
                    "token_ids": token_ids, "logprobs": None, "finish_reason": None}
                   for index, token_ids in enumerate(new_token_ids) if token_ids]
        return self._body(choices)

    def finish_chunk(self, output: RequestOutput) -> dict:
        return self._body([{"index": sample.index, "text": "", "token_ids": [], "logprobs": None,
                            "finish_reason": sample.finish_reason}
                           for sample in output.outputs])

    def usage_chunk(self, output: RequestOutput) -> dict:
        return self._body([], usage(output))

    def completion(self, output: RequestOutput) -> dict:
        """The whole (not streamed) response."""
        return self._body([{"index": sample.index, "text": sample.text or "",
                            "token_ids": sample.token_ids, "logprobs": None,
                            "finish_reason": sample.finish_reason}
                           for sample in output.outputs], usage(output))


def usage(output: RequestOutput) -> dict:
    prompt_tokens = len(output.prompt_token_ids or ())
    completion_tokens = sum(len(sample.token_ids) for sample in output.outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


# SamplingParams' fields, under the request's names, that its error messages start with.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "max_tokens", "n", "seed", "ignore_eos")
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowedError", 408: "RequestTimeoutError",
               413: "RequestTooLargeError",
               500: "InternalServerError"}


def sampling_param(message: str) -> str | None:
    """The request field an engine's error message is about: a SamplingParams field it starts
    with, else `prompt` for the prompt's own errors, else None."""
    field = next((name for name in SAMPLING_FIELDS if message.startswith(f"{name} ")), None)
    if field is None and (message.startswith("token ") or "prompt" in message):
        return "prompt"
    return field


def error_body(message: str, status: int, param: str | None = None) -> dict:
    """OpenAI's error body; `param` names the offending request field, if one is."""
    kind = ERROR_TYPES.get(status, "ServiceUnavailableError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def validation_param(errors: list[dict]) -> str | None:
    """The first field pydantic's errors name (None: the body itself)."""
    for error in errors:
        location = [str(part) for part in error.get("loc", ()) if part != "body"]
        if location:
            return location[0]
    return None


def validation_message(errors: list[dict]) -> str:
    """Pydantic's errors as one line naming each field ("max_tokens: Input should be ...")."""
    parts = []
    for error in errors:
        location = [str(part) for part in error.get("loc", ()) if part != "body"]
        # A union's errors name the branch tried (prompt.str, prompt.list[int].0): keep the field.
        field = location[0] if location else "body"
        if field == "prompt" and error.get("type") != "missing":
            parts.append("prompt: must be a string or a list of token ids (integers)")
        else:
            parts.append(f"{field}: {error.get('msg', 'invalid')}")
    return "; ".join(dict.fromkeys(parts))
