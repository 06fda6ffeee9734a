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
