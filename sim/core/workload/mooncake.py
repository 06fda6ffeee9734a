"""The Mooncake trace format (JSONL: `timestamp` ms, `input_length`, `output_length`, `hash_ids`)
and the prompt token ids its `hash_ids` stand for.

Each 512-token block id becomes token ids derived from the id alone, so equal ids are equal tokens
in every run and at every KV block size, and a prefix cache reuses exactly what the trace shares.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

MOONCAKE_BLOCK_TOKENS = 512   # the block size the trace was hashed at
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")

_MAX_HASH_ID = (1 << 64) - 1
_CHUNK_IDS = 4096   # bounds the temporary arrays of 512 uint64 per id


def read_mooncake(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[list[int]],
                                       dict[str, list]]:
    """(arrival_time s from the earliest line, input_length, output_length) arrays of a Mooncake
    trace in file order, each request's hash_ids, and its optional `session_id` values."""
    times, prompt_lens, output_lens, hash_ids, session_ids = [], [], [], [], []
    try:
        with open(path, encoding="utf-8-sig") as file:
            lines = [(number, line) for number, line in enumerate(file, start=1) if line.strip()]
    except OSError as error:
        raise ValueError(f"trace {path}: cannot read: {error.strerror or error}") from None
    if not lines:
        raise ValueError(f"trace {path}: no requests (a Mooncake trace has one JSON object a line)")
    for number, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"trace {path}: line {number}: not JSON ({error.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"trace {path}: line {number}: expected a JSON object with "
                             f"{', '.join(MOONCAKE_KEYS)}")
        missing = [key for key in MOONCAKE_KEYS if key not in record]
        if missing:
            raise ValueError(f"trace {path}: line {number}: missing key(s) {', '.join(missing)}; "
                             f"a Mooncake trace line has {', '.join(MOONCAKE_KEYS)}")
        timestamp = record["timestamp"]
        if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)) or not (
                math.isfinite(timestamp)):
            raise ValueError(f"trace {path}: line {number}: timestamp must be a number of ms, "
                             f"got {timestamp!r}")
        input_length = _positive_int(record["input_length"], "input_length", number, path)
        output_length = _positive_int(record["output_length"], "output_length", number, path)
        ids = record["hash_ids"]
        num_blocks = -(-input_length // MOONCAKE_BLOCK_TOKENS)
        if not isinstance(ids, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= _MAX_HASH_ID
                for i in ids):
            raise ValueError(f"trace {path}: line {number}: hash_ids must be a list of "
                             f"integers in [0, 2**64)")
        if len(ids) != num_blocks:
            raise ValueError(f"trace {path}: line {number}: {len(ids)} hash_ids for an "
                             f"input_length of {input_length} (one per {MOONCAKE_BLOCK_TOKENS}-"
                             f"token block: {num_blocks})")
        times.append(timestamp / 1000.0)
        prompt_lens.append(input_length)
        output_lens.append(output_length)
        hash_ids.append(ids)
        session_ids.append(record.get("session_id"))
    arrival_times = np.array(times, dtype=np.float64)
    metadata = {"session_id": session_ids} if any(s is not None for s in session_ids) else {}
    return (arrival_times - arrival_times.min(), np.array(prompt_lens, dtype=np.int64),
            np.array(output_lens, dtype=np.int64), hash_ids, metadata)


def _positive_int(value, key: str, line: int, path: Path) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"trace {path}: line {line}: {key} must be a positive integer, "
                         f"got {value!r}")
    return value


def hash_ids_token_ids(hash_ids: list[list[int]], prompt_lens: list[int], vocab_size: int,
                       block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[list[int]]:
    """Each prompt's token ids, its last block cut to its length; the int objects are shared, so
    a prompt costs a list pointer per token."""
    unique_ids = np.unique(np.array([hash_id for ids in hash_ids for hash_id in ids],
                                    dtype=np.uint64))
    vocabulary = np.arange(vocab_size).astype(object)   # one int object per token id
    blocks: dict[int, list[int]] = {}

    for start in range(0, len(unique_ids), _CHUNK_IDS):
        chunk = unique_ids[start:start + _CHUNK_IDS]
        blocks.update(zip(chunk.tolist(),
                          vocabulary[block_token_ids(chunk, vocab_size, block_tokens)].tolist()))
    token_ids = []
    for ids, prompt_len in zip(hash_ids, prompt_lens):
        prompt: list[int] = []
        for hash_id in ids:
            prompt += blocks[hash_id]
        del prompt[prompt_len:]  # the partial last block keeps its first tokens
        token_ids.append(prompt)
    return token_ids


def block_token_ids(hash_ids: np.ndarray, vocab_size: int,
                    block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> np.ndarray:
    """The token ids of each hash id, a row each, from SplitMix64 of the id and position so a
    block's tokens depend on nothing but its id."""
    keys = (_splitmix64(hash_ids.astype(np.uint64))[:, None]
            + np.arange(block_tokens, dtype=np.uint64)[None, :])
    return (_splitmix64(keys) % np.uint64(vocab_size)).astype(np.int32 if vocab_size < 2**31
                                                               else np.int64)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function on an array of uint64 (wrapping arithmetic)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))
