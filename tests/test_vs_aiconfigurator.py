"""bench/vs_aiconfigurator.py without aiconfigurator installed: the predictions cache (fresh and
stale rows), the error arithmetic and per-group summaries on hand-made rows, finding the tool's
Python, and the one line when there is neither the tool nor a cache."""
from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import vs_aiconfigurator as bench  # noqa: E402

HEADER = next(csv.reader(open(REPO / "data/gpu/aiconfigurator/silicon_vllm.csv")))


def write_csv(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=HEADER, restval="")
        writer.writeheader()
        writer.writerows({"backend": "vllm", "mode": "agg", "pp_size": 1, **row} for row in rows)
    return path


def measured(id_, model="Qwen/Qwen3-32B", system="h100_sxm", precision="", conc=8,
             ttft=100.0, tpot=10.0, max_batch=None) -> dict:
    return {"id": id_, "model_path": model, "system": system, "precision": precision,
            "backend_version": "0.12.0", "isl": 1024, "osl": 128, "tp_size": 2,
            "batch_size": max_batch or conc, "silicon_concurrency": conc, "silicon_ttft_ms": ttft,
            "silicon_tpot_ms": tpot}


@pytest.fixture
def no_tool(monkeypatch):
    monkeypatch.setattr(bench, "find_tool_python", lambda given: None)


@pytest.fixture
def rows(tmp_path):
    return bench.select_rows(bench.read_rows(write_csv(tmp_path / "rows.csv", [
        measured("qwen-a", conc=8, ttft=100.0, tpot=10.0),
        measured("qwen-b", conc=16, ttft=200.0, tpot=20.0),
        measured("llama", model="meta-llama/Llama-3.1-70B", system="h200_sxm",
                 precision="fp8", ttft=50.0, tpot=5.0, max_batch=256)])))


def cache_file(path: Path, rows: list, predictions: dict[str, tuple[float, float]]) -> Path:
    path.write_text(json.dumps({"tool": "aiconfigurator", "version": "0.12.0", "rows": {
        row.id: {"request": bench.tool_request(row),
                 "backend_version_requested": row.backend_version or None,
                 "backend_version_used": "0.24.0", "ttft_ms": predictions[row.id][0],
                 "tpot_ms": predictions[row.id][1], "error": None}
        for row in rows if row.id in predictions}}))
    return path


def test_rows_map_to_the_tools_options(rows):
    by_id = {row.id: row for row in rows}
    assert bench.tool_request(by_id["llama"]) == {
        "model_path": "meta-llama/Meta-Llama-3.1-70B", "system_name": "h200_sxm",
        "backend_name": "vllm", "mode": "agg", "isl": 1024, "osl": 128, "batch_size": 8,
        "tp_size": 2, "pp_size": 1, "gemm_quant_mode": "fp8", "moe_quant_mode": "fp8"}
    assert "gemm_quant_mode" not in bench.tool_request(by_id["qwen-a"])
    assert bench.cli_command(bench.tool_request(by_id["qwen-b"]), None) == (
        "aiconfigurator cli estimate --model-path Qwen/Qwen3-32B --system h100_sxm --backend vllm "
        "--isl 1024 --osl 128 --batch-size 16 --tp-size 2 --pp-size 1")


def test_cache_serves_fresh_rows_and_skips_stale_ones(tmp_path, rows, no_tool):
    path = cache_file(tmp_path / "cache.json", rows, {"qwen-a": (110.0, 9.0),
                                                      "qwen-b": (150.0, 30.0)})
    cache = json.loads(path.read_text())
    cache["rows"]["qwen-b"]["request"]["batch_size"] = 99      # asked for another concurrency
    path.write_text(json.dumps(cache))
    predictions, notes = bench.aiconfigurator_predictions(rows, path, refresh=False, tool=None)
    assert set(predictions) == {"qwen-a"}
    assert predictions["qwen-a"]["ttft_ms"] == 110.0
    assert any("2 rows not in the cache" in note and "pip install aiconfigurator==0.12.0" in note
               for note in notes)
    assert any("1 rows from the cache" in note for note in notes)


