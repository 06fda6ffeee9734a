"""The adapter that hosts twinserve plug-ins in vLLM's scheduler (vllm_adapter/).

Without vLLM: the plug-in over mirrors of vLLM's requests (vllm_adapter/host.py) driven as vLLM's
scheduler drives it, the refusals and the command's arguments. With vLLM's CPU build (a venv
found at $TWINSERVE_VLLM_PYTHON or REPO/.venv-vllm; skipped, saying so, without one): tiny-llama
in two engines, vLLM's own scheduler and the adapter's, each started once
(tests/vllm_adapter_runs.py), whose admission orders, victims and greedy token ids are compared.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_sim import readme_plugin_example
from vllm_adapter import cli, version_refusal
from vllm_adapter.config import build_host, plugin_config
from vllm_adapter.host import PluginHost, request_metadata, unhostable

REPO = Path(__file__).resolve().parents[1]
RUNS_SCRIPT = REPO / "tests" / "vllm_adapter_runs.py"


def host_of(*overrides: str, num_blocks: int = 100) -> PluginHost:
    return build_host(plugin_config(list(overrides)), block_size=16, num_blocks=num_blocks,
                      max_model_len=2048)


def arrive_all(host: PluginHost, prompt_lens, max_tokens=None, **fields) -> list[str]:
    """Requests "0", "1", ... arriving together, as vLLM's add_request mirrors them."""
    ids = []
    for index, prompt_len in enumerate(prompt_lens):
        request_id = str(index)
        extra = {key: values[index] for key, values in fields.items()}
        reason = host.arrive(request_id, prompt_len=prompt_len,
                             max_tokens=max_tokens[index] if max_tokens else 8,
                             arrival_time=float(index), now=10.0, extra=extra)
        assert reason is None
        ids.append(request_id)
    return ids


def admission_order(host: PluginHost) -> list[str]:
    """Pop the plug-in's head until none waits, as vLLM's waiting queue does."""
    order = []
    while host.num_waiting():
        request_id = host.next_waiting(10.0)
        host.admit(request_id, 10.0)
        order.append(request_id)
    return order


# ---- the plug-in over mirrors (no vLLM) ----------------------------------------------------------

def test_admission_follows_each_plugins_order():
    lens, outputs = [60, 10, 40, 20], [4, 12, 8, 2]
    fcfs = host_of()
    arrive_all(fcfs, lens, outputs)
    assert admission_order(fcfs) == ["0", "1", "2", "3"]
    sjf = host_of("scheduler=sjf", "predictor=oracle")
    arrive_all(sjf, lens, outputs)
    assert admission_order(sjf) == ["3", "0", "2", "1"]
    priority = host_of("scheduler=priority")
    arrive_all(priority, lens, outputs, priority=[1, 1, 0, 1])
    assert admission_order(priority) == ["2", "0", "1", "3"]


def test_readme_plugins_run_unchanged(tmp_path, monkeypatch):
    (tmp_path / "my_policies.py").write_text(readme_plugin_example())
    monkeypatch.syspath_prepend(str(tmp_path))
    host = host_of("scheduler._target_=my_policies.ShortestPromptFirst",
                   "preemption._target_=my_policies.PreemptLongestRemaining")
    ids = arrive_all(host, [60, 10, 40], [90, 40, 60])
    assert admission_order(host) == ["1", "2", "0"]
    # The victim among all three is the one with the most tokens still to generate.
    assert host.victim(ids) == "0"
    host.step_done([(request_id, 0, prompt_len) for request_id, prompt_len
                    in zip(ids, [60, 10, 40])], [], 11.0)
    assert [host.mirrors[i].sequences[0].num_output_tokens for i in ids] == [1, 1, 1]


def test_victim_is_chosen_among_the_candidates_vllm_offers():
    host = host_of()   # RecomputePreemption: the latest arrival
    ids = arrive_all(host, [10, 10, 10])
    admission_order(host)
    assert host.victim(ids) == "2"
    assert host.victim(ids[:2]) == "1"   # vLLM scheduled "2" this step already


