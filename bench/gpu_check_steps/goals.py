"""What the GPU check's measuring steps must reach, and the verdict with its shortfall. On a GPU
the goals are issue 31's; --smoke runs the same verdicts with goals the CPU interpreter meets,
since its speeds say nothing about a GPU (tests/test_gpu_check.py checks each verdict fails)."""
from __future__ import annotations

from dataclasses import dataclass

# Decode cases whose K/V read must reach DECODE_BANDWIDTH_GOAL of the copy bandwidth:
# (num_seqs, context) at Llama-2-7B's 32 KV heads of 128.
LONG_CONTEXT_CASES = ((64, 2048), (16, 4096))


@dataclass(frozen=True)
class Goals:
    decode_bandwidth_share: float   # of the device's copy bandwidth, long-context decode
    engine_vs_hf: float             # engine output tok/s over HF generate's, same requests
    validation_gates: bool          # twinserve-validate's default gates on the fidelity grid


GPU_GOALS = Goals(decode_bandwidth_share=0.80, engine_vs_hf=2.0, validation_gates=True)
SMOKE_GOALS = Goals(decode_bandwidth_share=0.0, engine_vs_hf=0.0, validation_gates=False)


def goals_for(smoke: bool) -> Goals:
    return SMOKE_GOALS if smoke else GPU_GOALS


def bandwidth_verdict(share: float, goal: float) -> tuple[bool, str]:
    """(met, text): decode attention's share of the copy bandwidth against the goal."""
    if share >= goal:
        return True, f"{share:.0%} of copy (goal {goal:.0%})"
    return False, (f"{share:.0%} of copy, short of the {goal:.0%} goal by "
                   f"{(goal - share) * 100:.0f} points")


def throughput_verdict(ratio: float, goal: float) -> tuple[bool, str]:
    """(met, text): the engine's output tok/s over HF generate's against the goal."""
    if ratio >= goal:
        return True, f"{ratio:.2f}x (goal {goal:.1f}x)"
    return False, f"{ratio:.2f}x, short of the {goal:.1f}x goal by {goal - ratio:.2f}x"


def validation_verdict(failures: list[str]) -> tuple[bool, str]:
    """(passed, text) of one validation from its failures (twinserve-validate's missed gates,
    one line each): passed only without any."""
    if not failures:
        return True, "gates met"
    more = f" (+{len(failures) - 1} more)" if len(failures) > 1 else ""
    return False, f"gates missed: {failures[0]}{more}"
