"""Train the tiny target/draft pair that speculative decoding is tested and benchmarked with.

Byte-level Llamas (vocabulary = the 256 byte values) trained on the Python standard library's own
.py sources, which every Python installation ships, on one CPU thread in a few minutes:

- target: 3 layers, hidden 128, trained on the text (next-byte cross-entropy);
- draft: 1 layer, hidden 128, trained to imitate the target (KL from the target's next-byte
  distribution to the draft's), so its proposals are what the target would say: the thing
  speculative decoding's acceptance rate measures.

Every 10th source file (sorted by path) is held out: `held_out_text()` gives it to the benchmark
and the tests as prompts the models never saw. Writes HF checkpoint folders (config.json +
model.safetensors, fp16 weights) to models/tiny-pair/{target,draft}/ and the training log to
models/tiny-pair/training.json.

    python scripts/train_tiny_pair.py                  # ~12 minutes on one thread
    python scripts/train_tiny_pair.py --target-steps 20 --draft-steps 20 --out /tmp/pair  # smoke
"""
from __future__ import annotations

import argparse
import json
import math
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "models" / "tiny-pair"
VOCAB_SIZE = 256          # one token per byte value
HELD_OUT_EVERY = 10       # every 10th stdlib file is held out
MODEL_SHAPES = {
    "target": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=3),
    "draft": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=1),
}


def stdlib_sources() -> list[Path]:
    """The standard library's top-level modules and packages, tests excluded, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    excluded = {"test", "tests", "idle_test", "site-packages", "lib2to3", "ensurepip"}
    files = [path for path in root.rglob("*.py")
             if not excluded.intersection(path.relative_to(root).parts)]
    return sorted(files, key=lambda path: str(path.relative_to(root)))


def training_text() -> bytes:
    return b"\n".join(path.read_bytes() for index, path in enumerate(stdlib_sources())
                      if index % HELD_OUT_EVERY)


def held_out_text() -> bytes:
    """The files the pair never trained on (prompts for the benchmark and the tests)."""
    return b"\n".join(path.read_bytes() for index, path in enumerate(stdlib_sources())
                      if index % HELD_OUT_EVERY == 0)


def held_out_prompts(count: int, length: int, offset: float = 0.0) -> list[list[int]]:
    """`count` windows of `length` bytes spread evenly over the held-out text, each starting
    `offset` (a fraction of the spacing) past its slot: two offsets give disjoint prompt sets."""
    text = held_out_text()
    stride = (len(text) - length) // count
    if not 0 <= offset < 1:
        raise ValueError(f"offset must be in [0, 1), got {offset!r}")
    start = int(offset * stride)
    return [list(text[start + i * stride:start + i * stride + length]) for i in range(count)]


def model_config(role: str):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB_SIZE, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=32, max_position_embeddings=2048, tie_word_embeddings=True,
                       bos_token_id=None, eos_token_id=None, pad_token_id=None,
                       **MODEL_SHAPES[role])


def batches(data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator):
    """Random windows of seq_len + 1 bytes, forever."""
    while True:
        starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=generator)
        yield torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()]).long()


def train(model, loss_fn, data, steps: int, args, log: list, role: str) -> None:
    generator = torch.Generator().manual_seed(args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01,
                                  betas=(0.9, 0.95))
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup)
        * 0.5 * (1 + math.cos(math.pi * min(step, steps) / steps)))
    model.train()
    start = time.perf_counter()
    for step, batch in zip(range(steps), batches(data, args.batch_size, args.seq_len, generator)):
        loss = loss_fn(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 50 == 0 or step == steps - 1:
            entry = dict(model=role, step=step, loss=round(loss.item(), 4),
                         seconds=round(time.perf_counter() - start, 1))
            log.append(entry)
            print(entry, flush=True)
    model.eval()


@torch.no_grad()
def evaluate(target, draft, data: torch.Tensor, args) -> dict:
    """Held-out next-byte loss of both, and how often their argmaxes agree (the greedy
    acceptance of one draft position) and sum min(p, q) (the sampled acceptance at T = 1)."""
    generator = torch.Generator().manual_seed(args.seed + 1)
    batch = next(batches(data, 32, args.seq_len, generator))
    inputs, labels = batch[:, :-1], batch[:, 1:]
    p_logits, q_logits = target(inputs).logits, draft(inputs).logits
    p, q = p_logits.softmax(-1), q_logits.softmax(-1)
    return dict(
        target_loss=round(F.cross_entropy(p_logits.flatten(0, 1), labels.flatten()).item(), 4),
        draft_loss=round(F.cross_entropy(q_logits.flatten(0, 1), labels.flatten()).item(), 4),
        greedy_agreement=round((p.argmax(-1) == q.argmax(-1)).float().mean().item(), 4),
        expected_sampled_acceptance=round(torch.minimum(p, q).sum(-1).mean().item(), 4))


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every training script here shares: batches, learning rate, seed, threads."""
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--target-steps", type=int, default=1200)
    parser.add_argument("--draft-steps", type=int, default=800)
    add_training_arguments(parser)
    args = parser.parse_args()
    from transformers import LlamaForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    data = torch.frombuffer(bytearray(training_text()), dtype=torch.uint8)
    held_out = torch.frombuffer(bytearray(held_out_text()), dtype=torch.uint8)
    print(f"training text: {len(data):,} bytes; held out: {len(held_out):,} bytes", flush=True)
    log: list[dict] = []

    target = LlamaForCausalLM(model_config("target"))

    def text_loss(batch):
        logits = target(batch[:, :-1]).logits
        return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    train(target, text_loss, data, args.target_steps, args, log, "target")
    target.requires_grad_(False)

    draft = LlamaForCausalLM(model_config("draft"))

    def distill_loss(batch):
        inputs = batch[:, :-1]
        with torch.no_grad():
            target_log_probs = target(inputs).logits.log_softmax(-1)
        draft_log_probs = draft(inputs).logits.log_softmax(-1)
        return F.kl_div(draft_log_probs.flatten(0, 1), target_log_probs.flatten(0, 1),
                        log_target=True, reduction="batchmean")

    train(draft, distill_loss, data, args.draft_steps, args, log, "draft")
    metrics = evaluate(target, draft, held_out, args)
    print(metrics, flush=True)

    for role, model in (("target", target), ("draft", draft)):
        model.half().save_pretrained(args.out / role)
    summary = dict(text="Python standard library .py sources (every 10th file held out), bytes",
                   training_bytes=len(data), held_out_bytes=len(held_out), args={
                       key: value for key, value in vars(args).items() if key != "out"},
                   shapes=MODEL_SHAPES, held_out_metrics=metrics, log=log)
    (args.out / "training.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
