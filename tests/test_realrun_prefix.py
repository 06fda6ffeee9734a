"""The prompts' prefix sharing of a measured LLMServingSim run, from its workload file's hash_ids
(calibration/realrun/prompt_blocks.py): token ids that share exactly the hashed blocks, prefix
cache hits in the replay equal to the blocks seen before, and a workload file of another run
refused."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from calibration.realrun.prompt_blocks import prompt_token_ids, seen_before_tokens
from calibration.realrun.readers import read_run
from calibration.realrun.replay import compose_replay_config, replay, simulate
from calibration.realrun.run import RealRunError, make_run
from calibration.validate.cli import main

# tiny-llama on the CPU spec's roofline: a handful of requests replay in well under a second.
OVERRIDES = ["cost_model=roofline"]
WORKLOAD = "sharegpt-tiny-4-sps0.1.jsonl"
# Four prompts: the second and fourth start like the first (2 and 3 of its 16-token blocks), the
# third shares nothing; every prompt ends with a partial block.
HASH_IDS = [[0, 1, 2], [0, 1, 3], [4], [0, 1, 2, 5]]
PROMPT_LENS = [50, 60, 20, 70]
SEEN_BEFORE = [0, 32, 0, 48]


def test_a_shared_first_block_is_equal_tokens_and_nothing_after_it():
    run = make_run(name="r", source="test", where="test", arrival_s=[0.0, 1.0, 2.0],
                   prompt_len=[40, 40, 40], output_len=[2, 2, 2], ttft_s=[0.1] * 3,
                   e2e_s=[0.2] * 3, prompt_hash_ids=[[5, 6], [5, 7], [5, 6]])
    first, second, third = prompt_token_ids(run, vocab_size=1000)
    assert [len(first), len(second), len(third)] == [40, 40, 40]
    assert first[:16] == second[:16]                  # hash id 5: the same block
    assert first[16:32] != second[16:32]              # 6 against 7
    assert first[:32] == third[:32]                   # the same ids, the same tokens
    assert first[32:] != third[32:]                   # but each partial tail its own


def write_run(root: Path, workload_rows: list[dict] | None = None) -> Path:
    """A run folder root/GPU/model as data/real-runs/llmservingsim/ holds it, its workload file
    in root: HASH_IDS' prompts arriving 10 s apart (each served alone), prefix caching on."""
    folder = root / "GPU" / "model"
    folder.mkdir(parents=True)
    requests = [{"request_id": f"bench-{i}", "input_toks": p, "output_toks": 4,
                 "arrival_time": 1000.0 + 10 * i, "queued_ts": 50.0 + 10 * i,
                 "scheduled_ts": 50.0 + 10 * i, "first_token_ts": 50.1 + 10 * i,
                 "last_token_ts": 50.4 + 10 * i} for i, p in enumerate(PROMPT_LENS)]
    (folder / "vllm_requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    (folder / "vllm_meta.json").write_text(json.dumps({
        "vllm_version": "0.19.0", "dataset_path": f"workloads/{WORKLOAD}",
        "engine_kwargs": {"model": "tiny-llama", "max_num_seqs": 8,
                          "max_num_batched_tokens": 256},
        "kv_cache": {"num_gpu_blocks": 64, "block_size": 16, "enable_prefix_caching": True},
        "hardware": {"device_name": "cpu"}}))
    rows = workload_rows if workload_rows is not None else [
        {"input_toks": p, "output_toks": 4, "arrival_time_ns": 10_000_000_000 * i,
         "hash_ids": ids} for i, (p, ids) in enumerate(zip(PROMPT_LENS, HASH_IDS))]
    (root / WORKLOAD).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


def test_the_replays_prefix_cache_hits_are_the_blocks_seen_before(tmp_path):
    run = read_run(write_run(tmp_path))
    assert seen_before_tokens(HASH_IDS, PROMPT_LENS).tolist() == SEEN_BEFORE
    assert f"prefix sharing from hash_ids ({WORKLOAD}): 40.0 % of prompt tokens" in run.notes[0]
    simulated = simulate(run, compose_replay_config(run, OVERRIDES))
    assert [r.num_cached_tokens for r in simulated.requests] == SEEN_BEFORE
    assert replay(run, OVERRIDES)["sim_prefix_cache_hit_rate"] == pytest.approx(80 / 200)


def test_a_run_without_its_workload_file_shares_nothing(tmp_path):
    folder = write_run(tmp_path)
    (tmp_path / WORKLOAD).unlink()
    run = read_run(folder)
    assert run.prompt_hash_ids is None
    assert f"workload file {WORKLOAD} (vllm_meta.json dataset_path) not found" in run.notes[0]
    assert replay(run, OVERRIDES)["sim_prefix_cache_hit_rate"] == 0.0


@pytest.mark.parametrize("change, message", [
    ({"output_toks": 5}, "line 2 has output_toks 5, request 2 of"),
    ({"arrival_time_ns": 11_000_000_000}, "line 2 arrives 1.000 s away from request 2 of"),
])
def test_a_workload_file_of_another_run_is_refused_in_one_line(tmp_path, capsys, change,
                                                                message):
    rows = [{"input_toks": p, "output_toks": 4, "arrival_time_ns": 10_000_000_000 * i,
             "hash_ids": ids} for i, (p, ids) in enumerate(zip(PROMPT_LENS, HASH_IDS))]
    rows[1].update(change)
    folder = write_run(tmp_path, rows)
    with pytest.raises(RealRunError, match=f"{WORKLOAD}: {message}") as error:
        read_run(folder)
    assert "\n" not in str(error.value)
    assert main(["--real", str(folder), "--out", str(tmp_path / "out")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_the_hash_ids_follow_their_requests_into_arrival_order():
    run = make_run(name="r", source="test", where="test", arrival_s=[1.0, 0.0],
                   prompt_len=[16, 32], output_len=[2, 2], ttft_s=[0.1] * 2, e2e_s=[0.2] * 2,
                   prompt_hash_ids=[[7], [8, 9]])
    assert run.prompt_len.tolist() == [32, 16] and run.prompt_hash_ids == [[8, 9], [7]]
