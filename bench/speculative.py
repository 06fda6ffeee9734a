"""Speculative decoding on the engine: output tokens/s with and without speculation, per k and
batch size, with each drafter (a draft model, n-gram lookup, Medusa heads, lookahead decoding),
and the acceptance rate of every draft position (tree depth for Medusa and lookahead). Writes the
acceptance statistics files the simulator's acceptance model reads
(`speculation.acceptance_profile=...`).

The pair is models/tiny-pair (scripts/train_tiny_pair.py: a 3-layer byte-level target and a
1-layer draft distilled from it, trained on the Python standard library's sources; Medusa heads
from scripts/train_medusa.py in models/tiny-pair/medusa); prompts are
windows of the files it never trained on. Greedy by default, so every speculative run must give
the target's own tokens (checked: a mismatch is printed).

    python bench/speculative.py                              # ~8 minutes here, one thread
    python bench/speculative.py --batch-sizes 1 4 --ks 1 2 4 --max-tokens 64
    python bench/speculative.py --drafters medusa lookahead --ks 2 4
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from engine import LLM, SamplingParams  # noqa: E402
from policies.speculation import AcceptanceCounts  # noqa: E402
from train_tiny_pair import held_out_prompts  # noqa: E402

PAIR = REPO / "models" / "tiny-pair"
DRAFTERS = {"draft": dict(speculative_model=str(PAIR / "draft")),
            "ngram": dict(speculative_model="ngram"),
            "medusa": dict(speculative_model="medusa", medusa_heads=str(PAIR / "medusa")),
            "lookahead": dict(speculative_model="lookahead")}
DRAFTER_NAMES = {"draft": "models/tiny-pair/draft", "medusa": "models/tiny-pair/medusa"}
LOOKAHEAD_BRANCHES = 4   # window W and guesses G, fewer where (W + G) x k passes the tree mask


def speculative_llm(target: str, drafter: str, k: int) -> LLM:
    settings = dict(DRAFTERS[drafter])
    if drafter == "lookahead":
        branches = min(LOOKAHEAD_BRANCHES, 62 // (2 * k))
        settings.update(lookahead_window=branches, lookahead_guesses=branches)
    return LLM(target, num_speculative_tokens=k, **settings)


def warm_up(llm: LLM, prompts) -> None:
    """One untimed short request; its drafts are not counted in the acceptance statistics."""
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    llm.executor.acceptance_stats = llm.executor.acceptance_stats.cleared()


def sequence_counts(llm: LLM, prompts, params: SamplingParams) -> list[dict]:
    """Each prompt run alone: its counts per draft position, fresh and over every step, and per
    tree node for a fixed tree (how acceptance varies from one text to another, which the
    simulator's acceptance model fits a spread to)."""
    counts = []
    for prompt in prompts:
        llm.executor.acceptance_stats = llm.executor.acceptance_stats.cleared()
        llm.generate([prompt], params, use_tqdm=False)
        counts.append(llm.executor.acceptance_stats.counts())
    return counts


def timed_run(llm: LLM, prompts, params: SamplingParams) -> tuple[list[list[int]], float]:
    """(outputs, output tokens/s) of one generate() call."""
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = [out.outputs[0].token_ids for out in outputs]
    return tokens, sum(map(len, tokens)) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--ks", type=int, nargs="+", default=list(range(1, 9)))
    parser.add_argument("--drafters", nargs="+", default=list(DRAFTERS), choices=DRAFTERS)
    parser.add_argument("--no-profiles", action="store_true",
                        help="print the table only; write no acceptance statistics files")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs; the fastest counts")
    parser.add_argument("--sequences", type=int, default=48,
                        help="windows run alone for the per-sequence counts (48: every third of "
                             "the 16-window spacing, a sixth of it from the validation's windows)")
    parser.add_argument("--out-dir", type=Path, default=REPO / "profiles" / "speculation")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            ignore_eos=True, seed=0 if args.temperature else None)
    prompts = held_out_prompts(max(args.batch_sizes), args.prompt_len)
    max_k = max(args.ks)
    counts: dict[str, AcceptanceCounts] = {}   # drafter -> counts of its k = max k runs
    target = str(PAIR / "target")
    print(f"target {target}; prompts {args.prompt_len} bytes of held-out text, "
          f"{args.max_tokens} output tokens, temperature {args.temperature}, "
          f"{args.threads} thread(s), fastest of {args.repeats} alternating runs each\n")
    header = (f"{'batch':>5} {'drafter':>7} {'k':>2} {'base':>8} {'spec':>8} {'speedup':>7} "
              f"{'tok/step':>8}  acceptance by position   (tok/s without and with speculation;"
              f" output tokens per step and sequence)")
    print(header)
    for batch_size in args.batch_sizes:
        batch = prompts[:batch_size]
        baseline = LLM(target)
        warm_up(baseline, batch)
        for drafter in args.drafters:
            for k in args.ks:
                llm = speculative_llm(target, drafter, k)
                warm_up(llm, batch)
                # Runs with and without speculation alternate, and the fastest of each counts:
                # a burst of load from elsewhere on the machine hits both alike.
                base_rate = rate = 0.0
                for _ in range(args.repeats):
                    reference, base_run = timed_run(baseline, batch, params)
                    outputs, run = timed_run(llm, batch, params)
                    base_rate, rate = max(base_rate, base_run), max(rate, run)
                steps = llm.last_stats.num_steps
                stats = llm.executor.acceptance_stats
                rates = stats.acceptance_rates()
                if k == max_k:   # every position examined: the statistics file's run
                    counts.setdefault(drafter, stats.cleared()).add(stats)
                mismatch = "" if (args.temperature or outputs == reference) else \
                    "  OUTPUT DIFFERS FROM THE TARGET'S"
                rates_text = " ".join("-" if r is None else f"{r:.2f}" for r in rates)
                tokens_per_step = sum(map(len, outputs)) / steps / batch_size
                print(f"{batch_size:>5} {drafter:>7} {k:>2} {base_rate:>8.0f} {rate:>8.0f} "
                      f"{rate / base_rate:>7.2f} {tokens_per_step:>8.2f}  {rates_text}{mismatch}",
                      flush=True)
    if args.no_profiles:
        return
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for drafter, drafter_counts in counts.items():
        llm = speculative_llm(target, drafter, max_k)
        sequences = sequence_counts(llm, held_out_prompts(args.sequences, args.prompt_len),
                                    params)
        sampled = f"-t{args.temperature:g}" if args.temperature else ""
        path = args.out_dir / f"tiny-pair-{drafter}{sampled}.json"
        source = (f"bench/speculative.py on {torch.get_num_threads()} CPU thread(s): "
                  f"temperature {args.temperature}, k={max_k}, batch sizes {args.batch_sizes}, "
                  f"{args.prompt_len}-byte prompts of held-out Python stdlib source, "
                  f"{args.max_tokens} output tokens each; sequences: {args.sequences} windows "
                  f"run alone")
        statistics = drafter_counts.to_statistics(
            drafter=DRAFTER_NAMES.get(drafter, drafter),
            target="models/tiny-pair/target", source=source)
        statistics["sequences"] = sequences   # each of the prompts run alone, at k = max k
        path.write_text(json.dumps(statistics, indent=1) + "\n")
        print(f"wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")


if __name__ == "__main__":
    main()
