"""A scheduler written from scratch against `policies.protocols.Scheduler` (no BaseScheduler) runs
in the simulator and on the engine; the step loop's inter-token latencies equal an independent
count taken inside the scheduler's update."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
import torch

from factories import make_cfg
from policies.batching import ChunkedPrefillScheduler
from policies.protocols import Scheduler
from sim.core.experiment import run_experiment

REPO = Path(__file__).resolve().parents[1]

# ---- the scheduler a reader writes: docs/architecture.md's own block ------------------------------


def documented_fcfs_scheduler() -> type:
    """The `fcfs_scheduler.py` block of docs/architecture.md, run as a module: the documented
    code is what these tests run."""
    doc = (REPO / "docs" / "architecture.md").read_text()
    start = doc.index("# fcfs_scheduler.py")
    source = doc[start:doc.index("```", start)]
    assert len(source[source.index("class FCFSScheduler"):].splitlines()) < 80   # a class a reader writes in one sitting
    namespace = {"__name__": "fcfs_scheduler"}
    exec(compile(source, "docs/architecture.md (fcfs_scheduler.py)", "exec"), namespace)
    return namespace["FCFSScheduler"]


FCFSScheduler = documented_fcfs_scheduler()


# ---- the contract -------------------------------------------------------------------------------


def test_the_from_scratch_scheduler_satisfies_the_protocol():
    from policies.memory import PagedBlockManager
    assert isinstance(FCFSScheduler(PagedBlockManager(8, 4)), Scheduler)

    # A class missing one contract method (queue_lengths) is not a Scheduler.
    missing = type("Missing", (), {name: getattr(FCFSScheduler, name) for name in
                                   ("add_request", "schedule", "update", "has_unfinished",
                                    "num_outstanding")})
    missing.kv_cache, missing.speculation = None, None
    assert not isinstance(missing(), Scheduler)


class TrackedFCFS(FCFSScheduler):
    """FCFSScheduler that remembers itself and every request its update finished."""

    instances: list["TrackedFCFS"] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.finished_ids: list[int] = []
        TrackedFCFS.instances.append(self)

    def update(self, plan, result, now):
        finished = super().update(plan, result, now)
        self.finished_ids += [request.request_id for request in finished]
        return finished


def test_the_from_scratch_scheduler_runs_in_the_simulator():
    TrackedFCFS.instances.clear()
    result = run_experiment(make_cfg(
        "scheduler._target_=test_protocol_scheduler.TrackedFCFS", "cluster.num_replicas=2",
        "kv_cache.num_blocks=300", "workload.num_requests=200"), plots=False)
    assert result.summary["completed"] == 200 and result.summary["num_preemptions"] > 0
    finished_ids = [i for scheduler in TrackedFCFS.instances for i in scheduler.finished_ids]
    assert sorted(finished_ids) == list(range(200))   # every request finished, once
    for scheduler in TrackedFCFS.instances:
        assert scheduler.kv_cache.num_used_blocks() == 0   # no block leaked
        scheduler.kv_cache.check_invariants()
    assert result.summary["mean_itl_ms"] > 0


def test_the_from_scratch_scheduler_drives_the_engine():
    from engine import LLM, SamplingParams
    from policies.memory import PagedBlockManager

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (16, 15, 14, 13, 7)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    builtin = LLM("tiny-llama", num_gpu_blocks=256, seed=0, scheduler="continuous")
    expected = [out.outputs[0].token_ids for out in builtin.generate(prompts, greedy,
                                                                     use_tqdm=False)]
    # 10 blocks of 8 hold the prompts, not their outputs: decodes preempt and recompute.
    scheduler = FCFSScheduler(PagedBlockManager(num_blocks=10, block_size=8), max_num_seqs=8,
                              max_num_batched_tokens=2048, max_model_len=2048)
    llm = LLM("tiny-llama", scheduler=scheduler, seed=0)
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outputs] == expected
    assert llm.last_stats.num_preemptions > 0
    assert scheduler.kv_cache.num_used_blocks() == 0


# ---- inter-token latencies: the step loop's histogram against the scheduler's own count ---------


class ITLCountingScheduler(ChunkedPrefillScheduler):
    """Counts inter-token latencies inside update, from the plan and result: each sequence that
    reaches its last token gains 1 + its accepted drafts, `now - last_token_time` after its last
    token (its first token has none)."""

    counts: defaultdict[float, int] = defaultdict(int)

    def update(self, plan, result, now):
        for seq, num_new in zip(plan.seqs, plan.num_new_tokens):
            if seq.num_computed_tokens + num_new == seq.num_tokens and seq.num_output_tokens:
                accepted = (result.num_accepted or {}).get(seq.seq_id, 0)
                ITLCountingScheduler.counts[now - seq.last_token_time] += 1 + accepted
        return super().update(plan, result, now)


@pytest.mark.parametrize("overrides", [
    ["preemption=swap", "kv_cache.num_blocks=400"],
    ["speculation=fixed", "kv_cache.num_blocks=600", "++workload.n=2"],
])
def test_itl_histogram_equals_the_schedulers_own_count(overrides):
    ITLCountingScheduler.counts.clear()
    result = run_experiment(make_cfg(
        "scheduler._target_=test_protocol_scheduler.ITLCountingScheduler",
        "scheduler.max_num_batched_tokens=512", "cluster.num_replicas=2",
        "backend.repeated_steps=false",   # its count is per update: one step at a time
        "workload.num_requests=150", *overrides), plots=False)
    assert result.summary["num_preemptions"] > 0 or "speculation=fixed" in overrides
    assert dict(result.metrics.itl_counts) == dict(ITLCountingScheduler.counts)
    assert sum(result.metrics.itl_counts.values()) > 1000
