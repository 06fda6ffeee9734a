"""The offline API, shaped like vLLM's: `LLM(model=...).generate(prompts, SamplingParams(...))`,
running the shared step loop (runtime/step.py) on the engine's executor; a server drives the same
loop a step at a time (`add_request`, `step`, `abort_request`: engine/serving_loop.py). A request
that cannot run gets an output carrying its `error`; one past its `timeout_s` is abandoned.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields

from tqdm import tqdm

from engine.builder import LOOKAHEAD, build_engine
from engine.config import EngineConfig
from engine.lookahead import GREEDY_ONLY
from engine.sampling_params import SamplingParams, as_sampling_params
from policies.types import Request, Sequence
from policies.validators import positive_number
from runtime.deadlines import Deadlines
from runtime.metrics import MetricsCollector, StepRecorder
from runtime.step import StepLoop


@dataclass
class CompletionOutput:
    index: int                      # sample j of the request
    token_ids: list[int]
    text: str | None = None         # when the model has a tokenizer
    finish_reason: str | None = None  # "stop" (EOS) or "length" (max_tokens)


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int] | None
    outputs: list[CompletionOutput] = field(default_factory=list)
    error: str | None = None        # why the request did not run; outputs is then empty
    num_cached_tokens: int = 0      # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    abandoned: bool = False         # its timeout_s passed before it finished (error says so)


@dataclass
class StepOutput:
    """What one `LLM.step` did for one request added with `add_request`."""

    request_id: int
    new_token_ids: list[list[int]]   # per sample, the tokens this step appended
    # The whole output once the request is done (or was rejected while it waited: its error).
    finished: RequestOutput | None = None


@dataclass
class _LiveRequest:
    """A request added with `add_request`, and how many tokens of each sample step reported."""

    request: Request
    output: RequestOutput
    num_reported: list[int]


@dataclass
class GenerateStats:
    """What the last generate() call did, for tests and benchmarks."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
    num_copied_blocks: int = 0
    num_computed_tokens: int = 0    # tokens run through the model (recomputes included)
    num_cached_tokens: int = 0      # prompt tokens skipped thanks to the prefix cache
    num_host_cached_tokens: int = 0  # of those, loaded back from the host tier
    num_offloaded_blocks: int = 0   # evicted cached blocks stored in the host tier
    num_loaded_blocks: int = 0      # host-tier blocks loaded back
    num_output_tokens: int = 0
    num_accepted_tokens: int = 0    # draft tokens accepted (speculative decoding)
    elapsed_s: float = 0.0

    @classmethod
    def from_steps(cls, metrics: MetricsCollector, requests: list[Request],
                   elapsed_s: float) -> "GenerateStats":
        """The totals of the step rows the step loop recorded (the simulator's steps.csv
        columns), and of the requests."""
        total = metrics.step_totals()
        return cls(
            num_steps=len(metrics.step_rows),
            num_preemptions=total["num_preempted_recompute"] + total["num_preempted_swap"],
            num_swapped_out_blocks=total["num_blocks_swapped_out"],
            num_swapped_in_blocks=total["num_blocks_swapped_in"],
            num_copied_blocks=total["num_blocks_copied"],
            # Prefill chunks and decodes; a decode's drafts are not computed tokens here.
            num_computed_tokens=total["num_prefill_tokens"] + total["num_decode_seqs"],
            num_cached_tokens=sum(request.num_cached_tokens for request in requests),
            num_host_cached_tokens=sum(request.num_host_cached_tokens for request in requests),
            num_offloaded_blocks=total["num_blocks_offloaded"],
            num_loaded_blocks=total["num_blocks_loaded"],
            num_output_tokens=sum(request.num_output_tokens for request in requests),
            num_accepted_tokens=total["num_accepted_tokens"],
            elapsed_s=elapsed_s)


