"""Multi-LoRA on the engine against HF + PEFT, on the tiny random Llama (fp32, CPU, one thread).

One batch mixes requests of different adapters (of different ranks, targeting every Llama
projection) and requests of the base model; each request's greedy output must equal HF generate
on a PeftModel built by peft.LoraConfig + get_peft_model on the same seeded base model, holding
that adapter alone, its A and B loaded from engine/lora.py's adapter_weights. With fewer device
slots than adapters, adapters are loaded and evicted between steps and outputs stay equal.
"""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.lora import LoRAAdapters
from engine.model_loader import load_model
from engine.peft_reference import peft_model
from policies.lora.spec import TARGET_MODULES

from factories import token_ids
from triton_interpreter import ran_in_fresh_process

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
RANKS = [4, 16, 8]
LORA = dict(num_adapters=len(RANKS), ranks=RANKS, alpha=8,
            target_modules=list(TARGET_MODULES), max_loras=len(RANKS))
# Prompt i runs adapter LORA_IDS[i]; None: the base model.
LORA_IDS = [0, None, 1, 2, 1, None, 0, 2]


def random_prompts(lens, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lens]


def hf_greedy(model, prompts):
    with torch.inference_mode():
        return [model.generate(input_ids=torch.tensor([p]), max_new_tokens=MAX_TOKENS,
                               min_new_tokens=MAX_TOKENS, do_sample=False,
                               pad_token_id=0)[0, len(p):].tolist() for p in prompts]


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([5, 17, 33, 9, 1, 40, 16, 23], seed=11)


@pytest.fixture(scope="module")
def expected(prompts):
    """Each prompt through HF with its adapter alone (PEFT), or the plain base model."""
    base = load_model("tiny-llama", torch.device("cpu"), seed=0).model
    adapters = LoRAAdapters.from_config(LORA)
    models = {None: base, **{i: peft_model(base, adapters, i) for i in range(len(RANKS))}}
    outputs = [hf_greedy(models[lora_id], [prompt])[0]
               for prompt, lora_id in zip(prompts, LORA_IDS)]
    by_base = hf_greedy(base, prompts)
    changed = [out != plain for out, plain, lora_id in zip(outputs, by_base, LORA_IDS)
               if lora_id is not None]
    assert all(changed), "an adapter leaves its request's greedy output as the base model's"
    return outputs


def test_mixed_adapters_in_one_batch_match_peft(prompts, expected):
    llm = LLM("tiny-llama", num_gpu_blocks=256, lora=LORA)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_id=LORA_IDS)
    assert token_ids(outputs) == expected
    # Every request was in the first step: one batch held every adapter and the base model.
    assert llm.last_stats.num_steps == MAX_TOKENS
    assert llm.executor.runner.lora.num_loads == len(RANKS)


def test_adapters_evicted_and_reloaded_keep_outputs(prompts, expected):
    """Two slots for three adapters: a call's missing adapters evict the least recently used
    adapters it does not need (the scheduler's LoRA manager decides, the engine follows), and
    reloaded adapters give the same tokens."""
    llm = LLM("tiny-llama", num_gpu_blocks=256, lora={**LORA, "max_loras": 2})
    served = llm.executor.runner.lora
    # (adapters of the call, adapters in the slots after it, loads so far): after [0] the least
    # recently used of 0 and 2 is 2, which [1] evicts.
    for used, resident, loads in (([0, 1], {0, 1}, 2), ([2, 0], {0, 2}, 3), ([0], {0, 2}, 3),
                                  ([1], {0, 1}, 4)):
        chosen = [i for i, lora_id in enumerate(LORA_IDS) if lora_id in used or lora_id is None]
        outputs = llm.generate([prompts[i] for i in chosen], GREEDY, use_tqdm=False,
                               lora_id=[LORA_IDS[i] for i in chosen])
        assert token_ids(outputs) == [expected[i] for i in chosen]
        assert set(served.slot_adapters) == resident
        assert served.num_loads == loads
        # The engine's slots are where the scheduler's LoRA manager put each adapter.
        assert {lora_id: served.slot_adapters.index(lora_id)
                for lora_id in resident} == dict(llm.scheduler.lora.slots)
        check_slots(served)


