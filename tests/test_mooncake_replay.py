"""The Mooncake trace replayed with prefix caching: its hash_ids become token ids whose sharing is
exactly the trace's (sim/core/workload/mooncake.py), so the prefix cache's hit rate equals the
reuse the hash_ids imply, at any KV block size, when the pool keeps everything."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from factories import make_cfg
from sim.core.experiment import run_experiment
from sim.core.workload import REPO_ROOT, build_workload

MOONCAKE_TRACE = REPO_ROOT / "data" / "traces" / "mooncake" / "synthetic_trace.jsonl"
# The test's slice: every request of the first NUM_SESSIONS prompts' first blocks (their
# sessions, as the trace keeps multi-turn order) that start at least MIN_TURNS requests; the
# trace's reuse is spread over its hour, so its first rows alone share little.
NUM_SESSIONS, MIN_TURNS = 10, 4
VOCAB_SIZE = 128256   # llama-3.1-8b's
HASH_BLOCK = 512


def session_rows() -> list[dict]:
    """The trace's rows (in its order) whose first hash id is one of the first NUM_SESSIONS
    that at least MIN_TURNS rows start with."""
    with open(MOONCAKE_TRACE) as file:
        rows = [json.loads(line) for line in file]
    turns = Counter(row["hash_ids"][0] for row in rows)
    sessions = list(dict.fromkeys(row["hash_ids"][0] for row in rows
                                  if turns[row["hash_ids"][0]] >= MIN_TURNS))[:NUM_SESSIONS]
    return [row for row in rows if row["hash_ids"][0] in sessions]


def spaced_trace(tmp_path: Path, rows: list[dict]) -> Path:
    """The rows, each arriving 1000 s after the previous: every request is served alone, its
    prompt's blocks in the cache before the next one arrives, so the expectation is exact."""
    path = tmp_path / "spaced.jsonl"
    path.write_text("".join(json.dumps({**row, "timestamp": index * 1_000_000}) + "\n"
                            for index, row in enumerate(rows)))
    return path


def block_lengths(row: dict) -> list[int]:
    """Tokens of each 512-token block of the row's prompt (the last may be partial)."""
    length = row["input_length"]
    return [min(HASH_BLOCK, length - HASH_BLOCK * index) for index in range(len(row["hash_ids"]))]


def shared_tokens(row: dict, earlier: dict) -> int:
    """Leading prompt tokens two rows have in common: their leading equal hash ids, each block
    counted as the tokens both hold of it (a partial block is its id's first tokens)."""
    common = 0
    for this_id, that_id, this_len, that_len in zip(row["hash_ids"], earlier["hash_ids"],
                                                    block_lengths(row), block_lengths(earlier)):
        if this_id != that_id:
            break
        common += min(this_len, that_len)
    return common


def implied_hit_rate(rows: list[dict], block_size: int) -> float:
    """The prefix cache's hit rate the trace implies when every request runs alone, in order,
    and nothing is evicted: each prompt's longest common prefix with an earlier prompt, in whole
    KV blocks, one token always left to compute."""
    cached = 0
    for index, row in enumerate(rows):
        common = max((shared_tokens(row, earlier) for earlier in rows[:index]), default=0)
        cached += min(common, row["input_length"] - 1) // block_size * block_size
    return cached / sum(row["input_length"] for row in rows)


def replay(trace: Path, block_size: int, num_blocks: int):
    cfg = make_cfg("workload=trace", f"workload.trace_path={trace}", "model=llama-3.1-8b",
                   "hardware=h100-80gb", "kv_cache.enable_prefix_caching=true",
                   f"kv_cache.block_size={block_size}", f"kv_cache.num_blocks={num_blocks}")
    return run_experiment(cfg).summary


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return session_rows()


