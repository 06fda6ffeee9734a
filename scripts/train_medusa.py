"""Train Medusa heads for the shipped tiny target (models/tiny-pair/target), as
scripts/train_tiny_pair.py trained the pair, and write them beside it (models/tiny-pair/medusa).

Head k (1..K) reads the target's final hidden state at position t and learns the target's own
next-byte distribution at position t + k (KL, self-distillation: the heads learn what the
target would say k tokens further on, which is what greedy acceptance checks). The target is
frozen; each head is a residual block (initialised to zero) and a projection initialised from
the target's LM head. The same text as the pair's (the Python standard library's sources, every
10th file held out); on one CPU thread in about a minute.

    python scripts/train_medusa.py                       # K = 4 heads, 600 steps
    python scripts/train_medusa.py --steps 20 --out /tmp/medusa   # smoke
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from engine.medusa import MedusaHeads  # noqa: E402
from train_tiny_pair import (DEFAULT_OUT, add_training_arguments, batches,  # noqa: E402
                             held_out_text, training_text)

TARGET = DEFAULT_OUT / "target"


def head_losses(target, heads: MedusaHeads, batch: torch.Tensor) -> torch.Tensor:
    """Per head, KL from the target's distribution at t + k to head k's at t, averaged."""
    with torch.no_grad():
        output = target.model(batch)
        hidden = output.last_hidden_state                         # [b, s, hidden]
        target_log_probs = target.lm_head(hidden).log_softmax(-1)
    logits = heads(hidden.flatten(0, 1)).view(heads.num_heads, *hidden.shape[:2], -1)
    losses = []
    for k in range(1, heads.num_heads + 1):
        predicted = logits[k - 1, :, :-k].log_softmax(-1)
        wanted = target_log_probs[:, k:]
        losses.append(F.kl_div(predicted.flatten(0, 1), wanted.flatten(0, 1), log_target=True,
                               reduction="batchmean"))
    return torch.stack(losses)


@torch.no_grad()
def agreement(target, heads: MedusaHeads, data: torch.Tensor, seq_len: int,
              seed: int) -> list[float]:
    """Per head on held-out text: how often its argmax is the target's argmax k tokens on (the
    greedy acceptance of a one-node-per-depth tree, given the earlier depths passed)."""
    batch = next(batches(data, 32, seq_len, torch.Generator().manual_seed(seed)))
    hidden = target.model(batch).last_hidden_state
    target_argmax = target.lm_head(hidden).argmax(-1)
    logits = heads(hidden.flatten(0, 1)).view(heads.num_heads, *hidden.shape[:2], -1)
    return [round((logits[k - 1, :, :-k].argmax(-1) == target_argmax[:, k:]).float().mean()
                  .item(), 4) for k in range(1, heads.num_heads + 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", type=Path, default=TARGET)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT / "medusa")
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--steps", type=int, default=600)
    add_training_arguments(parser)
    args = parser.parse_args()
    from transformers import LlamaForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    target = LlamaForCausalLM.from_pretrained(args.target, torch_dtype=torch.float32)
    target.requires_grad_(False).eval()
    heads = MedusaHeads.seeded(target.lm_head, args.num_heads, args.seed)
    with torch.no_grad():
        for block in heads.blocks:
            block.weight.zero_()   # each head starts as the LM head on the hidden state
    data = torch.frombuffer(bytearray(training_text()), dtype=torch.uint8)
    held_out = torch.frombuffer(bytearray(held_out_text()), dtype=torch.uint8)

    optimizer = torch.optim.AdamW(heads.parameters(), lr=args.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.steps)
    generator = torch.Generator().manual_seed(args.seed)
    log: list[dict] = []
    start = time.perf_counter()
    for step, batch in zip(range(args.steps),
                           batches(data, args.batch_size, args.seq_len, generator)):
        losses = head_losses(target, heads, batch)
        optimizer.zero_grad(set_to_none=True)
        losses.mean().backward()
        optimizer.step()
        schedule.step()
        if step % 50 == 0 or step == args.steps - 1:
            entry = dict(step=step, losses=[round(x, 4) for x in losses.tolist()],
                         seconds=round(time.perf_counter() - start, 1))
            log.append(entry)
            print(entry, flush=True)
    heads.eval()
    metrics = dict(held_out_argmax_agreement=agreement(target, heads, held_out, args.seq_len,
                                                       args.seed + 1))
    print(metrics, flush=True)
    heads.half().save(args.out, target=str(args.target.relative_to(REPO))
                      if args.target.is_relative_to(REPO) else str(args.target))
    (args.out / "training.json").write_text(json.dumps(dict(
        text="Python standard library .py sources (every 10th file held out), bytes",
        args={key: str(value) if isinstance(value, Path) else value
              for key, value in vars(args).items()},
        held_out_metrics=metrics, log=log), indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