def test_mirrors_keep_step_with_vllms_steps_and_finish_with_it():
    host = host_of("scheduler=vtc")
    arrive_all(host, [20, 20], [3, 3], tenant=["a", "b"])
    admission_order(host)
    # A prefill in two chunks, and one whose first 16 tokens vLLM's prefix cache held, then
    # decodes: the mirror samples where vLLM does.
    host.step_done([("0", 0, 12), ("1", 16, 4)], [], 11.0)
    first = host.mirrors["0"].sequences[0]
    assert (first.num_computed_tokens, first.num_output_tokens) == (12, 0)
    assert host.mirrors["1"].sequences[0].num_output_tokens == 1
    host.step_done([("0", 12, 8), ("1", 20, 1)], [], 12.0)
    assert first.num_output_tokens == 1 and host.mirrors["1"].sequences[0].num_output_tokens == 2
    # VTC's own update charged each tenant its prompt and outputs.
    assert host.scheduler.counters == {"a": 20 + 2 * 1, "b": 20 + 2 * 2}
    host.step_done([("1", 21, 1)], ["1"], 13.0)   # vLLM finished it (its max_tokens)
    assert "1" not in host.mirrors and host.scheduler.queue_lengths() == (0, 1, 0)
    host.finished("0", 14.0)   # aborted by vLLM's client
    assert host.mirrors == {} and not host.scheduler.has_unfinished()


def test_preemption_and_a_skip_move_the_mirror_back_to_the_waiting_front():
    host = host_of("scheduler=sjf", "predictor=oracle", "scheduler.aging=score")
    ids = arrive_all(host, [10, 10, 10], [5, 6, 7])
    assert admission_order(host) == ids
    host.step_done([(request_id, 0, 10) for request_id in ids], [], 11.0)
    host.preempt("2", 12.0)
    mirror = host.mirrors["2"]
    assert host.is_waiting("2") and mirror.num_preemptions == 1
    assert mirror.sequences[0].num_computed_tokens == 0 and mirror.sequences[0].num_tokens == 11
    assert host.next_waiting(12.0) == "2"   # SJF's score heap ranked it again
    host.admit("2", 12.0)
    host.unadmit("2", 12.0)   # vLLM took it and put it back unrun
    assert host.is_waiting("2") and mirror.num_preemptions == 1


def test_priority_preempts_the_least_important_to_admit_a_head_that_does_not_fit():
    host = host_of("scheduler=priority")
    arrive_all(host, [10, 10], priority=[2, 1])
    admission_order(host)
    assert host.arrive("2", prompt_len=10, max_tokens=8, arrival_time=3.0, now=10.0,
                       priority=0) is None
    assert host.admission_victim(lambda request_id: True, 10.0) is None
    assert host.admission_victim(lambda request_id: False, 10.0) == "0"
    unimportant = host_of("scheduler=priority", "scheduler.preempt_to_admit=false")
    arrive_all(unimportant, [10, 10], priority=[2, 0])
    assert unimportant.admission_victim(lambda request_id: False, 10.0) is None


def test_a_request_the_plugin_refuses_is_named_and_not_queued():
    host = host_of("scheduler=sjf")   # no predictor: a length must come with the request
    assert "set a predictor" in host.arrive("0", prompt_len=10, max_tokens=4, arrival_time=0.0,
                                            now=0.0)
    assert host.arrive("1", prompt_len=10, max_tokens=4, arrival_time=0.0, now=0.0,
                       extra={"predicted_output_len": "3"}) is None
    assert host.mirrors["1"].predicted_output_len == 3 and host.num_waiting() == 1
    assert host.arrive("3", prompt_len=10, max_tokens=None, arrival_time=0.0, now=0.0,
                       extra={"predicted_output_len": 3}) is None
    assert host.mirrors["3"].output_len == 2048 - 10   # no max_tokens: up to max_model_len
    assert host.arrive("2", prompt_len=10, max_tokens=4, arrival_time=0.0, now=0.0,
                       extra={"predicted_output_len": "many"}) == (
        "vllm_xargs.predicted_output_len must be int, got 'many'")


