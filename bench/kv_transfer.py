"""The engine's KV transfer against the simulator's model of it: runs prompts of many lengths
through the disaggregated pair (engine.DisaggregatedLLM), fits the simulator's transfer model
(sim/core/cluster.py KVTransferModel: latency + bytes / bandwidth) to the measured copies by
least squares, and prints the fitted latency and bandwidth and how far the model, so fitted,
is from each measured copy. The fitted values are what `cluster.kv_transfer.latency_ms` and
`cluster.kv_transfer.bandwidth_gbps` would be for this machine's device-to-device copy.

    python bench/kv_transfer.py                  # tiny-llama, CPU, one thread
    python bench/kv_transfer.py --device cuda --model llama-2-7b --lens 256 1024 4096
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine import DisaggregatedLLM, SamplingParams  # noqa: E402
from sim.core.cluster import KVTransferModel  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--device", default=None)
    parser.add_argument("--lens", type=int, nargs="+",
                        default=[16, 64, 128, 256, 512, 768, 1024, 1536, 2000])
    parser.add_argument("--repeats", type=int, default=5, help="prompts of each length")
    args = parser.parse_args()
    torch.set_num_threads(1)

    llm = DisaggregatedLLM(args.model, device=args.device, seed=0)
    vocab = llm.spec.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (length,), generator=generator).tolist()
               for length in args.lens for _ in range(args.repeats)]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)   # warm-up, not measured
    llm.generate(prompts, params, use_tqdm=False)
    transfers = llm.last_transfers

    # Per length the median copy: a copy now and then waits on the machine (another process,
    # the allocator), which a least-squares fit over single copies would follow.
    lens = sorted({transfer.num_tokens for transfer in transfers})
    num_bytes = np.array([next(t.num_bytes for t in transfers if t.num_tokens == length)
                          for length in lens], dtype=np.float64)
    seconds = np.array([np.median([t.seconds for t in transfers if t.num_tokens == length])
                        for length in lens])
    design = np.stack([np.ones_like(num_bytes), num_bytes], axis=1)
    (latency_s, seconds_per_byte), *_ = np.linalg.lstsq(design, seconds, rcond=None)
    model = KVTransferModel(bandwidth_gbps=1.0 / seconds_per_byte / 1e9,
                            latency_ms=max(latency_s, 0.0) * 1000.0, overlap=False,
                            topology="per_replica", kv_bytes_per_token=0,
                            num_layers=llm.spec.num_layers)
    predicted = np.array([model.duration(int(b), 0.0) for b in num_bytes])
    relative = np.abs(predicted - seconds) / seconds
    print(f"{llm.spec.name} on {llm.device}: {len(transfers)} transfers of "
          f"{num_bytes.min() / 2**20:.2f}-{num_bytes.max() / 2**20:.2f} MiB")
    print(f"fit: latency_ms={model.latency_ms:.4f} bandwidth_gbps={model.bandwidth_gbps:.2f}")
    print(f"model vs measured median copy: median error {np.median(relative):.1%}, "
          f"largest {relative.max():.1%}")
    print(f"{'prompt':>7} {'MiB':>8} {'measured ms':>12} {'model ms':>9}")
    for length, size, measured, modelled in zip(lens, num_bytes, seconds, predicted):
        print(f"{length:>7} {size / 2**20:>8.2f} {measured * 1000:>12.3f} "
              f"{modelled * 1000:>9.3f}")


if __name__ == "__main__":
    main()
