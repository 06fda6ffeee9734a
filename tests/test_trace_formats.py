"""The trace formats of `workload=trace` (sim/core/workload/trace.py, mooncake.py): the Azure 2024
and BurstGPT CSV schemas told apart by their header or named by `workload.format`, a session
column carried onto requests, the Mooncake JSONL reader, and one clear line for a bad file."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from sim.core.workload import build_workload

AZURE_2024 = ("TIMESTAMP,ContextTokens,GeneratedTokens,session_id\n"
              "2024-05-10 00:00:00.009930+00:00,4808,10,3\n"
              "2024-05-10 00:00:00.250000+00:00,3180,8,\n"
              "2024-05-10 00:00:01.000000+00:00,110,27,3\n")
BURSTGPT = ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type,session_id\n"
            "5,ChatGPT,472,18,490,Conversation log,chat-a\n"
            "45,ChatGPT,1087,0,1087,Conversation log,chat-b\n"
            "118,GPT-4,417,85,502,API log,\n"
            "120,ChatGPT,0,12,12,API log,chat-a\n"
            "130,ChatGPT,905,101,1006,Conversation log,chat-a\n")


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def replay(path: Path, **fields) -> list:
    return build_workload({"kind": "trace", "trace_path": str(path), **fields}, seed=0,
                          vocab_size=1000)


def test_azure_2024_schema_and_its_session_column(tmp_path):
    requests = replay(write(tmp_path, "azure.csv", AZURE_2024))
    assert [(r.arrival_time, r.prompt_len, r.output_len, r.session_id) for r in requests] == [
        (0.0, 4808, 10, 3), (pytest.approx(0.24007), 3180, 8, None),
        (pytest.approx(0.99007), 110, 27, 3)]


def test_burstgpt_schema_skips_failed_requests_and_keeps_session_names(tmp_path, capsys):
    path = write(tmp_path, "burst.csv", BURSTGPT)
    requests = replay(path)
    # The rows with 0 response or 0 request tokens are failed requests: not replayed.
    assert [(r.arrival_time, r.prompt_len, r.output_len, r.session_id) for r in requests] == [
        (0.0, 472, 18, "chat-a"), (113.0, 417, 85, None), (125.0, 905, 101, "chat-a")]
    assert capsys.readouterr().err == (
        f"twinserve: trace {path}: skipped 2 BurstGPT row(s) with 0 Request tokens or "
        f"Response tokens (failed requests)\n")
    # Named explicitly, the same; named wrongly, the columns the named schema lacks.
    assert len(replay(path, format="burstgpt")) == 3
    with pytest.raises(ValueError) as error:
        replay(path, format="azure")
    assert str(error.value) == (
        f"trace {path}: missing column(s) TIMESTAMP, ContextTokens, GeneratedTokens; found "
        f"Timestamp, Model, Request tokens, Response tokens, Total tokens, Log Type, session_id; "
        f"expected TIMESTAMP, ContextTokens, GeneratedTokens (azure)")


def test_a_schema_missing_a_column_names_the_file_and_the_column(tmp_path):
    path = write(tmp_path, "burst.csv", "Timestamp,Model,Request tokens\n5,ChatGPT,472\n")
    with pytest.raises(ValueError) as error:
        replay(path)
    message = str(error.value)
    assert message.startswith(f"trace {path}: missing column(s) Response tokens; found "
                              f"Timestamp, Model, Request tokens; expected ")
    assert "(burstgpt)" in message and "(azure)" in message and "\n" not in message


def test_a_header_with_all_of_one_schema_is_that_schema(tmp_path):
    # A plain trace with a column BurstGPT also has is plain: all its columns are there.
    path = write(tmp_path, "p.csv", "arrival_time,prompt_len,output_len,Timestamp\n0,5,6,x\n")
    assert [(r.prompt_len, r.output_len) for r in replay(path)] == [(5, 6)]


def test_format_key_is_checked(tmp_path):
    path = write(tmp_path, "azure.csv", AZURE_2024)
    with pytest.raises(ValueError, match="workload.format must be one of auto, azure, burstgpt, "
                                         "plain, mooncake; got 'csv'"):
        replay(path, format="csv")
    # A CSV named a Mooncake trace is read as one: its first line is not JSON.
    with pytest.raises(ValueError, match=rf"trace {path}: line 1: not JSON"):
        replay(path, format="mooncake")


def test_plain_session_ids_are_integers_unless_one_is_not(tmp_path):
    numbers = write(tmp_path, "n.csv", "arrival_time,prompt_len,output_len,session_id\n"
                                       "0,5,5,7\n1,5,5,-2\n2,5,5,\n")
    assert [r.session_id for r in replay(numbers)] == [7, -2, None]
    names = write(tmp_path, "s.csv", "arrival_time,prompt_len,output_len,session_id\n"
                                     "0,5,5,7\n1,5,5,x1\n")
    assert [r.session_id for r in replay(names)] == ["7", "x1"]
    # No session column: Request's default.
    plain = write(tmp_path, "p.csv", "arrival_time,prompt_len,output_len\n0,5,5\n")
    assert replay(plain)[0].session_id is None


def mooncake_line(**overrides) -> str:
    return json.dumps({"timestamp": 0, "input_length": 600, "output_length": 3,
                       "hash_ids": [1, 2], **overrides}) + "\n"


def test_mooncake_is_detected_and_replayed_in_arrival_order(tmp_path):
    # Out of order, ms, a session key; no .jsonl suffix: its first character tells.
    path = write(tmp_path, "trace.txt",
                 mooncake_line(timestamp=2500, session_id=4) + "\n"
                 + mooncake_line(timestamp=500, input_length=512, hash_ids=[1]))
    requests = replay(path, time_scale=2.0)
    assert [(r.arrival_time, r.prompt_len, r.output_len, r.session_id) for r in requests] == [
        (0.0, 512, 3, None), (4.0, 600, 3, 4)]
    assert requests[1].prompt_token_ids[:512] == requests[0].prompt_token_ids
    assert len(replay(path, format="mooncake", max_requests=1)) == 1


@pytest.mark.parametrize("line, message", [
    ("{not json\n", "line 1: not JSON"),
    ("[1, 2]\n", "line 1: expected a JSON object with timestamp, input_length"),
    (mooncake_line().replace('"hash_ids"', '"ids"'),
     r"line 1: missing key\(s\) hash_ids; a Mooncake trace line has"),
    (mooncake_line(hash_ids=[1]), "line 1: 1 hash_ids for an input_length of 600 "
                                  r"\(one per 512-token block: 2\)"),
    (mooncake_line(hash_ids=[1, "b"]), "line 1: hash_ids must be a list of integers in"),
    (mooncake_line(input_length=0), "line 1: input_length must be a positive integer, got 0"),
    (mooncake_line(output_length=2.5), "line 1: output_length must be a positive integer"),
    (mooncake_line(timestamp="noon"), "line 1: timestamp must be a number of ms, got 'noon'"),
])
def test_a_bad_mooncake_line_is_named(tmp_path, line, message):
    path = write(tmp_path, "bad.jsonl", line)
    with pytest.raises(ValueError, match=rf"^trace {path}: {message}"):
        replay(path)


def test_mooncake_needs_a_vocabulary_and_refuses_a_shared_prefix(tmp_path):
    path = write(tmp_path, "t.jsonl", mooncake_line())
    with pytest.raises(ValueError, match="workload.trace_path: the Mooncake trace .* needs a "
                                         "vocab_size"):
        build_workload({"kind": "trace", "trace_path": str(path)}, seed=0)
    with pytest.raises(ValueError, match="workload.shared_prefix_len: trace .* has its own"):
        replay(path, with_token_ids=True, shared_prefix_len=4)


def test_one_shared_timezone_offset_is_parsed_vectorised(monkeypatch):
    # Azure 2024's "+00:00" on every row cancels out of the differences: numpy parses the rows
    # at once (the row-by-row path would take minutes on the week-long trace); mixed offsets
    # still count, one row at a time.
    from datetime import datetime as real_datetime

    from sim.core.workload import trace

    values = ["2024-05-10 00:00:00.1234567+00:00", "2024-05-10 00:00:01.5+00:00",
              "2024-05-10 00:00:00+00:00"]
    mixed = ["2024-05-10 01:00:00+01:00", "2024-05-10 00:00:30+00:00"]
    expected_mixed = list(trace._parse_datetimes(mixed, "TIMESTAMP", [2, 3], Path("t.csv")))

    class RowByRow:
        @staticmethod
        def fromisoformat(value):
            raise AssertionError("parsed row by row")

    monkeypatch.setattr(trace, "datetime", RowByRow)
    assert list(trace._parse_datetimes(values, "TIMESTAMP", [2, 3, 4], Path("t.csv"))) == [
        pytest.approx(0.1234567), 1.5, 0.0]
    assert expected_mixed == [0.0, 30.0]
    monkeypatch.setattr(trace, "datetime", real_datetime)
    assert list(trace._parse_datetimes(["2024-05-10T00:00:00Z", "2024-05-10T00:00:02.25Z"],
                                       "TIMESTAMP", [2, 3], Path("t.csv"))) == [0.0, 2.25]


def test_a_trace_reads_a_real_runs_arrival_s_column_too(tmp_path):
    """A --real CSV's `arrival_s` is a trace's `arrival_time` (sim/core/column_aliases.py)."""
    path = write(tmp_path, "run.csv", "arrival_s,prompt_len,output_len,ttft_s\n"
                                      "0.5,10,3,0.1\n0.0,20,4,0.1\n")
    assert [(r.arrival_time, r.prompt_len) for r in replay(path)] == [(0.0, 20), (0.5, 10)]
    both = write(tmp_path, "both.csv", "arrival_time,arrival_s,prompt_len,output_len\n"
                                       "0.0,0,10,3\n1.0,1.0,20,4\n")
    assert [r.arrival_time for r in replay(both)] == [0.0, 1.0]
    disagree = write(tmp_path, "disagree.csv", "arrival_time,arrival_s,prompt_len,output_len\n"
                                               "0.0,0.0,10,3\n1.0,2.0,20,4\n")
    with pytest.raises(ValueError) as error:
        replay(disagree)
    message = str(error.value)
    assert ("line 3: columns arrival_time and arrival_s are the same column under two names and "
            "disagree ('1.0' against '2.0')") in message and "\n" not in message
