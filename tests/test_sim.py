"""The simulator end to end: config composition, determinism, outputs, the vLLM paper's claims,
clustering, plug-ins and bad input."""
from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from runtime.metrics import STEP_COLUMNS
from sim.core.experiment import run_experiment

from factories import make_cfg, summary_without_wall_time, twinserve

REPO = Path(__file__).resolve().parents[1]
AZURE_TRACE = REPO / "data" / "traces" / "azure_llm_2023_code.csv"


def run(*overrides: str, out_dir=None):
    return run_experiment(make_cfg(*overrides), out_dir)


def test_default_experiment_writes_its_files(tmp_path):
    result = run("workload.num_requests=200", out_dir=tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in ["completed", "rejected", "duration_s", "request_throughput",
                "output_throughput", "total_token_throughput", "num_preemptions",
                "peak_kv_blocks", "kv_waste_fraction", "wall_time_s"]:
        assert key in summary
    for metric in ["ttft", "tpot", "itl", "e2el"]:
        for stat in ["mean", "median", "p90", "p99"]:
            assert f"{stat}_{metric}_ms" in summary
    assert summary["completed"] == 200 and summary["rejected"] == 0
    assert summary["mean_ttft_ms"] > 0 and summary["mean_tpot_ms"] > 0
    assert summary["median_ttft_ms"] <= summary["p99_ttft_ms"]
    requests_csv = (tmp_path / "requests.csv").read_text().splitlines()
    assert len(requests_csv) == 201
    steps_csv = (tmp_path / "steps.csv").read_text().splitlines()
    assert len(steps_csv) == summary["num_steps"] + 1
    for plot in ["latency_cdf.png", "kv_blocks.png", "batch_size.png"]:
        assert (tmp_path / plot).stat().st_size > 1000
    assert result.summary["output_throughput"] > 0


def test_same_config_and_seed_give_the_same_summary():
    first = run("workload.num_requests=100", "seed=3")
    second = run("workload.num_requests=100", "seed=3")
    other = run("workload.num_requests=100", "seed=4")
    assert summary_without_wall_time(first) == summary_without_wall_time(second)
    assert summary_without_wall_time(first) != summary_without_wall_time(other)


def test_every_request_output_length_is_generated():
    result = run("workload.num_requests=150", "workload.rate=50", "kv_cache.num_blocks=300",
                 "preemption=swap")
    assert result.summary["num_preemptions"] > 0
    for request in result.requests:
        assert request.rejected_reason is None
        assert all(seq.num_output_tokens == request.output_len for seq in request.sequences)


# ---- the vLLM paper's claims, reproduced in the simulator -----------------------------------

def test_continuous_batching_beats_static_on_mixed_lengths():
    overrides = ["workload=sharegpt_like", "workload.num_requests=300", "workload.rate=30",
                 "scheduler.max_num_seqs=32"]
    static = run("scheduler=static", *overrides).summary
    continuous = run("scheduler=continuous", *overrides).summary
    assert continuous["request_throughput"] > 1.2 * static["request_throughput"]
    assert continuous["median_e2el_ms"] < static["median_e2el_ms"]


def test_paged_wastes_little_and_contiguous_wastes_most_slots():
    overrides = ["model=opt-13b", "hardware=a100-40gb", "workload=sharegpt_like",
                 "workload.num_requests=200", "workload.rate=20"]
    paged = run("kv_cache=paged", *overrides).summary
    contiguous = run("kv_cache=contiguous", *overrides).summary
    assert paged["kv_waste_fraction"] < 0.04
    assert contiguous["kv_waste_fraction"] > 0.5


def test_larger_blocks_waste_more():
    overrides = ["workload=sharegpt_like", "workload.num_requests=150", "workload.rate=20"]
    wastes = [run(f"kv_cache.block_size={size}", *overrides).summary["kv_waste_fraction"]
              for size in (4, 16, 64, 256)]
    assert wastes == sorted(wastes) and wastes[0] < wastes[-1]


def test_parallel_sampling_shares_blocks():
    overrides = ["workload=sharegpt_like", "workload.num_requests=100", "workload.rate=5",
                 "workload.n=4"]
    shared = run("kv_cache.share_on_fork=true", *overrides).summary
    copied = run("kv_cache.share_on_fork=false", *overrides).summary
    assert shared["completed"] == copied["completed"] == 100
    assert shared["peak_kv_blocks"] < copied["peak_kv_blocks"]


def test_prefix_caching_skips_a_shared_system_prompt():
    overrides = ["workload.num_requests=200", "workload.rate=10", "workload.with_token_ids=true",
                 "workload.shared_prefix_len=256"]
    plain = run("kv_cache.enable_prefix_caching=false", *overrides)
    cached = run("kv_cache.enable_prefix_caching=true", *overrides)
    column = STEP_COLUMNS.index("num_prefill_tokens")
    prefill_plain = sum(row[column] for row in plain.metrics.step_rows)
    prefill_cached = sum(row[column] for row in cached.metrics.step_rows)
    # Every request after the first finds the full blocks of the shared 256-token prefix that
    # its prompt holds cached (at least one token is always left to compute).
    cacheable = [min(256, (r.prompt_len - 1) // 16 * 16) for r in cached.requests[1:]]
    assert prefill_plain - prefill_cached >= 0.95 * sum(cacheable)
    assert cached.summary["mean_ttft_ms"] < plain.summary["mean_ttft_ms"]
    assert cached.summary["peak_kv_blocks"] < plain.summary["peak_kv_blocks"]


# ---- configurations --------------------------------------------------------------------------

@pytest.mark.parametrize("overrides", [
    ["scheduler=chunked_prefill", "scheduler.max_num_batched_tokens=512"],
    ["scheduler=static", "kv_cache=contiguous", "kv_cache.reserve=oracle"],
    ["preemption=swap", "preemption.swap_space_gb=0.01", "kv_cache.num_blocks=200"],
    ["cluster.num_replicas=3", "cluster.router=least_outstanding"],
    ["model=llama-2-70b", "cluster.tensor_parallel_size=4", "hardware=h100-80gb"],
    ["model=tiny-llama", "hardware=cpu", "workload.rate=2"],
])
def test_configurations_run_to_completion(overrides):
    result = run("workload.num_requests=60", "workload.rate=40", *overrides)
    assert result.summary["completed"] + result.summary["rejected"] == 60
    assert result.summary["completed"] > 0


def test_trace_replay_with_time_scale():
    overrides = ["workload=trace", f"workload.trace_path={AZURE_TRACE}",
                 "workload.max_requests=300"]
    normal = run(*overrides).summary
    fast = run(*overrides, "workload.time_scale=0.25").summary
    # Code-completion prompts reach 7k tokens: those beyond Llama-2's 4,096 are rejected.
    assert normal["rejected"] == fast["rejected"] > 0
    assert normal["completed"] == fast["completed"] == 300 - normal["rejected"]
    assert fast["request_throughput"] > normal["request_throughput"]


def test_least_outstanding_balances_better_than_round_robin_under_skew():
    # An overload at the roofline's step times, where queues build unevenly (at the GPU cost
    # model's faster steps the same rate is a lighter load, where the two routers tie).
    overrides = ["workload=sharegpt_like", "workload.num_requests=300", "workload.rate=60",
                 "cluster.num_replicas=4", "cost_model=roofline"]
    round_robin = run("cluster.router=round_robin", *overrides).summary
    least = run("cluster.router=least_outstanding", *overrides).summary
    assert least["p99_e2el_ms"] <= round_robin["p99_e2el_ms"]


def test_engine_backend_runs_the_same_experiment_with_the_same_outputs(tmp_path):
    """backend=engine: the same policies and workload, steps run for real on the tiny Llama."""
    # Everything arrives at once, so preemption does not hang on measured step times.
    overrides = ["model=tiny-llama", "hardware=cpu", "workload.num_requests=12",
                 "workload.rate=inf", "workload.with_token_ids=true",
                 "++workload.prompt_len={dist: uniform, low: 8, high: 64}",
                 "++workload.output_len={dist: uniform, low: 4, high: 16}",
                 "kv_cache.num_blocks=24", "kv_cache.block_size=4"]
    engine = run("backend=engine", *overrides, out_dir=tmp_path)
    simulated = run("backend=sim", *overrides)
    assert set(engine.summary) == set(simulated.summary)
    assert engine.summary["completed"] == 12 and engine.summary["num_preemptions"] > 0
    for request in engine.requests:
        (seq,) = request.sequences
        assert len(seq.output_token_ids) == request.output_len  # ignore_eos: trace lengths
    assert (tmp_path / "steps.csv").exists() and (tmp_path / "latency_cdf.png").exists()


def test_engine_backend_needs_token_ids():
    with pytest.raises(ValueError, match="with_token_ids"):
        run("backend=engine", "model=tiny-llama", "hardware=cpu", "workload.num_requests=2")


# ---- bad input -------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, field", [
    (["workload.rate=-1"], "workload.rate"),
    (["kv_cache.block_size=0"], "kv_cache.block_size"),
    (["scheduler.max_num_seqs=0"], "scheduler.max_num_seqs"),
    (["cluster.router=fastest"], "cluster.router"),
    (["kv_cache=contiguous", "kv_cache.reserve=sometimes"], "kv_cache.reserve"),
    (["scheduler._target_=no_such_module.Scheduler"], "scheduler._target_"),
    (["cost_model=profiled"], "cost_model.profile is required"),
])
def test_bad_config_values_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        run("workload.num_requests=10", *overrides)


def test_trace_missing_a_column_names_it(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:17:03.9799600,10\n")
    with pytest.raises(ValueError, match="GeneratedTokens"):
        run("workload=trace", f"workload.trace_path={trace}")


def test_request_longer_than_the_model_is_rejected_and_counted(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("arrival_time,prompt_len,output_len\n0.0,100,10\n0.1,4000,200\n0.2,50,5\n")
    summary = run("workload=trace", f"workload.trace_path={trace}").summary
    assert summary["completed"] == 2 and summary["rejected"] == 1


def test_cli_error_is_one_clear_line(tmp_path):
    result = twinserve("workload.rate=-1", "progress=false", cwd=tmp_path)
    assert result.returncode != 0
    assert "workload.rate" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_bad_seed_is_one_clear_line(tmp_path):
    result = twinserve("seed=abc", "progress=false", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "twinserve: error: seed must be a non-negative integer, got 'abc'"]


def test_a_setting_refused_while_building_prints_no_progress_bar(tmp_path):
    # With the progress bar on (the CLI's default), a policy refused while the run is built
    # (here by kv_retention) gives its one line alone, not behind a bar at 0 %.
    result = twinserve("kv_retention=pin", "progress=true", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "twinserve: error: kv_retention=pin needs kv_cache.enable_prefix_caching=true: a "
        "session's next turn finds its pinned blocks by their prefix hashes"]


def test_a_run_that_rejects_every_request_says_why(tmp_path):
    from rich.console import Console

    from sim.tools.console_summary import print_summary

    summary = run("kv_cache.num_blocks=2", "workload.num_requests=20").summary
    assert summary["completed"] == 0 and summary["rejected"] == 20
    assert summary["rejected_reason_count"] == 20
    assert summary["rejected_reason"].endswith("tokens can never fit in the KV cache of 2 blocks")
    console = Console(width=200, record=True, file=open(os.devnull, "w"))
    print_summary(summary, console)
    table = console.export_text()
    assert "rejected because" in table and "KV cache of 2 blocks (20 like it)" in table
    assert "rejected_reason" not in run("workload.num_requests=20").summary


def test_router_as_a_target_mapping():
    summary = run("cluster.num_replicas=2", "workload.num_requests=50",
                  "cluster.router={_target_: policies.routing.LeastOutstandingRouter}").summary
    assert summary["completed"] == 50


def readme_plugin_example() -> str:
    """The `my_policies.py` block of the README, so the README's example stays true."""
    readme = (REPO / "README.md").read_text()
    start = readme.index("# my_policies.py")
    return readme[start:readme.index("```", start)]


def test_cli_readme_plugins(tmp_path):
    (tmp_path / "my_policies.py").write_text(readme_plugin_example())
    result = twinserve("scheduler._target_=my_policies.ShortestPromptFirst",
                       "preemption._target_=my_policies.PreemptLongestRemaining",
                       "cluster.router=my_policies.FewestOutstandingRouter",
                       "cluster.num_replicas=2",
                       "kv_cache.num_blocks=300", "workload.num_requests=100",
                       "progress=false", "hydra.run.dir=run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["completed"] == 100 and summary["num_preemptions"] > 0


def test_cli_user_plugin_in_a_sweep(tmp_path):
    """A policy in the user's own file, named in config, in a Hydra multirun sweep."""
    (tmp_path / "my_policies.py").write_text(readme_plugin_example())
    result = twinserve("-m", "scheduler._target_=my_policies.ShortestPromptFirst,"
                       "policies.batching.ContinuousBatchingScheduler",
                       "workload.num_requests=200", "workload.rate=40",
                       "scheduler.max_num_seqs=8", "progress=false",
                       "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    summaries = [json.loads((tmp_path / "sweep" / str(job) / "summary.json").read_text())
                 for job in (0, 1)]
    shortest_first, fcfs = summaries
    assert shortest_first["completed"] == fcfs["completed"] == 200
    # Shortest-prompt-first is the textbook way to cut mean waiting time.
    assert shortest_first["mean_ttft_ms"] < fcfs["mean_ttft_ms"]


def test_cli_unknown_policy_lists_the_choices(tmp_path):
    result = twinserve("scheduler=fastest", cwd=tmp_path)
    assert result.returncode != 0
    assert "scheduler/fastest" in result.stderr
    assert "chunked_prefill" in result.stderr and "continuous" in result.stderr


def test_wandb_logger_logs_config_summary_series_and_plots(tmp_path, monkeypatch):
    import wandb

    from sim.tools.loggers import log_run

    class RecordingRun:
        def __init__(self, **init_kwargs):
            self.init_kwargs, self.summary, self.logged, self.finished = init_kwargs, {}, [], False

        def log(self, values):
            self.logged.append(values)

        def define_metric(self, name, step_metric=None):
            pass

        def define_metric(self, name, step_metric=None):
            pass

        def finish(self):
            self.finished = True

    runs = []
    monkeypatch.setattr(wandb, "init", lambda **kwargs: runs.append(RecordingRun(**kwargs))
                        or runs[-1])
    monkeypatch.setattr(wandb, "Image", lambda path: ("image", path))
    cfg = make_cfg("logger=wandb", "workload.num_requests=20")
    result = run_experiment(cfg, tmp_path)
    log_run(cfg, result.summary, tmp_path)
    (run_record,) = runs
    assert run_record.init_kwargs["mode"] == "offline"
    assert run_record.init_kwargs["config"]["scheduler"]["_target_"].endswith(
        "ContinuousBatchingScheduler")
    assert run_record.summary["completed"] == 20
    series = [values for values in run_record.logged if "kv_blocks_used" in values]
    assert len(series) == result.summary["num_steps"]
    images = {key for values in run_record.logged for key in values if key.endswith("cdf")}
    assert images == {"latency_cdf"}
    assert run_record.finished
