"""What a run shows a new user: the console summary's prefix-cache hit rate and a long rejection
reason below the tables (it wrapped them), and the KV-blocks plot's line at the pool's capacity."""
from __future__ import annotations

import io

import matplotlib.axes
from rich.console import Console

from sim.core.experiment import run_experiment
from sim.tools.console_summary import print_summary
from sim.tools.plots import kv_block_capacities

from factories import make_cfg

# Prompts up to 6,000 tokens: those over Llama-2-7B's 4,096 positions are rejected.
LONG_PROMPTS = "++workload.prompt_len={dist: uniform, low: 100, high: 6000}"


def console_text(summary: dict, width: int) -> str:
    console = Console(width=width, record=True, file=io.StringIO())
    print_summary(summary, console)
    return console.export_text()


def test_the_summary_shows_the_prefix_cache_hit_rate():
    summary = run_experiment(make_cfg("workload.num_requests=20", "workload.with_token_ids=true",
                                      "kv_cache.enable_prefix_caching=true")).summary
    summary["prefix_cache_hit_rate"] = 0.375
    assert any(line.split()[:5] == ["prefix", "cache", "hit", "rate", "37.5%"]
               for line in console_text(summary, 100).splitlines())


def test_a_long_rejection_reason_goes_below_the_tables_on_a_line_of_its_own():
    summary = run_experiment(make_cfg("workload.num_requests=20", LONG_PROMPTS)).summary
    reason = summary["rejected_reason"]
    assert len(reason) > 50 and summary["rejected"] > 0
    lines = console_text(summary, 80).splitlines()
    assert lines[0].split()[-4:] == ["ms", "mean", "median", "p99"]
    # Each label on one line: the reason did not squeeze the totals' columns.
    assert any(line.startswith("expected TPOT error ") for line in lines)
    assert (f"rejected because: {reason} ({summary['rejected_reason_count']} like it)"
            in " ".join(line.strip() for line in lines))


def test_the_kv_blocks_plot_draws_the_pools_capacity(tmp_path, monkeypatch):
    capacities = []
    original = matplotlib.axes.Axes.axhline

    def record(ax, y=0, *args, **kwargs):
        if "capacity" in (kwargs.get("label") or ""):   # (power.png's idle draw is one too)
            capacities.append((y, kwargs.get("label")))
        return original(ax, y, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "axhline", record)
    run_experiment(make_cfg("workload.num_requests=30", "kv_cache.num_blocks=300"), tmp_path)
    assert capacities == [(300, "pool capacity (300 blocks)")]
    assert (tmp_path / "kv_blocks.png").is_file()


def test_pools_of_their_own_size_have_a_capacity_each():
    per_pool = {"num_kv_blocks": 100, "per_pool": {"prefill": {"num_kv_blocks": 100},
                                                   "decode": {"num_kv_blocks": 400}}}
    assert kv_block_capacities(per_pool) == {"prefill pool": 100, "decode pool": 400}
    assert kv_block_capacities({"num_kv_blocks": 7}) == {"pool": 7}
    assert kv_block_capacities({}) == {}


def test_the_progress_bar_stays_off_a_log_that_is_not_a_terminal(capsys):
    """Piped into a log, the bar's last frame ran into the summary table: it draws on a terminal
    only."""
    run_experiment(make_cfg("workload.num_requests=20"), progress=True, plots=False)
    assert "requests:" not in capsys.readouterr().err