def test_engine_slots_are_the_lora_managers(prompts, expected):
    """The engine loads each adapter into the slot the scheduler's LoRA manager chose (here the
    first request's adapter, 2, into the first free slot), not a placement of its own."""
    llm = LLM("tiny-llama", num_gpu_blocks=256, lora={**LORA, "max_loras": 2})
    outputs = llm.generate([prompts[3], prompts[2]], GREEDY, use_tqdm=False, lora_id=[2, 1])
    assert token_ids(outputs) == [expected[3], expected[2]]
    assert dict(llm.scheduler.lora.slots) == {2: 0, 1: 1}
    assert llm.executor.runner.lora.slot_adapters == [2, 1]


def check_slots(served):
    """Each slot holds its adapter's A and B, zero past the adapter's rank (the kernels' layout:
    no stale rows or columns of a wider adapter the slot held before)."""
    for slot, lora_id in enumerate(served.slot_adapters):
        rank = RANKS[lora_id]
        for name, (lora_a, lora_b) in served.host_weights(lora_id).items():
            module = served.modules[name]
            assert torch.equal(module.lora_a[slot, :rank], lora_a)
            assert torch.equal(module.lora_b[slot, :, :rank], lora_b)
            assert not module.lora_a[slot, rank:].any() and not module.lora_b[slot, :, rank:].any()


def test_chunked_prefill_with_adapters_matches_peft(prompts, expected):
    llm = LLM("tiny-llama", scheduler="chunked_prefill", max_num_batched_tokens=12,
              num_gpu_blocks=256, lora=LORA)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_id=LORA_IDS)
    assert token_ids(outputs) == expected


def test_speculative_verification_with_adapters_matches_peft(prompts, expected):
    """A draft model (the base model: drafts carry no adapter) proposes, the target verifies
    each sequence's drafts with the sequence's adapter: the tokens are the adapter's."""
    llm = LLM("tiny-llama", num_gpu_blocks=256, speculative_model="tiny-llama",
              num_speculative_tokens=3, lora=LORA)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_id=LORA_IDS)
    assert token_ids(outputs) == expected
    assert llm.last_stats.num_accepted_tokens > 0


def test_slots_without_a_manager_evict_the_least_recently_used():
    """A plan without a LoRA manager's placement (a scheduler object built without one): the
    engine loads missing adapters into free slots, else the least recently used it can spare."""
    import numpy as np

    served = LLM("tiny-llama", num_gpu_blocks=64,
                 lora={**LORA, "max_loras": 2}).executor.runner.lora
    # After [0], adapter 2 (slot 1) is the least recently used: [1] evicts it.
    for ids, slots, loads in (([1, 0], [0, 1], 2), ([2, -1, 0], [0, 2], 3), ([0], [0, 2], 3),
                              ([1, 1], [0, 1], 4)):
        batch = served.batch_for(np.array(ids))
        assert served.slot_adapters == slots and served.num_loads == loads
        assert batch.token_slots.tolist() == [slots.index(i) if i >= 0 else -1 for i in ids]
    check_slots(served)


def test_step_over_max_loras_adapters_is_refused():
    """The scheduler keeps a batch within max_loras; a step that is not is refused, not run."""
    import numpy as np

    served = LLM("tiny-llama", num_gpu_blocks=64,
                 lora={**LORA, "max_loras": 2}).executor.runner.lora
    with pytest.raises(ValueError, match="uses 3 adapters, more than lora.max_loras=2"):
        served.batch_for(np.array([0, 1, -1, 2]))
    assert served.num_loads == 0


@pytest.mark.parametrize("kwargs, lora_id, message", [
    (dict(lora=LORA), 3, r"lora_id must be None or one of the 3 adapters, 0..2; got 3"),
    (dict(lora=LORA), [0, True], r"lora_id\[1\] must be None or one of the 3 adapters"),
    (dict(lora=LORA), [0, 1, 2], r"lora_id must be one adapter id .* or one per prompt \(2\)"),
    (dict(), 0, r"lora_id must be None or None: this engine serves no adapters"),
])
def test_bad_lora_id_names_the_argument(kwargs, lora_id, message):
    llm = LLM("tiny-llama", num_gpu_blocks=64, **kwargs)
    with pytest.raises(ValueError, match=message):
        llm.generate([[5, 6], [7]], GREEDY, use_tqdm=False, lora_id=lora_id)


