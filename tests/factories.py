"""Shared test helpers, in one place: what more than one test file builds (configs, specs,
sequences, plans, schedulers, a run's command line) and the stand-ins and checks they share.
Tests import them with `from factories import ...` (tests/ is on sys.path under pytest); the
conftest registers this module for pytest's assertion rewriting.

Engine modules (torch) are imported inside the helpers that need them, so a test file that only
builds configs or sequences does not import torch."""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from hydra import compose, initialize_config_dir
from hypothesis import strategies as st
from omegaconf import OmegaConf


from policies.batching import ChunkedPrefillScheduler
from policies.routing import RoundRobinRouter
from policies.types import Request, Sequence, SequenceStatus, StepPlan, StepResult
from sim.cost.profiled.tile_features import TILE_FEATURES, AttentionTiling, tile_features
from sim.cost.profiled.cost_model import ProfiledCostModel
from sim.cost.profiled.step_features import STEP_FEATURES, step_features
from runtime.assembly import kv_cache_policy_config
from runtime.policy_config import CONF_DIR, build_policy, config_names, policy_config
from runtime.metrics import MetricsCollector
from sim.core.replica import Replica, SimEnvironment, arrivals, drive_alone
from runtime.specs import HardwareSpec, ModelSpec

if TYPE_CHECKING:
    from runtime.step_shapes import GridPoint

REPO = Path(__file__).resolve().parents[1]


# ---- configs and specs ---------------------------------------------------------------------------

def make_cfg(*overrides: str):
    """The run's Hydra config: conf/config.yaml, progress bar off, then `overrides`."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose("config", overrides=["progress=false", *overrides])


def model_spec(name: str) -> ModelSpec:
    """The ModelSpec of conf/model/<name>.yaml."""
    return ModelSpec.from_config(OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml"))


def hardware_spec(name: str) -> HardwareSpec:
    """The HardwareSpec of conf/hardware/<name>.yaml."""
    return HardwareSpec.from_config(OmegaConf.load(CONF_DIR / "hardware" / f"{name}.yaml"))


# ---- runs ----------------------------------------------------------------------------------------

def config_kv_blocks(cfg, model: ModelSpec, hardware: HardwareSpec) -> int:
    """A replica's KV blocks as a run of `cfg` sizes them."""
    from sim.core.build import num_kv_blocks
    from sim.core.settings import replica_settings
    return num_kv_blocks(replica_settings(cfg, model), hardware)


def config_cost_model(cfg, model: ModelSpec, hardware: HardwareSpec, **drafting):
    """The cost model a run of `cfg` builds."""
    from sim.cost.build import build_cost_model
    from sim.core.settings import replica_settings
    return build_cost_model(cfg.cost_model, replica_settings(cfg, model), model, hardware,
                            **drafting)


