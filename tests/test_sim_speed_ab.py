"""bench/sim_speed_ab.py: a checkout that is not one is named in one line before anything runs."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_folder_that_is_not_a_checkout_is_named(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "bench" / "sim_speed_ab.py"), str(tmp_path),
                          str(REPO)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert out.stderr.strip() == f"{tmp_path}: not a twinserve checkout (no bench/sim_speed.py)"


def _fake_checkout(path: Path) -> Path:
    (path / "bench").mkdir(parents=True)
    (path / "bench" / "sim_speed.py").write_text("")
    return path


def test_instructions_are_a_run_minus_the_warm_up_as_valgrind_counts_them(tmp_path):
    # A valgrind that reports 1,000,000 instructions plus 500 (BEFORE) or 600 (AFTER) a run.
    fake = tmp_path / "bin" / "valgrind"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\nfor a; do prev3="$prev2"; prev2="$prev1"; prev1="$a"; done\n'
                    'runs="$prev2"; case "$*" in *after*) per=600;; *) per=500;; esac\n'
                    'printf "==1== I   refs:      1,000,%03d\\n" $((runs * per)) >&2\n')
    fake.chmod(0o755)
    before, after = _fake_checkout(tmp_path / "before"), _fake_checkout(tmp_path / "after")
    out = subprocess.run([sys.executable, str(REPO / "bench" / "sim_speed_ab.py"), str(before),
                          str(after), "--instructions", "--requests", "10"],
                         capture_output=True, text=True, timeout=60,
                         env={"PATH": f"{fake.parent}:/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "vidur before: 500 instructions per run of 10 requests",
        "vidur after: 600 instructions per run of 10 requests",
        "after / before: 1.2000x instructions"]


def test_instructions_without_valgrind_is_one_line(tmp_path):
    before = _fake_checkout(tmp_path / "before")
    out = subprocess.run([sys.executable, str(REPO / "bench" / "sim_speed_ab.py"), str(before),
                          str(before), "--instructions"], capture_output=True, text=True,
                         timeout=60, env={"PATH": str(tmp_path)})
    assert out.returncode != 0
    assert out.stderr.strip() == "--instructions needs valgrind on PATH"