class LLM:
    def __init__(self, model: str = "tiny-llama", **kwargs):
        """`model`: a conf/model name (seeded random weights) or a local HF checkpoint folder;
        the keyword arguments are EngineConfig's fields (engine/config.py)."""
        names = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"LLM() got unknown argument(s) {unknown}; allowed: {sorted(names)}")
        self.config = EngineConfig(model=model, **kwargs)
        engine = build_engine(self.config)
        self.loaded = engine.loaded
        self.model = engine.loaded.model
        self.tokenizer = engine.loaded.tokenizer
        self.spec = engine.loaded.spec
        self.eos_token_id = engine.loaded.eos_token_id
        self.scheduler = engine.scheduler
        self.executor = engine.executor
        self.predictor = engine.predictor
        self.max_model_len = engine.max_model_len
        self.device = engine.device
        self.last_stats = GenerateStats()
        self._next_request_id = 0
        # add_request's requests and the step loop that runs them (None while there are none).
        self._live: dict[int, _LiveRequest] = {}
        self._live_steps: StepLoop | None = None
        self._live_stopped: set[Sequence] = set()
        self._deadlines = Deadlines()   # of add_request's requests with a timeout_s
        self._clock_start = time.perf_counter()

    def _now(self) -> float:
        return time.perf_counter() - self._clock_start

    def generate(self, prompts,
                 sampling_params: SamplingParams | dict | list | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None,
                 lora_id: int | list[int | None] | None = None) -> list[RequestOutput]:
        """One RequestOutput per prompt (token ids, or a string with a tokenizer), in order.
        `sampling_params`, `priority` (lower first) and `lora_id` (None: the base model) are one
        for all or one per prompt; a request that cannot run comes back with `error` set."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if (isinstance(sampling_params, (SamplingParams, Mapping, str))
                or not isinstance(sampling_params, Iterable)):
            params_list = [as_sampling_params(sampling_params)] * len(prompts)
        else:
            params_list = [as_sampling_params(params, f"sampling_params[{index}]")
                           for index, params in enumerate(sampling_params)]
            if len(params_list) != len(prompts):
                raise ValueError(f"{len(params_list)} SamplingParams for {len(prompts)} prompts; "
                                 f"give one, or one per prompt")

        if priority is None:
            priority = [0] * len(prompts)
        elif len(priority) != len(prompts) or not all(
                isinstance(p, int) and not isinstance(p, bool) for p in priority):
            raise ValueError(f"priority must be one integer per prompt ({len(prompts)}), got "
                             f"{priority!r}")
        if lora_id is None or isinstance(lora_id, int):
            lora_ids = [self._checked_lora_id(lora_id, "lora_id")] * len(prompts)
        else:
            lora_ids = [self._checked_lora_id(value, f"lora_id[{index}]")
                        for index, value in enumerate(lora_id)]
            if len(lora_ids) != len(prompts):
                raise ValueError(f"lora_id must be one adapter id (or None) or one per prompt "
                                 f"({len(prompts)}), got {len(lora_ids)}")
        outputs: list[RequestOutput] = []
        requests: dict[int, tuple[Request, RequestOutput]] = {}
        for prompt, params, importance, adapter in zip(prompts, params_list, priority, lora_ids):
            output, request = self._queue(prompt, params, importance, adapter)
            outputs.append(output)
            if request is not None:
                requests[request.request_id] = (request, output)
        self._run(requests, use_tqdm)
        return outputs

    # ---- step by step, for a server ------------------------------------------------------------

    def add_request(self, prompt, sampling_params: SamplingParams | None = None,
                    priority: int = 0, lora_id: int | None = None,
                    timeout_s: float | None = None) -> RequestOutput:
        """Queue one prompt for `step`, abandoned if unfinished `timeout_s` seconds from now. Returns
        its output: `error` says why it will not run, else `request_id` names it in later
        StepOutputs."""
        params = SamplingParams() if sampling_params is None else as_sampling_params(
            sampling_params)
        if timeout_s is not None:
            positive_number("timeout_s", timeout_s)
        output, request = self._queue(prompt, params, priority,
                                      self._checked_lora_id(lora_id, "lora_id"), timeout_s)
        if request is not None:
            self._live[request.request_id] = _LiveRequest(request, output, [0] * request.n)
            self._deadlines.add(request)
        return output

    def has_unfinished_requests(self) -> bool:
        """Whether a request from `add_request` has not been reported finished by `step`."""
        return bool(self._live)

    def step(self) -> list[StepOutput]:
        """Run one step over add_request's requests. Returns a StepOutput per request that gained
        tokens or ended in it."""
        if self._live_steps is None:
            # One loop per busy period: its step rows are dropped when the engine goes idle.
            self._live_steps = StepLoop(self.scheduler, self.executor,
                                        StepRecorder(MetricsCollector()), self.predictor)
        step_outputs = [self._abandoned_output(request)
                        for request in self._deadlines.abandon_due(self.scheduler, self._now())]
        if self.scheduler.has_unfinished():
            self._step(self._live_steps, self._live_stopped)
        for request_id, live in list(self._live.items()):
            request = live.request
            new_token_ids = []
            for index, seq in enumerate(request.sequences):
                if index == len(live.num_reported):
                    live.num_reported.append(0)
                new_token_ids.append(seq.output_token_ids[live.num_reported[index]:])
                live.num_reported[index] = len(seq.output_token_ids)
            done = request.is_finished   # (a rejection while it waited too)
            if done:
                self._fill_output(request, live.output, self._live_stopped)
                del self._live[request_id]
            if done or any(new_token_ids):
                step_outputs.append(StepOutput(request_id, new_token_ids,
                                               live.output if done else None))
        if not self._live:
            self._live_steps = None
            self._live_stopped = set()
        return step_outputs

    def _abandoned_output(self, request: Request) -> StepOutput:
        """The StepOutput of a request its deadline just aborted: no tokens, the error."""
        live = self._live.pop(request.request_id)
        live.output.abandoned = True
        live.output.error = (f"timeout_s={request.timeout_s:g}: the request was abandoned "
                             f"unfinished after {request.num_output_tokens} output tokens")
        return StepOutput(request.request_id, [[] for _ in request.sequences], live.output)

    def abort_request(self, request_id: int) -> bool:
        """Stop a request from `add_request` at once (its client went away), between steps; False
        when no such request is unfinished."""
        live = self._live.pop(request_id, None)
        if live is None:
            return False
        self.scheduler.abort(live.request, self._now())
        if not self._live:
            self._live_steps = None
            self._live_stopped = set()
        return True

    def _checked_lora_id(self, lora_id, name: str) -> int | None:
        """`lora_id` when it names one of the engine's adapters (or is None); else a ValueError
        naming the argument `name`."""
        if lora_id is None:
            return None
        adapters = self.executor.runner.lora
        count = adapters.adapters.num_adapters if adapters is not None else 0
        if isinstance(lora_id, bool) or not isinstance(lora_id, int) or not 0 <= lora_id < count:
            served = (f"one of the {count} adapters, 0..{count - 1}" if count else
                      "None: this engine serves no adapters (LLM(lora=...))")
            raise ValueError(f"{name} must be None or {served}; got {lora_id!r}")
        return lora_id

    def _queue(self, prompt, params, priority: int, lora_id: int | None = None,
               timeout_s: float | None = None) -> tuple[RequestOutput, Request | None]:
        """Make the prompt's request and hand it to the scheduler; the request is None when it
        will not run (the output's error says why)."""
        output, request = self._make_request(prompt, params, priority, lora_id, timeout_s)
        if request is not None:
            self.scheduler.add_request(request, self._now())
            if request.rejected_reason is not None:
                output.error = request.rejected_reason
                request = None
        return output, request

    def _make_request(self, prompt, params, priority: int = 0, lora_id: int | None = None,
                      timeout_s: float | None = None) -> tuple[RequestOutput, Request | None]:
        request_id = self._next_request_id
        self._next_request_id += 1
        text = prompt if isinstance(prompt, str) else None
        output = RequestOutput(request_id, text, None)
        output.error = params.error()
        if (output.error is None and self.config.speculative_model == LOOKAHEAD
                and not params.greedy):
            output.error = GREEDY_ONLY
        if output.error is not None:
            return output, None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                output.error = "this model has no tokenizer: give the prompt as token ids"
                return output, None
            token_ids = list(self.tokenizer.encode(prompt))
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            token_ids = list(prompt["prompt_token_ids"])
        else:
            token_ids = list(prompt)
        output.prompt_token_ids = token_ids
        output.error = self._prompt_error(token_ids)
        if output.error is not None:
            return output, None
        request = Request(request_id=request_id, arrival_time=self._now(),
                          prompt_len=len(token_ids), output_len=params.max_tokens, n=params.n,
                          prompt_token_ids=token_ids, sampling_params=params, priority=priority,
                          lora_id=lora_id, timeout_s=timeout_s)
        if self.predictor is not None:
            request.predicted_output_len = self.predictor.predict(request)
        return output, request

    def _prompt_error(self, token_ids: list) -> str | None:
        if not token_ids:
            return "the prompt is empty"
        vocab_size = self.spec.vocab_size
        for position, token in enumerate(token_ids):
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
                return (f"token {token!r} at position {position} is not a token id of the "
                        f"vocabulary [0, {vocab_size})")
        if len(token_ids) > self.max_model_len:
            return (f"the prompt has {len(token_ids)} tokens, more than max_model_len="
                    f"{self.max_model_len}")
        return None

    def _run(self, requests: dict[int, tuple[Request, RequestOutput]], use_tqdm: bool) -> None:
        scheduler = self.scheduler
        metrics = MetricsCollector()
        steps = StepLoop(scheduler, self.executor, StepRecorder(metrics), self.predictor)
        stopped: set[Sequence] = set()
        start = time.perf_counter()
        bar = tqdm(total=len(requests), desc="Processed prompts", unit="req",
                   disable=not use_tqdm or not requests)
        while scheduler.has_unfinished():
            finished = self._step(steps, stopped)
            if finished:
                bar.update(len(finished))
        bar.close()
        self._fill_outputs(requests, stopped, metrics, time.perf_counter() - start)

    def _step(self, steps: StepLoop, stopped: set[Sequence], may_idle: bool = False):
        """One step of a replica's step loop (EOS-stopped sequences join `stopped`). Returns the
        requests it finished, or None when it could not plan a step and `may_idle`."""
        result = steps.begin(self._now(), may_idle=may_idle)
        if result is None:
            return None
        if result.stopped_seq_ids:
            stopped.update(seq for seq in steps.plan.seqs if seq.seq_id in result.stopped_seq_ids)
        return steps.complete(self._now())

    def _fill_outputs(self, requests: dict[int, tuple[Request, RequestOutput]],
                      stopped: set[Sequence], metrics: MetricsCollector,
                      elapsed_s: float) -> None:
        stats = GenerateStats.from_steps(metrics, [request for request, _ in requests.values()],
                                         elapsed_s=elapsed_s)
        for request, output in requests.values():
            self._fill_output(request, output, stopped)
        self.last_stats = stats

    def _fill_output(self, request: Request, output: RequestOutput,
                     stopped: set[Sequence]) -> None:
        """A finished request's samples into its output, or the error that stopped it."""
        if request.rejected_reason is not None:
            # Rejected while it waited (a scheduler's admission control): no outputs.
            output.error = request.rejected_reason
            return
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        output.num_preemptions = request.num_preemptions
        output.num_cached_tokens = request.num_cached_tokens
        for index, seq in enumerate(request.sequences):
            token_ids = list(seq.output_token_ids)
            output.outputs.append(CompletionOutput(
                index=index, token_ids=token_ids,
                text=decode(token_ids) if decode else None,
                finish_reason="stop" if seq in stopped else "length"))