@pytest.mark.parametrize("lora, message", [
    ({**LORA, "ranks": [4, 0, 8]}, r"lora.ranks\[1\] must be a positive integer"),
    ({**LORA, "ranks": [4, 8]}, r"lora.ranks must be one int or a list of lora.num_adapters=3"),
    ({**LORA, "target_modules": ["q_proj", "fc1"]}, r"lora.target_modules must be"),
    ({**LORA, "max_loras": 0}, r"lora.max_loras must be a positive integer"),
    ({**LORA, "rank": 4}, r"lora: unknown key\(s\) \['rank'\]"),
    ("no-such-lora", r"lora must be None, a mapping of the lora group's keys or one of"),
])
def test_bad_lora_config_names_the_key(lora, message):
    with pytest.raises(ValueError, match=message):
        LLM("tiny-llama", num_gpu_blocks=64, lora=lora)


def test_triton_path_with_mixed_adapters_matches_peft(prompts, expected, request):
    if ran_in_fresh_process(request):
        return
    llm = LLM("tiny-llama", num_gpu_blocks=256, kernel_backend="triton", lora=LORA)
    # Adapters 0 and 1 and the base model, four tokens each: the interpreter is slow.
    chosen, num_tokens = [0, 1, 4], 4
    outputs = llm.generate([prompts[i] for i in chosen],
                           SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True),
                           use_tqdm=False, lora_id=[LORA_IDS[i] for i in chosen])
    assert token_ids(outputs) == [expected[i][:num_tokens] for i in chosen]


def test_slots_follow_the_plans_placement():
    """With a LoRA manager's placement the engine loads what the plan loads, where it says, and
    refuses a plan that runs an adapter from a slot that does not hold it."""
    import numpy as np

    served = LLM("tiny-llama", num_gpu_blocks=64, lora=LORA).executor.runner.lora
    batch = served.batch_for(np.array([2, -1, 2, 0]), placement={2: 1, 0: 2},
                             loads=[(2, 1), (0, 2)])
    assert batch.token_slots.tolist() == [1, -1, 1, 2]
    assert served.slot_adapters == [None, 2, 0] and served.num_loads == 2
    with pytest.raises(ValueError, match=r"the plan runs adapter 1 in slot 0, which does not"):
        served.batch_for(np.array([1]), placement={1: 0})
    with pytest.raises(ValueError, match=r"the plan loads adapter 1 into slot 3, outside"):
        served.batch_for(np.array([1]), placement={1: 3}, loads=[(1, 3)])
    # A plan that only loads (an adapter for a later step) loads it and runs the base model.
    assert served.batch_for(np.array([-1, -1]), placement={}, loads=[(1, 0)]) is None
    assert served.slot_adapters == [1, 2, 0] and served.num_loads == 3


def test_engine_backend_runs_each_requests_adapter():
    """backend=engine with the lora group: the simulator's workload draws each request's adapter,
    its scheduler's LoRA manager places them in max_loras slots, the engine follows; each
    request's tokens equal the offline API's with that adapter (itself held to PEFT above)."""
    from factories import make_cfg
    from sim.core.experiment import run_experiment

    lora = ["lora=multi", "lora.num_adapters=3", "lora.ranks=[4,16,8]", "lora.alpha=8",
            "lora.max_loras=2", f"lora.target_modules=[{','.join(TARGET_MODULES)}]"]
    result = run_experiment(make_cfg(
        "backend=engine", "model=tiny-llama", "hardware=cpu", "workload.num_requests=8",
        "workload.rate=inf", "workload.with_token_ids=true",
        "++workload.prompt_len={dist: uniform, low: 4, high: 24}",
        "++workload.output_len={dist: uniform, low: 3, high: 6}", *lora), None)
    requests = result.requests
    assert result.summary["completed"] == 8 and result.summary["lora_loads"] > 2
    assert {request.lora_id for request in requests} == {0, 1, 2}
    llm = LLM("tiny-llama", num_gpu_blocks=256, lora=LORA)
    for request in requests:
        (output,) = llm.generate([request.prompt_token_ids],
                                 SamplingParams(temperature=0, max_tokens=request.output_len,
                                                ignore_eos=True),
                                 use_tqdm=False, lora_id=request.lora_id)
        assert request.sequences[0].output_token_ids == output.outputs[0].token_ids
