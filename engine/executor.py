"""The engine's executor: runs a StepPlan for real and says how long it took.

Satisfies policies.protocols.Executor, like the simulator's: memory operations as the plan orders
them (swap out, swap in, copy), one forward over every scheduled token, sampling, and the token
ids the policies' `update` consumes.
"""
from __future__ import annotations

import time

import torch

from engine.kv_cache import KVCachePool
from engine.model_runner import ModelRunner
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from policies.types import Request, StepPlan, StepResult

# Requests without SamplingParams (a simulator workload replayed on the engine): greedy, and the
# trace's output length is the length.
REPLAY_PARAMS = SamplingParams(temperature=0.0, ignore_eos=True)


class EngineExecutor:
    def __init__(self, runner: ModelRunner, pool: KVCachePool, sampler: Sampler,
                 eos_token_id: int | None, device: torch.device):
        self.runner = runner
        self.pool = pool
        self.sampler = sampler
        self.eos_token_id = eos_token_id
        self.device = device
        # request_id -> (request, one generator per sample); dropped once the request finishes.
        self._generators: dict[int, tuple[Request, list[torch.Generator | None]]] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter()
        self.pool.swap_out(plan.blocks_to_swap_out)
        self.pool.swap_in(plan.blocks_to_swap_in)
        self.pool.copy(plan.blocks_to_copy)
        sampled: dict[int, list[int]] = {}
        stopped: set[int] = set()
        forked: dict[int, list[int]] = {}
        if plan.seqs:
            self._drop_finished()
            inputs = self.runner.prepare(plan)
            logits = self.runner.forward(inputs)
            self._sample(inputs.sampling_seqs, logits, sampled, stopped, forked)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return StepResult(duration=time.perf_counter() - start, sampled_token_ids=sampled,
                          stopped_seq_ids=stopped, forked_token_ids=forked)

    def _sample(self, seqs, logits, sampled, stopped, forked) -> None:
        eos = self.eos_token_id
        rows: list[int] = []          # logits row of each draw
        row_params: list[SamplingParams] = []
        row_generators: list[torch.Generator | None] = []
        draws: list[tuple[int, int, SamplingParams]] = []  # (seq_id, 1 + forked samples, params)
        for index, seq in enumerate(seqs):
            request = seq.request
            params = request.sampling_params or REPLAY_PARAMS
            outputs = seq.output_token_ids
            if not params.ignore_eos and outputs and outputs[-1] == eos:
                # A forked sample whose first token was EOS: the policies cannot stop a sample
                # before it exists, so it stops here, gaining nothing.
                sampled[seq.seq_id] = []
                stopped.add(seq.seq_id)
                continue
            num_samples = 1
            if not outputs and request.n > len(request.sequences):
                num_samples = request.n  # the prompt's last token: draw the forked samples' too
            first_sample = 0 if len(request.sequences) == 1 else request.sequences.index(seq)
            for sample in range(first_sample, first_sample + num_samples):
                rows.append(index)
                row_params.append(params)
                row_generators.append(self._generator(request, params, sample))
            draws.append((seq.seq_id, num_samples, params))
        if not rows:
            return
        if rows != list(range(len(seqs))):
            logits = logits[torch.tensor(rows, device=logits.device)]
        tokens = self.sampler(logits, row_params, row_generators)
        position = 0
        for seq_id, num_samples, params in draws:
            token = tokens[position]
            sampled[seq_id] = [token]
            if token == eos and not params.ignore_eos:
                stopped.add(seq_id)
            if num_samples > 1:
                forked[seq_id] = tokens[position + 1:position + num_samples]
            position += num_samples

    def _generator(self, request: Request, params: SamplingParams,
                   sample: int) -> torch.Generator | None:
        """Sample `sample`'s own generator, seeded seed + sample; None when unseeded or greedy."""
        if params.seed is None or params.temperature == 0:
            return None
        entry = self._generators.get(request.request_id)
        if entry is None:
            entry = self._generators[request.request_id] = (request, [None] * request.n)
        generators = entry[1]
        if generators[sample] is None:
            generators[sample] = torch.Generator(device=self.device).manual_seed(
                params.seed + sample)
        return generators[sample]

    def _drop_finished(self) -> None:
        if self._generators:
            for request_id in [rid for rid, (request, _) in self._generators.items()
                               if request.is_finished]:
                del self._generators[request_id]