def test_request_metadata_passes_through_as_twinserve_fields():
    assert request_metadata({"tenant": "a", "slo_ttft_ms": "250", "session_id": 7, "turn": "2",
                             "final_turn": "true", "lora_id": 1, "priority": -1,
                             "kv_transfer_params": {"x": 1}}) == {
        "tenant": "a", "slo_ttft_ms": 250.0, "session_id": "7", "turn": 2, "final_turn": True,
        "lora_id": 1, "priority": -1}


def test_what_the_bench_client_sends_the_adapter_reads_back_as_the_request_had_it():
    from policies.types import CLIENT_SCHEDULING_FIELDS, Request
    from sim.tools.bench_client import completion_payload

    request = Request(0, 0.0, prompt_len=4, output_len=2, prompt_token_ids=[1, 2, 3, 4],
                      priority=2, tenant="b", slo_ttft_ms=300.0, slo_tpot_ms=40.0,
                      predicted_output_len=9, session_id="s1", turn=3, final_turn=True,
                      lora_id=0)
    sent = json.loads(json.dumps(completion_payload(request, "m")))["vllm_xargs"]
    assert request_metadata(sent) == {key: getattr(request, key)
                                      for key in CLIENT_SCHEDULING_FIELDS}


@pytest.mark.parametrize("overrides, member", [
    (["scheduler=static"], "scheduler.schedule"),
    (["scheduler=chunked_prefill"], None),
    (["preemption=swap"], "preemption.mode"),
    (["scheduler=mlfq"], None), (["scheduler=edf"], None),
])
def test_what_vllm_cannot_host_is_refused_naming_the_member(overrides, member):
    if member is None:
        host_of(*overrides)
        return
    with pytest.raises(ValueError, match=rf"^{member}: "):
        host_of(*overrides)


def test_a_scheduler_without_the_hooks_is_refused_naming_one():
    from policies.preemption import RecomputePreemption

    class FromScratch:
        queues = None
        speculation = None

    assert unhostable(FromScratch(), RecomputePreemption()).startswith(
        "scheduler: FromScratch has no next_waiting;")


# ---- the command ---------------------------------------------------------------------------

def test_command_splits_overrides_from_vllm_flags(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    args, vllm_args, overrides = cli.parse_args(
        ["--model", str(tmp_path), "--port", "8001", "scheduler=sjf", "predictor=oracle",
         "--max-num-seqs=4"])
    assert args.model == tmp_path and overrides == ["scheduler=sjf", "predictor=oracle"]
    assert vllm_args == ["--port", "8001", "--max-num-seqs=4"]


@pytest.mark.parametrize("argv, message", [
    (["--model", "/nonexistent/model", "scheduler=sjf"], "--model: no model folder"),
    (["--model", "{model}", "scheduler=fastest"], "scheduler=fastest: not one of"),
    (["--model", "{model}", "kv_cache.block_size=32"], "kv_cache.block_size: twinserve-vllm"),
    (["--model", "{model}", "preemption=swap"], "preemption.mode: SwapPreemption"),
])
def test_bad_input_is_one_line_naming_it(tmp_path, capsys, argv, message):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    argv = [arg.replace("{model}", str(tmp_path)) for arg in argv]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv + ["--vllm-venv", str(tmp_path / "no-venv")])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"twinserve-vllm: {message}")


def test_an_unsupported_vllm_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(cli, "vllm_version", lambda python: "0.11.0")
    monkeypatch.setattr(cli, "vllm_python", lambda venv: Path(sys.executable))
    with pytest.raises(SystemExit):
        cli.main(["--model", str(tmp_path), "scheduler=sjf", "predictor=oracle"])
    assert capsys.readouterr().err.strip() == (
        "twinserve-vllm: --vllm-venv: vLLM 0.11.0 is not supported: the adapter was tested with "
        "vLLM 0.32.0 only")
    assert version_refusal("0.32.0") is None and version_refusal("0.32.0+cpu") is None