def test_error_arithmetic_and_group_summaries(rows):
    aic = {"qwen-a": {"ttft_ms": 110.0, "tpot_ms": 9.0}, "qwen-b": {"ttft_ms": 150.0,
                                                                    "tpot_ms": 30.0}}
    twin = {"qwen-a": (100.0, 10.5), "llama": (60.0, 4.0)}
    records = [bench.row_record(row, aic.get(row.id), twin.get(row.id)) for row in rows]
    by_id = {r["id"]: r for r in records}
    assert by_id["qwen-a"]["aiconfigurator_ttft_err_pct"] == pytest.approx(10.0)
    assert by_id["qwen-b"]["aiconfigurator_tpot_err_pct"] == pytest.approx(50.0)
    assert by_id["llama"]["twinserve_tpot_err_pct"] == pytest.approx(-20.0)
    assert by_id["llama"]["aiconfigurator_ttft_err_pct"] is None

    groups = bench.summarise_groups(records)
    qwen = groups["Qwen/Qwen3-32B h100_sxm bf16 vLLM 0.12.0"]
    assert qwen["aiconfigurator_ttft"] == {"n": 2, "mean_abs_err_pct": pytest.approx(17.5),
                                           "worst_abs_err_pct": pytest.approx(25.0),
                                           "worst_id": "qwen-b"}
    assert qwen["aiconfigurator_tpot"]["mean_abs_err_pct"] == pytest.approx(30.0)
    assert qwen["twinserve_tpot"]["n"] == 1                    # qwen-b has no twinserve value
    same = qwen["same_rows"]                                   # qwen-a only: both predict it
    assert same["aiconfigurator_ttft"]["n"] == same["twinserve_ttft"]["n"] == 1
    assert same["aiconfigurator_ttft"]["mean_abs_err_pct"] == pytest.approx(10.0)
    llama = groups["meta-llama/Llama-3.1-70B h200_sxm fp8 vLLM 0.12.0"]
    assert llama["aiconfigurator_tpot"] == {"n": 0, "mean_abs_err_pct": None,
                                            "worst_abs_err_pct": None, "worst_id": None}
    assert llama["twinserve_ttft"]["worst_abs_err_pct"] == pytest.approx(20.0)


def test_main_prints_both_tools_and_writes_out(tmp_path, rows, no_tool, monkeypatch, capsys):
    csv_path = write_csv(tmp_path / "rows.csv", [measured("qwen-a"),
                                                 measured("qwen-b", conc=16, ttft=200.0, tpot=20.0)])
    path = cache_file(tmp_path / "cache.json", rows, {"qwen-a": (110.0, 9.0),
                                                      "qwen-b": (150.0, 30.0)})
    monkeypatch.setattr(bench, "twinserve_predictions",
                        lambda chosen: ({"qwen-a": (95.0, 10.0)}, ["twinserve: hand-made"]))
    out = tmp_path / "out.json"
    bench.main(["--csv", str(csv_path), "--cache", str(path), "--model", "qwen3-32b",
                "--out", str(out)])
    text = capsys.readouterr().out
    assert "qwen-a" in text and "+10.0%" in text and "-5.0%" in text
    summary = json.loads(out.read_text())["groups"]["Qwen/Qwen3-32B h100_sxm bf16 vLLM 0.12.0"]
    assert summary["aiconfigurator_ttft"]["worst_abs_err_pct"] == pytest.approx(25.0)
    assert summary["twinserve_ttft"]["n"] == 1


def test_no_tool_and_no_cache_is_one_line(tmp_path, no_tool):
    csv_path = write_csv(tmp_path / "rows.csv", [measured("qwen-a")])
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--csv", str(csv_path), "--cache", str(tmp_path / "absent.json"),
                    "--model", "Qwen3-32B"])
    message = str(exit_.value.code)
    assert "\n" not in message
    assert "pip install aiconfigurator==0.12.0" in message and "--aiconfigurator" in message


def test_refresh_without_the_tool_says_how_to_install(tmp_path, rows, no_tool):
    path = cache_file(tmp_path / "cache.json", rows, {"qwen-a": (110.0, 9.0)})
    with pytest.raises(SystemExit, match="--refresh needs aiconfigurator: pip install"):
        bench.aiconfigurator_predictions(rows, path, refresh=True, tool=None)


def test_tool_python_from_venv_folder_or_console_script(tmp_path):
    venv_python = tmp_path / "venv/bin/python"
    venv_python.parent.mkdir(parents=True)
    venv_python.write_text("")
    script = tmp_path / "elsewhere/aiconfigurator"          # no python beside it: the #! line
    script.parent.mkdir()
    script.write_text(f"#!{venv_python}\nfrom aiconfigurator.main import main\n")
    assert bench.find_tool_python(str(tmp_path / "venv")) == str(venv_python)
    assert bench.find_tool_python(str(script)) == str(venv_python)
    with pytest.raises(SystemExit, match="--aiconfigurator"):
        bench.find_tool_python(str(tmp_path / "nowhere"))


def test_shipped_cache_covers_the_default_selection(no_tool):
    chosen = bench.select_rows(bench.read_rows())
    predictions, _ = bench.aiconfigurator_predictions(chosen, bench.CACHE, refresh=False,
                                                      tool=None)
    assert len(chosen) == 216 and set(predictions) == {row.id for row in chosen}