@pytest.mark.parametrize("block_size", [16, 512])
def test_hit_rate_is_the_reuse_the_hash_ids_imply(tmp_path, rows, block_size):
    expected = implied_hit_rate(rows, block_size)
    assert expected > 0.5   # the slice shares a lot: a hit rate of 0 cannot pass
    total_tokens = sum(row["input_length"] + row["output_length"] for row in rows)
    summary = replay(spaced_trace(tmp_path, rows), block_size,
                     num_blocks=total_tokens // block_size + 2 * len(rows))
    assert summary["completed"] == len(rows) and summary["num_preemptions"] == 0
    assert summary["prefix_cache_hit_rate"] == pytest.approx(expected, abs=1e-12)


def test_a_small_pool_hits_less(tmp_path, rows):
    # Room for the longest request and little else: cached blocks are evicted between visits.
    block_size = 16
    longest = max(row["input_length"] + row["output_length"] for row in rows)
    summary = replay(spaced_trace(tmp_path, rows), block_size,
                     num_blocks=longest // block_size + 64)
    assert summary["completed"] == len(rows)
    assert summary["prefix_cache_hit_rate"] < 0.9 * implied_hit_rate(rows, block_size)


def test_equal_hash_ids_are_equal_tokens_and_a_partial_block_is_a_prefix(tmp_path):
    # Ids 7 and 8 shared; the last block is 7's first 100 or 300 tokens; 9 differs.
    lines = [{"timestamp": 0, "input_length": 2 * HASH_BLOCK + 100, "output_length": 1,
              "hash_ids": [7, 8, 7]},
             {"timestamp": 1, "input_length": 2 * HASH_BLOCK + 300, "output_length": 1,
              "hash_ids": [7, 8, 7]},
             {"timestamp": 2, "input_length": HASH_BLOCK, "output_length": 1, "hash_ids": [9]}]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    first, second, third = (r.prompt_token_ids for r in build_workload(
        {"kind": "trace", "trace_path": str(path)}, seed=0, vocab_size=VOCAB_SIZE))
    assert len(first) == 2 * HASH_BLOCK + 100 and len(second) == 2 * HASH_BLOCK + 300
    assert second[:len(first)] == first
    # The same id is the same tokens wherever it stands; different ids differ.
    assert first[2 * HASH_BLOCK:] == first[:100]
    assert third != first[:HASH_BLOCK] and third != first[HASH_BLOCK:2 * HASH_BLOCK]
    assert all(0 <= token < VOCAB_SIZE for token in first + third)
    # Another seed, another run: the same tokens (they are the trace's content, not draws).
    again = build_workload({"kind": "trace", "trace_path": str(path)}, seed=5,
                           vocab_size=VOCAB_SIZE)
    assert again[0].prompt_token_ids == first


@pytest.mark.parametrize("model, rejected", [("llama-2-7b", True), ("llama-3.1-8b", False)])
def test_a_short_context_model_rejects_the_trace_and_says_why(capsys, model, rejected):
    cfg = make_cfg("workload=trace", f"workload.trace_path={MOONCAKE_TRACE}",
                   "workload.max_requests=30", f"model={model}", "hardware=h100-80gb")
    summary = run_experiment(cfg).summary
    warning = capsys.readouterr().err
    if not rejected:   # 128k tokens of context hold every one of these prompts
        assert summary["rejected"] == 0 and "rejected" not in warning
        return
    # Llama-2's 4k context: every longer request is rejected (half of them), and the run says
    # why. (The trace is in arrival order, so its first 30 lines are the run's requests.)
    with open(MOONCAKE_TRACE) as file:
        lines = [json.loads(line) for line, _ in zip(file, range(30))]
    too_long = sum(line["input_length"] + line["output_length"] > 4096 for line in lines)
    assert summary["rejected"] == too_long > 0.05 * 30
    assert "exceeds max_model_len=4096" in summary["rejected_reason"]
    assert (f"twinserve: {summary['rejected']} of 30 requests" in warning
            and "exceeds max_model_len=4096" in warning and "model=llama-3.1-8b" in warning)