def test_command_starts_vllms_server_with_the_adapter(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(cli, "vllm_version", lambda python: "0.32.0")
    monkeypatch.setattr(cli, "vllm_python", lambda venv: venv / "bin" / "python")
    monkeypatch.setattr(cli, "with_policy_config_packages", lambda python: python)
    command, env = cli.server_command(*cli.parse_args(
        ["--model", str(tmp_path), "--vllm-venv", "/v", "--port", "8001", "scheduler=priority"]))
    assert command[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert command[command.index("--scheduler-cls") + 1] == (
        "vllm_adapter.scheduler.TwinserveScheduler")
    assert command[command.index("--model") + 1] == str(tmp_path)
    assert command[-2:] == ["--port", "8001"] and "--max-num-seqs" in command
    config = json.loads(env["TWINSERVE_VLLM_PLUGIN"])
    assert config["scheduler"]["_target_"] == "policies.batching.PriorityScheduler"
    assert env["PYTHONPATH"].split(os.pathsep)[:2] == [os.getcwd(), str(REPO)]


def test_readme_plugins_start_from_their_folder(tmp_path, monkeypatch):
    (tmp_path / "my_policies.py").write_text(readme_plugin_example())
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.setattr(cli, "vllm_version", lambda python: "0.32.0")
    monkeypatch.setattr(cli, "vllm_python", lambda venv: venv / "bin" / "python")
    monkeypatch.setattr(cli, "with_policy_config_packages", lambda python: python)
    started = []
    monkeypatch.setattr(os, "execve", lambda path, command, env: started.append(env))
    cli.main(["--model", str(tmp_path), "scheduler._target_=my_policies.ShortestPromptFirst",
              "preemption._target_=my_policies.PreemptLongestRemaining"])
    config = json.loads(started[0]["TWINSERVE_VLLM_PLUGIN"])
    assert config["preemption"]["_target_"] == "my_policies.PreemptLongestRemaining"


# ---- on vLLM's CPU build --------------------------------------------------------------------

def vllm_python_or_skip() -> Path:
    """A vLLM venv's Python: $TWINSERVE_VLLM_PYTHON, else REPO/.venv-vllm's; skips without one."""
    python = os.environ.get("TWINSERVE_VLLM_PYTHON")
    python = Path(python) if python else REPO / ".venv-vllm" / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no vLLM venv ({python} missing; set TWINSERVE_VLLM_PYTHON or run "
                    f"twinserve-vllm once to make REPO/.venv-vllm)")
    if subprocess.run([str(python), "-c", "import vllm, omegaconf, hydra"],
                      capture_output=True).returncode != 0:
        pytest.skip(f"{python} cannot import vllm, omegaconf and hydra")
    return python


ORDER_RUNS = {   # plug-in overrides -> the admission order tests/vllm_adapter_runs.py's
    "fcfs": (["scheduler=continuous"], [0, 1, 2, 3, 4, 5]),   # requests must come out in
    "sjf": (["scheduler=sjf", "predictor=oracle"], [3, 0, 5, 2, 4, 1]),   # (by max_tokens)
    "shortest_prompt": (["scheduler._target_=my_policies.ShortestPromptFirst"],
                        [1, 3, 5, 2, 4, 0]),
    "priority": (["scheduler=priority"], [2, 4, 0, 1, 3, 5]),
    "mlfq": (["scheduler=mlfq"], None),   # (it preempts to admit: readmissions)
    # Tenants a, a, a, b, b, b: the least served goes next, prompt tokens 1 and outputs 2 each.
    "vtc": (["scheduler=vtc"], [0, 3, 4, 1, 5, 2]),
}
PREEMPT_RUNS = {
    "fcfs_victims": ["scheduler=continuous"],
    "longest_remaining_victims": ["preemption._target_=my_policies.PreemptLongestRemaining"],
}


@pytest.fixture(scope="module")
def vllm_runs(tmp_path_factory):
    """Both engines' runs: {"vllm": vLLM's own scheduler's, "adapter": the adapter's}, made once
    even where pytest-xdist's workers share these tests (the first writes them for the rest)."""
    from filelock import FileLock

    python = vllm_python_or_skip()
    # This session's folder: under xdist, the one above each worker's.
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    with FileLock(str(shared / "vllm_adapter_runs.lock")):
        results = shared / "vllm_adapter_runs.json"
        if not results.exists():
            results.write_text(json.dumps(start_both_engines(python, tmp_path_factory)))
        return json.loads(results.read_text())


def start_both_engines(python: Path, tmp_path_factory) -> dict:
    """Runs tests/vllm_adapter_runs.py with vLLM's own scheduler, then with the adapter."""
    folder = tmp_path_factory.mktemp("vllm_adapter")
    sys.path.insert(0, str(REPO / "bench"))
    from vllm_cpu_loop import write_checkpoint

    checkpoint = write_checkpoint(folder / "tiny-llama")
    (folder / "my_policies.py").write_text(readme_plugin_example())
    sys.path.insert(0, str(folder))
    one_at_a_time = ["scheduler.max_num_seqs=1"]
    adapter_runs = (
        [{"name": name, "workload": "order", "plugin": plugin_config(overrides + one_at_a_time)}
         for name, (overrides, _) in ORDER_RUNS.items()]
        + [{"name": name, "workload": "preempt", "plugin": plugin_config(overrides)}
           for name, overrides in PREEMPT_RUNS.items()]
        + [{"name": "refusal", "workload": "refusal", "plugin": plugin_config(["scheduler=sjf"])}])
    own_runs = [{"name": "order", "workload": "order", "plugin": None},
                {"name": "preempt", "workload": "preempt", "plugin": None}]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), str(REPO)])}
    results = {}
    for engine, runs in (("vllm", own_runs), ("adapter", adapter_runs)):
        spec = folder / f"{engine}.json"
        spec.write_text(json.dumps({"model": str(checkpoint), "adapter": engine == "adapter",
                                    "runs": runs}))
        result = subprocess.run([str(python), str(RUNS_SCRIPT), str(spec)], capture_output=True,
                                text=True, cwd=folder, env=env, timeout=600)
        lines = result.stdout.strip().splitlines()
        assert result.returncode == 0 and lines and lines[-1].startswith("{"), (
            result.stderr[-3000:])
        results[engine] = json.loads(lines[-1])
    return results


