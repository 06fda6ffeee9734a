"""The engine's executor: runs a StepPlan for real and says how long it took (the
policies.protocols.Executor the simulator's executor also satisfies): the plan's memory
operations, one forward over every scheduled token, sampling, and the token ids for `update`.

Speculative decoding runs each speculating decode's drafts (a chain, or a token tree under its
tree mask) after its last token in the same forward and keeps the accepted ones plus one token
(engine/rejection_sampler.py, engine/token_tree.py), counting acceptance per draft position.
"""
from __future__ import annotations

import time

import torch

from engine.drafters import DraftProposal, SpeculatingSeq
from engine.kv_cache import KVCachePool
from engine.model_runner import ModelRunner
from engine.rejection_sampler import rejection_sample, verify_greedy
from engine.sampler import Sampler, probabilities
from engine.sampling_params import SamplingParams
from engine.token_tree import TokenTree, compaction_moves, greedy_accepts, typical_accepts
from policies.speculation import AcceptanceCounts
from policies.speculation.drafters import Drafter
from policies.types import Request, Sequence, StepPlan, StepResult

# Requests without SamplingParams (a simulator workload replayed): greedy, to the trace's length.
REPLAY_PARAMS = SamplingParams(temperature=0.0, ignore_eos=True)


class EngineExecutor:
    def __init__(self, runner: ModelRunner, pool: KVCachePool, sampler: Sampler,
                 eos_token_id: int | None, device: torch.device,
                 drafter: Drafter | None = None,
                 max_num_speculative_tokens: int = 0, max_tree_depth: int | None = None,
                 tree_paths: list[tuple[int, ...]] | None = None):
        self.runner = runner
        self.pool = pool
        self.sampler = sampler
        self.eos_token_id = eos_token_id
        self.device = device
        self.drafter = drafter
        self.max_num_speculative_tokens = max_num_speculative_tokens
        # Per draft position (per depth with a tree drafter, per node too with a fixed tree):
        # times examined and accepted, which the simulator's acceptance model is fitted on.
        self.acceptance_stats = AcceptanceCounts(max_tree_depth or max_num_speculative_tokens,
                                                 tree_paths)
        # request_id -> (request, one generator per sample); dropped once the request finishes.
        self._generators: dict[int, tuple[Request, list[torch.Generator | None]]] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter()
        self.pool.swap_out(plan.blocks_to_swap_out)
        self.pool.offload(plan.blocks_to_offload)
        self.pool.load(plan.blocks_to_load)
        self.pool.swap_in(plan.blocks_to_swap_in)
        self.pool.copy(plan.blocks_to_copy)
        sampled: dict[int, list[int]] = {}
        stopped: set[int] = set()
        forked: dict[int, list[int]] = {}
        num_accepted: dict[int, int] | None = None
        if plan.seqs:
            self._drop_finished()
            speculating = self._speculating(plan)
            proposal = self.drafter.step(plan, speculating) if self.drafter else None
            drafts = None
            if speculating:
                drafts = {s.seq.seq_id: tokens
                          for s, tokens in zip(speculating, proposal.trees or proposal.tokens)}
            inputs = self.runner.prepare(plan, drafts)
            reads_hidden = self.drafter is not None and self.drafter.kind.reads_hidden_states
            if reads_hidden:
                logits, hidden = self.runner.forward_with_hidden(inputs)
            else:
                logits = self.runner.forward(inputs)
            last_rows = None   # with speculation: seq_id -> the row that gave its last token
            if speculating:
                num_accepted, last_rows = self._sample_speculative(
                    inputs.sampling_seqs, logits, drafts, speculating, proposal,
                    plan.block_tables, sampled, stopped, forked)
            else:
                self._sample(inputs.sampling_seqs, logits, sampled, stopped, forked)
            if reads_hidden:
                rows = last_rows or {seq.seq_id: row
                                     for row, seq in enumerate(inputs.sampling_seqs)}
                self.drafter.observe_hidden(inputs.sampling_seqs, hidden, rows)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return StepResult(duration=time.perf_counter() - start, sampled_token_ids=sampled,
                          stopped_seq_ids=stopped, forked_token_ids=forked,
                          num_accepted=num_accepted)

    def _speculating(self, plan: StepPlan) -> list[SpeculatingSeq]:
        """The plan's speculating decodes, in plan order, with how they sample."""
        spec_lens = plan.spec_lens
        if not spec_lens:
            return []
        if self.drafter is None:
            raise RuntimeError("the plan speculates (spec_lens) but this engine has no drafter: "
                               "build it with a speculative_model")
        speculating = []
        for seq in plan.seqs:
            k = spec_lens.get(seq.seq_id)
            if k is None:
                continue
            if not 1 <= k <= self.max_num_speculative_tokens:
                raise ValueError(f"plan.spec_lens[{seq.seq_id}] = {k}: this engine verifies "
                                 f"1..{self.max_num_speculative_tokens} drafts "
                                 f"(max_num_speculative_tokens)")
            request = seq.request
            params = request.sampling_params or REPLAY_PARAMS
            speculating.append(SpeculatingSeq(
                seq, k, params, self._generator(request, params, _sample_index(seq))))
        return speculating

    def _sample_speculative(self, seqs: list[Sequence], logits: torch.Tensor,
                            drafts: dict[int, list[int] | TokenTree],
                            speculating: list[SpeculatingSeq], proposal: DraftProposal,
                            block_tables: dict[int, list[int]], sampled, stopped, forked
                            ) -> tuple[dict[int, int], dict[int, int]]:
        """Sample the ordinary sequences' rows, verify the speculating ones'. Returns
        seq_id -> drafts accepted, and seq_id -> the logits row its last token came from."""
        plain_seqs, plain_rows, first_rows = [], [], []
        row = 0
        for seq in seqs:
            seq_drafts = drafts.get(seq.seq_id)
            if seq_drafts is None:
                plain_seqs.append(seq)
                plain_rows.append(row)
                row += 1
            else:
                first_rows.append(row)
                row += 1 + len(seq_drafts)
        if plain_seqs:
            self._sample(plain_seqs, logits[torch.tensor(plain_rows, device=logits.device)],
                         sampled, stopped, forked)
        last_rows = {seq.seq_id: row for seq, row in zip(plain_seqs, plain_rows)}
        if proposal.trees is not None:
            paths, next_tokens = self._verify_trees(speculating, proposal.trees, logits,
                                                    first_rows, block_tables)
            for spec, path, first_row in zip(speculating, paths, first_rows):
                last_rows[spec.seq.seq_id] = first_row + (1 + path[-1] if path else 0)
            tokens = [[tree.tokens[node] for node in path]
                      for tree, path in zip(proposal.trees, paths)]
            # A tree with no candidate counts as depth 1 rejected, as the simulator draws every
            # speculating step at the depth its size reaches.
            self.acceptance_stats.record([max(tree.depth, 1) for tree in proposal.trees],
                                         [len(path) for path in paths],
                                         [spec.seq.starts_run for spec in speculating])
            if self.acceptance_stats.tree_paths is not None:
                self.acceptance_stats.record_tree([len(tree) for tree in proposal.trees], paths)
            return self._emit(speculating, tokens, next_tokens, sampled, stopped), last_rows
        accepted = self._verify(speculating, proposal, logits, first_rows, sampled, stopped)
        for spec, first_row in zip(speculating, first_rows):
            last_rows[spec.seq.seq_id] = first_row + accepted[spec.seq.seq_id]
        return accepted, last_rows

    def _verify_trees(self, speculating: list[SpeculatingSeq], trees: list[TokenTree],
                      logits: torch.Tensor, first_rows: list[int],
                      block_tables: dict[int, list[int]]) -> tuple[list[list[int]], list[int]]:
        """Each sequence's accepted path through its tree (node indices) and the token after it
        (greedy: argmax matching; sampling: the drafter's typical acceptance)."""
        paths, next_tokens, moves, argmax_rows = [], [], [], []
        for spec, tree, first_row in zip(speculating, trees, first_rows):
            rows = logits[first_row:first_row + 1 + len(tree)]
            if spec.params.greedy:
                argmax = rows.argmax(dim=-1).tolist()
                argmax_rows.append(argmax)
                path = tree.accepted_path(greedy_accepts(tree, argmax))
                next_tokens.append(argmax[1 + path[-1] if path else 0])
            else:
                probs = probabilities(rows, [spec.params] * len(rows))
                path = tree.accepted_path(typical_accepts(
                    tree, probs, self.drafter.typical_epsilon, self.drafter.typical_delta))
                end = probs[1 + path[-1] if path else 0]
                next_tokens.append(int(self.sampler.draw(end[None], [spec.generator])[0]))
            paths.append(path)
            seq = spec.seq
            moves += compaction_moves(block_tables[seq.seq_id], self.runner.block_size,
                                      seq.num_tokens - 1, path)
        if moves:
            self._move_slots(moves)
        # Lookahead's Jacobi update (the other drafters keep nothing across verifications).
        self.drafter.observe_verification(speculating, trees, argmax_rows)
        return paths, next_tokens

    def _move_slots(self, moves: list[tuple[int, int]]) -> None:
        """K/V of each (source, destination) slot pair, every target layer; all sources are
        read before any destination is written."""
        device = self.runner.kv_caches[0].device
        sources = torch.tensor([src for src, _ in moves], dtype=torch.int64, device=device)
        destinations = torch.tensor([dst for _, dst in moves], dtype=torch.int64, device=device)
        for cache in self.runner.kv_caches:
            keys, values = (cache[i].flatten(0, 1)[sources] for i in (0, 1))
            self.runner.ops.write_kv_cache(keys, values, cache, destinations)

    def _verify(self, speculating: list[SpeculatingSeq], proposal: DraftProposal,
                logits: torch.Tensor, first_rows: list[int], sampled, stopped) -> dict[int, int]:
        """Accept a prefix of each sequence's drafts and add one token; logits rows
        first_rows[b] .. first_rows[b] + len(drafts) are sequence b's verified positions."""
        device = logits.device
        num_rows = len(speculating)
        max_drafts = max(len(tokens) for tokens in proposal.tokens)
        num_drafts = torch.tensor([len(tokens) for tokens in proposal.tokens], device=device)
        draft_tokens = torch.zeros(num_rows, max_drafts, dtype=torch.int64, device=device)
        for row, tokens in enumerate(proposal.tokens):
            draft_tokens[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
        # Row b's positions 0..K; past its own drafts they repeat its last one (never examined).
        offsets = torch.arange(max_drafts + 1, device=device)
        target_rows = (torch.tensor(first_rows, device=device)[:, None]
                       + torch.minimum(offsets[None, :], num_drafts[:, None]))
        target_logits = logits[target_rows]                     # [rows, K + 1, vocab]

        num_accepted = torch.zeros(num_rows, dtype=torch.int64, device=device)
        next_tokens = torch.zeros(num_rows, dtype=torch.int64, device=device)
        greedy = [row for row, spec in enumerate(speculating) if spec.params.greedy]
        if greedy:
            num_accepted[greedy], next_tokens[greedy] = verify_greedy(
                target_logits[greedy].argmax(dim=-1), draft_tokens[greedy], num_drafts[greedy])
        rows = [row for row, spec in enumerate(speculating) if not spec.params.greedy]
        if rows:
            vocab = logits.shape[1]
            target_probs = probabilities(
                target_logits[rows].reshape(-1, vocab),
                [speculating[row].params for row in rows for _ in range(max_drafts + 1)]
            ).view(len(rows), max_drafts + 1, vocab)
            generators = [speculating[row].generator for row in rows]
            uniforms = self.sampler.uniform([len(proposal.tokens[row]) for row in rows],
                                            max_drafts, device, generators)
            noise = self.sampler.exponential(len(rows), vocab, device, generators)
            draft_probs = None if proposal.probs is None else proposal.probs[rows]
            num_accepted[rows], next_tokens[rows] = rejection_sample(
                target_probs, draft_tokens[rows], draft_probs, num_drafts[rows], uniforms, noise)

        accepted_counts = num_accepted.tolist()
        # A draft the drafter could not propose counts as rejected, since the plan charged for it
        # and the simulator's acceptance model draws over all k.
        self.acceptance_stats.record([spec.num_drafts for spec in speculating], accepted_counts,
                                     [spec.seq.starts_run for spec in speculating])
        return self._emit(speculating, [tokens[:accepted] for tokens, accepted
                                        in zip(proposal.tokens, accepted_counts)],
                          next_tokens.tolist(), sampled, stopped)

    def _emit(self, speculating: list[SpeculatingSeq], accepted_tokens: list[list[int]],
              next_tokens: list[int], sampled, stopped) -> dict[int, int]:
        """Each speculating sequence's new tokens: its accepted drafts and the next token, cut
        after an EOS. Returns seq_id -> drafts accepted."""
        eos = self.eos_token_id
        accepted_by_seq = {}
        for spec, tokens, next_token in zip(speculating, accepted_tokens, next_tokens):
            seq = spec.seq
            outputs = seq.output_token_ids
            stops_at_eos = not spec.params.ignore_eos
            if stops_at_eos and outputs and outputs[-1] == eos:
                # A forked sample whose first token was EOS (see _sample): it gains nothing.
                sampled[seq.seq_id] = []
                stopped.add(seq.seq_id)
                accepted_by_seq[seq.seq_id] = 0
                continue
            accepted_by_seq[seq.seq_id] = len(tokens)
            new_tokens = tokens + [next_token]
            if stops_at_eos and eos in new_tokens:
                new_tokens = new_tokens[:new_tokens.index(eos) + 1]
                stopped.add(seq.seq_id)
            sampled[seq.seq_id] = new_tokens
        return accepted_by_seq

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
            first_sample = _sample_index(seq)
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


def _sample_index(seq: Sequence) -> int:
    """Which of its request's n samples `seq` is."""
    sequences = seq.request.sequences
    return 0 if len(sequences) == 1 else sequences.index(seq)