def twinserve(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """The finished `twinserve` command (python -m sim.tools.app) run in cwd on this checkout."""
    # env: the command's environment (default: this process's), with this checkout on PYTHONPATH.
    env = {**(os.environ if env is None else env), "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "sim.tools.app", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def summary_without_wall_time(result) -> dict:
    """A run's summary less what depends on the machine's speed (wall time, speed-up)."""
    return {key: value for key, value in result.summary.items()
            if key not in ("wall_time_s", "sim_speedup")}


def token_ids(outputs) -> list[list[int]]:
    """The first sample's token ids of each of the engine's RequestOutputs."""
    return [out.outputs[0].token_ids for out in outputs]


def replay_on_sim_clock(scheduler, executor, prompts, output_len: int):
    """One simulator replica's run of the prompts (10 ms apart): (the requests, the end time)."""
    # Requests without SamplingParams: greedy, each output_len tokens long.
    requests = [Request(request_id=i, arrival_time=0.01 * i, prompt_len=len(p),
                        output_len=output_len, prompt_token_ids=p) for i, p in enumerate(prompts)]
    env = SimEnvironment()
    replica = Replica(env, 0, [scheduler], executor, MetricsCollector())
    drive_alone(replica)
    env.process(arrivals(env, requests, RoundRobinRouter(), [replica]))
    env.run()  # until no event is left: every request done, the replica idle
    return requests, env.now


# ---- sequences and plans -------------------------------------------------------------------------

def make_seq(seq_id: int, prompt_len: int, output_len: int = 16,
             prompt_token_ids: list[int] | None = None) -> Sequence:
    """A fresh sequence of its own one-sample request (request id = seq_id), arrived at 0."""
    request = Request(seq_id, 0.0, prompt_len, output_len, prompt_token_ids=prompt_token_ids)
    seq = Sequence(seq_id, request)
    request.sequences.append(seq)
    return seq


def decode_plan(num_seqs: int, context_len: int) -> StepPlan:
    """A decode step's aggregates: num_seqs sequences at context_len tokens each, no prefill."""
    plan = StepPlan()
    plan.num_decode_seqs = num_seqs
    plan.decode_context_tokens = num_seqs * context_len
    return plan


# ---- the stand-in profile: a known linear step cost (tests of the profiler and its fits) ---------

# A known cost: seconds per unit of each feature, and a fixed step overhead.
TRUE_INTERCEPT = 2e-3
TRUE_COEFS = {
    "num_prefill_tokens": 3e-5,
    "num_prefill_seqs": 5e-4,
    "sum_squared_prefill_chunks": 2e-9,
    "prefill_attention_work": 1e-8,
    "num_decode_seqs": 1e-4,
    "decode_context_tokens": 4e-7,
    "num_blocks_copied": 2e-6,
    "num_blocks_swapped": 8e-6,
    "num_attention_tiles": 3e-4,
    "padded_kv_tokens": 2e-7,
}
# K/V bytes per token of the stand-in "model": small tiles, so the grid has many of them.
KV_BYTES_PER_TOKEN = 4096
# The stand-in's profiles are fitted with the attention-tile features too, as a CPU engine's are.
ALL_FEATURES = STEP_FEATURES + TILE_FEATURES


def predict(content: dict, features) -> float:
    """A fitted profile's duration for one feature vector: what the simulator predicts."""
    return ProfiledCostModel(content, sample_residuals=False).predict_mean(features)


def tiling(block_size: int) -> AttentionTiling:
    """The stand-in model's attention tiling at this block size."""
    return AttentionTiling.of(block_size, KV_BYTES_PER_TOKEN)


def features_of(plan, block_size: int) -> tuple[float, ...]:
    """The plan's core and tile features, in ALL_FEATURES order."""
    return step_features(plan) + tile_features(plan, tiling(block_size))


def true_cost(features) -> float:
    """The stand-in's known duration of a step with these ALL_FEATURES values."""
    # Features a later version adds (speculation's) cost nothing here.
    return TRUE_INTERCEPT + sum(TRUE_COEFS.get(f, 0.0) * v for f, v in zip(ALL_FEATURES, features))


def held_out_points() -> list[GridPoint]:
    """Grid points (step shapes) not in the profiler's grid, inside its ranges."""
    from runtime.step_shapes import GridPoint

    return [
        GridPoint(1000, "prefill", 16, prefills=((200, 300),)),
        GridPoint(1001, "prefill", 32, prefills=((48, 0), (96, 32), (400, 100))),
        GridPoint(1002, "decode", 16, decodes=(700,) * 24),
        GridPoint(1003, "decode", 32, decodes=tuple(range(40, 1000, 40))),
        GridPoint(1004, "mixed", 16, decodes=(300,) * 20, prefills=((300, 200),)),
        GridPoint(1005, "copy", 16, decodes=(100,) * 6, num_copies=40),
        GridPoint(1006, "swap", 16, decodes=(200,) * 3, num_swap_out=30, num_swap_in=90),
    ]


# ---- schedulers driven to completion: the policy invariants (random runs, speculating or not) ----

MAX_MODEL_LEN = 128

request_strategy = st.tuples(
    st.floats(0, 2, allow_nan=False),           # arrival
    st.integers(1, 100),                        # prompt_len
    st.integers(1, 40),                         # output_len
    st.sampled_from([1, 1, 1, 2, 4]),           # n
)

# The policy space the invariant tests draw from (the speculation tests add to it): every
# conf/scheduler, both KV managers (contiguous reserving max_model_len or the exact length) and
# both preemption modes.
POLICY_STRATEGIES = dict(
    scheduler_name=st.sampled_from(config_names("scheduler")),
    kv_name=st.sampled_from(["paged", "contiguous_max", "contiguous_oracle"]),
    preemption_name=st.sampled_from(["recompute", "swap"]),
    block_size=st.sampled_from([1, 4, 16]),
    pool_slack=st.integers(0, 200),
    num_host_blocks=st.integers(0, 64),
    max_num_seqs=st.integers(4, 12),
    chunk_budget=st.integers(1, 64),
    request_specs=st.lists(request_strategy, min_size=1, max_size=10),
)


@functools.lru_cache(maxsize=None)
def conf_policy(name: str, group: str):
    """The config of conf/<group>/<name>.yaml, read once (instantiating it leaves it as it is)."""
    return policy_config(name, group)


def requests_from_specs(request_specs) -> list[Request]:
    """The property tests' requests from (arrival, prompt_len, output_len, n) specs, with
    priorities and length predictions (off by up to ±5 tokens), for the schedulers that read
    them."""
    return [Request(i, arrival, prompt_len, output_len, n=n, priority=i % 3,
                    predicted_output_len=max(1, output_len - 5 + 7 * i % 11))
            for i, (arrival, prompt_len, output_len, n) in enumerate(request_specs)]


def build_scheduler(scheduler_name, kv_name, preemption_name, block_size, num_blocks,
                    num_host_blocks, max_num_seqs, chunk_budget, prefix_caching=False,
                    speculation=None, num_offload_blocks=0, lora=None):
    """A conf/scheduler policy over conf/kv_cache and conf/preemption ones, as the sim builds it."""
    # kv_name: "paged", "contiguous_max" or "contiguous_oracle" (the contiguous reserve mode).
    # Only the chunked-prefill scheduler gets chunk_budget as its step token budget.
    # num_offload_blocks: the paged prefix cache's host tier. lora: a LoRA manager (None: off).
    kv_group, _, reserve = kv_name.partition("_")
    kv_args = (dict(enable_prefix_caching=prefix_caching, num_offload_blocks=num_offload_blocks)
               if kv_group == "paged" else dict(reserve=reserve, max_model_len=MAX_MODEL_LEN))
    kv_cache = build_policy(kv_cache_policy_config(conf_policy(kv_group, "kv_cache")), "kv_cache",
                            num_blocks=num_blocks, block_size=block_size,
                            num_host_blocks=num_host_blocks, **kv_args)
    preemption = build_policy(conf_policy(preemption_name, "preemption"), "preemption")
    budget = chunk_budget if scheduler_name == "chunked_prefill" else MAX_MODEL_LEN
    return build_policy(conf_policy(scheduler_name, "scheduler"), "scheduler",
                        kv_cache=kv_cache, preemption=preemption, max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=budget, max_model_len=MAX_MODEL_LEN,
                        speculation=speculation, **({} if lora is None else {"lora": lora}))


def check_speculation(scheduler, plan):
    """Checks a plan's drafts: on decodes only, within output and max_model_len, slots allocated."""
    # And the plan's draft aggregates in step with spec_lens.
    planned = {seq.seq_id: (seq, num_new) for seq, num_new in zip(plan.seqs, plan.num_new_tokens)}
    for seq_id, k in plan.spec_lens.items():
        seq, num_new = planned[seq_id]
        assert k >= 1 and num_new == 1 and seq.num_output_tokens > 0
        assert seq.num_computed_tokens == seq.num_tokens - 1, f"{seq} speculates mid-prefill"
        assert seq.num_output_tokens + k + 1 <= seq.request.output_len
        assert seq.num_tokens + k <= scheduler.max_model_len
        table = scheduler.kv_cache.block_tables[seq_id]
        assert len(table) * scheduler.kv_cache.block_size >= seq.num_tokens + k
    assert plan.num_draft_tokens == sum(plan.spec_lens.values())
    assert plan.max_draft_len == max(plan.spec_lens.values(), default=0)


def drive(scheduler, requests, step_duration=0.01, max_steps=20_000, execute=None):
    """Runs a scheduler to completion on a fake executor, checking its invariants every step."""
    # execute(plan) -> StepResult replaces the default executor (every step takes step_duration).
    kv_cache = scheduler.kv_cache
    pending = sorted(requests, key=lambda r: r.arrival_time)
    now = 0.0
    finished_ids: list[int] = []
    for _ in range(max_steps):
        while pending and pending[0].arrival_time <= now:
            scheduler.add_request(pending.pop(0), now)
        if not scheduler.has_unfinished():
            if not pending:
                break
            now = pending[0].arrival_time
            continue
        plan = scheduler.schedule(now)
        assert not plan.is_empty, f"no progress: {scheduler.queue_lengths()}"
        assert kv_cache.num_used_blocks() <= kv_cache.num_blocks
        kv_cache.check_invariants()
        seen = set()
        for seq, num_new in zip(plan.seqs, plan.num_new_tokens):
            assert seq.seq_id not in seen, "a sequence scheduled twice in one step"
            seen.add(seq.seq_id)
            assert seq.status is SequenceStatus.RUNNING, f"{seq} planned while not running"
            assert 1 <= num_new <= seq.num_tokens - seq.num_computed_tokens
            table = kv_cache.block_tables[seq.seq_id]
            assert len(table) * kv_cache.block_size >= seq.num_computed_tokens + num_new
        assert plan.num_batched_tokens <= scheduler.max_num_batched_tokens or \
            not isinstance(scheduler, ChunkedPrefillScheduler)
        assert sum(1 for r in scheduler.running for s in r.sequences
                   if s.status is SequenceStatus.RUNNING) <= scheduler.max_num_seqs
        swapped_seq_ids = {s.seq_id for r in scheduler.swapped for s in r.sequences}
        assert not swapped_seq_ids & seen, "a swapped sequence ran before being swapped in"
        check_speculation(scheduler, plan)
        assert plan.draft_catch_up_tokens == sum(min(seq.draft_lag, seq.num_computed_tokens)
                                                 for seq in plan.seqs)
        starts_run = {seq.seq_id: seq.starts_run for seq in plan.seqs}
        result = StepResult(step_duration) if execute is None else execute(plan)
        now += result.duration
        for request in scheduler.update(plan, result, now):
            finished_ids.append(request.request_id)
        for seq in plan.seqs:  # what the drafts' outcome leaves for the sequence's next step
            k = plan.spec_lens.get(seq.seq_id, 0)
            accepted = (result.num_accepted or {}).get(seq.seq_id, 0)
            assert seq.draft_lag == (1 if k and accepted == k else 0)
            # A run of acceptable drafts ends at a rejection; a step without drafts leaves it.
            assert seq.starts_run == (accepted < k if k else starts_run[seq.seq_id])
        if plan.spec_lens:
            kv_cache.check_invariants()  # after the rejected drafts' slots went back
    else:
        raise AssertionError(f"did not finish in {max_steps} steps: {scheduler.queue_lengths()}")
    return finished_ids


def check_outcome(scheduler, requests, finished_ids):
    """Checks a finished run: each request done once at full length or rejected; all blocks free."""
    assert len(finished_ids) == len(set(finished_ids)), "a request finished twice"
    rejected = [r for r in requests if r.rejected_reason is not None]
    assert sorted(finished_ids) == sorted(r.request_id for r in requests
                                          if r.rejected_reason is None)
    for request in requests:
        if request.rejected_reason is not None:
            assert request.finish_time is None
            continue
        assert len(request.sequences) == request.n
        for seq in request.sequences:
            assert seq.status is SequenceStatus.FINISHED
            assert seq.num_output_tokens == request.output_len
        assert request.arrival_time <= request.first_scheduled_time <= request.first_token_time
        assert request.first_token_time <= request.finish_time
    for request in rejected:
        assert request.rejected_reason
    kv_cache = scheduler.kv_cache
    kv_cache.check_invariants()
    assert kv_cache.num_used_blocks() == 0
    assert kv_cache.num_free_blocks() == kv_cache.num_blocks
    assert not kv_cache.block_tables


def synthetic_workload(**overrides) -> dict:
    """A small synthetic workload config (200 requests at 10/s, prompts 10-20, outputs 7)."""
    cfg = {
        "kind": "synthetic", "num_requests": 200, "rate": 10.0, "arrival": "poisson",
        "prompt_len": {"dist": "uniform", "low": 10, "high": 20},
        "output_len": {"dist": "fixed", "value": 7},
    }
    cfg.update(overrides)
    return cfg


def request_tuples(requests) -> list[tuple]:
    """What a workload decides of each request, as comparable tuples."""
    return [(r.request_id, r.arrival_time, r.prompt_len, r.output_len, r.n, r.prompt_token_ids,
             r.priority, r.tenant, r.slo_ttft_ms, r.slo_tpot_ms, r.predicted_output_len)
            for r in requests]


def run_both_ways(overrides, monkeypatch):
    """The simulator run of `overrides` with repeated steps and step by step
    (backend.repeated_steps=false); returns both and the length of each run of repeated steps
    the first made."""
    from sim.core.experiment import run_experiment
    from sim.core.repeated_steps import RepeatedStepsLoop

    repeated_runs = []
    run = RepeatedStepsLoop._run

    def counting(self, *args):
        result = run(self, *args)
        repeated_runs.append(len(self.step_end_times))
        return result

    monkeypatch.setattr(RepeatedStepsLoop, "_run", counting)
    repeated = run_experiment(make_cfg(*overrides), plots=False)
    monkeypatch.undo()   # (every patch of the test: call this before patching anything else)
    step_by_step = run_experiment(make_cfg(*overrides, "backend.repeated_steps=false"),
                                  plots=False)
    return repeated, step_by_step, repeated_runs


def assert_same_run(repeated, step_by_step):
    """Two simulator runs came out alike: summary, every step row, ITLs and request times."""
    assert summary_without_wall_time(repeated) == summary_without_wall_time(step_by_step)
    assert repeated.metrics.step_rows == step_by_step.metrics.step_rows
    assert dict(repeated.metrics.itl_counts) == dict(step_by_step.metrics.itl_counts)
    for a, b in zip(repeated.requests, step_by_step.requests):
        assert (a.first_token_time, a.finish_time, a.num_preemptions) == \
               (b.first_token_time, b.finish_time, b.num_preemptions)
