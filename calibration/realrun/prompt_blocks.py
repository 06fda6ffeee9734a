"""What an LLMServingSim run's prompts share, from its workload file (named by vllm_meta.json's
`dataset_path`, one request a line with chained `hash_ids`, one per full block of the prompt):
turned into token ids, so that the simulator's prefix cache finds exactly the blocks the prompts
shared.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from calibration.realrun.run import RealRun, RealRunError
from sim.core.workload.mooncake import hash_ids_token_ids

# Tokens per hash id: vLLM's default KV block size, which the workload files were hashed at.
WORKLOAD_BLOCK_TOKENS = 16
WORKLOAD_KEYS = ("input_toks", "output_toks", "arrival_time_ns", "hash_ids")
# The client's send time may trail the planned arrival a little, while another run's file is off
# by whole inter-arrival gaps within a few requests.
ARRIVAL_TOLERANCE_S = 0.5
# Folders searched for the workload file: the run's own, its parent and grandparent.
SEARCH_DEPTH = 3


def find_workload_file(folder: Path, dataset_path: str) -> Path | None:
    """The file named like `dataset_path` in `folder` or the SEARCH_DEPTH - 1 folders above it,
    the nearest first; None if there is none."""
    name = Path(str(dataset_path)).name
    for parent in [folder, *folder.parents][:SEARCH_DEPTH]:
        if (parent / name).is_file():
            return parent / name
    return None


def workload_hash_ids(path: Path, requests: list[dict], requests_path: Path) -> list[list[int]]:
    """Each request's hash ids from the workload file at `path`, one per line of `requests`;
    RealRunError naming the file where a line is malformed or the file is not this run's (other
    counts, lengths, or arrivals more than ARRIVAL_TOLERANCE_S apart)."""
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except OSError as error:
        raise RealRunError(f"{path}: cannot read: {error.strerror or error}") from None
    if len(lines) != len(requests):
        raise RealRunError(f"{path}: {len(lines)} requests, but {requests_path} has "
                           f"{len(requests)}: the workload file is not this run's")
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise RealRunError(f"{path}: line {number} is not JSON ({error.msg})") from None
        missing = [key for key in WORKLOAD_KEYS if key not in record]
        if missing:
            raise RealRunError(f"{path}: line {number} lacks field {missing[0]!r}")
        request = requests[number - 1]
        for key in ("input_toks", "output_toks"):
            if record[key] != request[key]:
                raise RealRunError(
                    f"{path}: line {number} has {key} {record[key]}, request {number} of "
                    f"{requests_path} {request[key]}: the workload file is not this run's")
        arrival = record["arrival_time_ns"]
        if isinstance(arrival, bool) or not isinstance(arrival, (int, float)):
            raise RealRunError(f"{path}: line {number}: arrival_time_ns must be a number, got "
                               f"{arrival!r}")
        ids = record["hash_ids"]
        if not isinstance(ids, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**63 for i in ids):
            raise RealRunError(f"{path}: line {number}: hash_ids must be a list of integers in "
                               f"[0, 2**63)")
        if len(ids) != record["input_toks"] // WORKLOAD_BLOCK_TOKENS:
            raise RealRunError(f"{path}: line {number}: {len(ids)} hash_ids for input_toks "
                               f"{record['input_toks']} (one per full {WORKLOAD_BLOCK_TOKENS}-"
                               f"token block)")
        records.append(record)
    if all(isinstance(request.get("arrival_time"), (int, float)) for request in requests):
        planned = np.array([record["arrival_time_ns"] for record in records], dtype=np.float64)
        sent = np.array([request["arrival_time"] for request in requests], dtype=np.float64)
        gap = np.abs((sent - sent[0]) - (planned - planned[0]) / 1e9)
        if gap.max() > ARRIVAL_TOLERANCE_S:
            number = int(np.argmax(gap > ARRIVAL_TOLERANCE_S)) + 1
            raise RealRunError(
                f"{path}: line {number} arrives {gap[number - 1]:.3f} s away from request "
                f"{number} of {requests_path} (at most {ARRIVAL_TOLERANCE_S} s): the workload "
                f"file is not this run's")
    return [list(record["hash_ids"]) for record in records]


def seen_before_tokens(hash_ids: list[list[int]], prompt_lens) -> np.ndarray:
    """Each prompt's tokens in blocks an earlier prompt already had (what an unlimited prefix
    cache serves it), at most all but its last token, which the engine computes for its logits."""
    seen: set[int] = set()
    served = np.zeros(len(hash_ids), dtype=np.int64)
    for index, (ids, prompt_len) in enumerate(zip(hash_ids, prompt_lens)):
        # Chained ids: a block seen before means every block before it was too.
        blocks = sum(1 for hash_id in ids if hash_id in seen)
        served[index] = min(blocks, (int(prompt_len) - 1) // WORKLOAD_BLOCK_TOKENS) \
            * WORKLOAD_BLOCK_TOKENS
        seen.update(ids)
    return served


def sharing_note(path: Path, hash_ids: list[list[int]], prompt_lens) -> str:
    """The report's line on the prompts' sharing."""
    share = seen_before_tokens(hash_ids, prompt_lens).sum() / float(np.sum(prompt_lens))
    return (f"prefix sharing from hash_ids ({path.name}): {100 * share:.1f} % of prompt tokens "
            f"in blocks seen before")


def prompt_token_ids(run: RealRun, vocab_size: int) -> list[list[int]]:
    """The run's prompts as token ids in [0, vocab_size): equal hash ids, equal tokens; each
    prompt's partial last block an id no other prompt has, so it shares nothing."""
    first_free = 1 + max((hash_id for ids in run.prompt_hash_ids for hash_id in ids), default=-1)
    blocks = [[*ids, first_free + index] if prompt_len % WORKLOAD_BLOCK_TOKENS else list(ids)
              for index, (ids, prompt_len) in enumerate(zip(run.prompt_hash_ids,
                                                            run.prompt_len.tolist()))]
    return hash_ids_token_ids(blocks, run.prompt_len.tolist(), vocab_size,
                              WORKLOAD_BLOCK_TOKENS)