def test_vllm_hosts_the_adapter_and_its_own_scheduler_admits_in_arrival_order(vllm_runs):
    assert vllm_runs["adapter"]["scheduler"] == "TwinserveScheduler"
    assert vllm_runs["vllm"]["runs"]["order"]["admitted"] == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("name", sorted(ORDER_RUNS))
def test_requests_arriving_together_are_admitted_in_the_plugins_order(vllm_runs, name):
    run = vllm_runs["adapter"]["runs"][name]
    expected = ORDER_RUNS[name][1]
    if expected is not None:
        assert run["admitted"] == expected
    assert set(run["admitted"]) == {0, 1, 2, 3, 4, 5}   # (MLFQ preempts to admit: readmissions)
    assert run["most_running"] == 1   # the plug-in's scheduler.max_num_seqs=1


def test_the_victim_is_the_plugins(vllm_runs):
    own = vllm_runs["vllm"]["runs"]["preempt"]["preempted"]
    fcfs = vllm_runs["adapter"]["runs"]["fcfs_victims"]["preempted"]
    longest = vllm_runs["adapter"]["runs"]["longest_remaining_victims"]["preempted"]
    # Among the requests not yet scheduled in the step short of memory (the second and third):
    assert own and own[0] == 2 and fcfs[0] == 2   # the latest arrival, vLLM's and twinserve's
    assert longest and longest[0] == 1            # the most tokens still to generate


def test_greedy_outputs_are_unchanged_by_the_adapter(vllm_runs):
    own = vllm_runs["vllm"]["runs"]
    adapter = vllm_runs["adapter"]["runs"]
    for name in ORDER_RUNS:
        assert adapter[name]["token_ids"] == own["order"]["token_ids"], name
    for name in PREEMPT_RUNS:
        assert adapter[name]["token_ids"] == own["preempt"]["token_ids"], name
    assert [len(ids) for ids in own["preempt"]["token_ids"]] == [20, 100, 40]


def test_a_refused_request_finishes_as_an_error_and_the_others_run(vllm_runs):
    run = vllm_runs["adapter"]["runs"]["refusal"]
    assert run["finish_reasons"] == ["length", "error"]
    assert len(run["token_ids"][0]) == 4 and run["token_ids"][1] == []
