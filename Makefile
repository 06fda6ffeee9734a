# `make run` installs twinserve into .venv and runs the default experiment;
# `make test` installs it with the test extras and runs the test suite (what CI runs).
VENV ?= .venv
PYTHON ?= python3
BIN = $(VENV)/bin

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch first, pinned: it is the CPU build on this kind of machine, while an unpinned torch
# (asked for by the project) would pull a multi-GB CUDA build.
$(VENV)/.installed: $(BIN)/activate pyproject.toml
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

.PHONY: install run test bench vllm-venv profile validate-grid validate-light-load profile-speculation \
	validate-speculation profile-token-trees validate-token-trees
install: $(VENV)/.installed

run: install
	$(BIN)/twinserve

# Without a GPU, Triton kernels run (slowly, at tiny sizes) in its interpreter.
test: install
	$(if $(shell command -v nvidia-smi),,TRITON_INTERPRET=1) $(BIN)/python -m pytest -n 2

bench: install
	$(BIN)/python bench/sim_speed.py

# vLLM's CPU build in a venv of its own (.venv-vllm), where the vLLM adapter's tests find it
# (they skip without it); twinserve-vllm makes the same venv on first use.
vllm-venv: install
	$(BIN)/python -c "from pathlib import Path; from vllm_adapter.venv import vllm_python, \
	with_policy_config_packages as add; add(vllm_python(Path('.venv-vllm')))"

# Calibration: profile the engine on this machine, then validate the profiled simulator against
# the engine over a grid of policies and loads (README, "Calibration and validation"). Run them
# on a quiet machine: the profile and the engine runs are timed.
PROFILE ?= profiles/cpu/tiny-llama.json
profile: install
	$(BIN)/twinserve-profile

# Each engine job runs 3 times: every error comes with the engine's own spread beside it.
validate-grid: install
	$(BIN)/twinserve-validate --engine-repeats 3 --out validation/grid --profile $(PROFILE) \
	    model=tiny-llama hardware=cpu workload.with_token_ids=true workload.num_requests=100 \
	    '++workload.prompt_len={dist: uniform, low: 16, high: 256}' \
	    '++workload.output_len={dist: uniform, low: 8, high: 64}' kv_cache.num_blocks=128 \
	    scheduler=static,continuous,chunked_prefill kv_cache.block_size=16,32 \
	    preemption=recompute,swap workload.rate=2,8,inf

# Light load outside the grid (issue 20's TTFT bias): three workloads of tens of requests at a few
# per second, short prompts, each engine job run 3 times beside its spread, the three run
# LIGHT_LOAD_RUNS times in turn (about 1.5-4 minutes a round); then one table of every run,
# validation/light-load/grid.md, with each metric's mean signed error.
LIGHT_LOAD_RUNS ?= 3
LIGHT_LOAD = $(BIN)/twinserve-validate --engine-repeats 3 --profile $(PROFILE) model=tiny-llama \
	hardware=cpu workload.with_token_ids=true
validate-light-load: install
	rm -rf validation/light-load
	for run in $$(seq 1 $(LIGHT_LOAD_RUNS)); do \
	  out=validation/light-load/run$$run; \
	  $(LIGHT_LOAD) --out $$out/40-at-4 workload.num_requests=40 workload.rate=4 \
	    '++workload.prompt_len={dist: uniform, low: 16, high: 200}' \
	    '++workload.output_len={dist: uniform, low: 8, high: 64}' || true; \
	  $(LIGHT_LOAD) --out $$out/60-at-3 workload.num_requests=60 workload.rate=3 \
	    '++workload.prompt_len={dist: uniform, low: 32, high: 256}' \
	    '++workload.output_len={dist: uniform, low: 16, high: 96}' || true; \
	  $(LIGHT_LOAD) --out $$out/40-at-6 workload.num_requests=40 workload.rate=6 \
	    '++workload.prompt_len={dist: uniform, low: 8, high: 128}' \
	    '++workload.output_len={dist: uniform, low: 8, high: 48}' || true; \
	done
	$(BIN)/twinserve-validate --tabulate --out validation/light-load validation/light-load/run*/*

# Speculative decoding on the trained tiny pair: profile the executor without a drafter and with
# each drafter (together, in the same interleaved rounds: a speedup divides one by the other),
# then validate acceptance rate and speedup for k = 1..8 (README, "Speculative
# decoding"). The acceptance statistics come from `python bench/speculative.py`.
profile-speculation: install
	$(BIN)/twinserve-profile --model tiny-pair --block-sizes 16 \
	    --speculative-models none tiny-pair-draft ngram

validate-speculation: install
	$(BIN)/python bench/validate_speculation.py --out validation/speculation

# The same for the token-tree drafters (Medusa's trained heads, lookahead decoding), profiled
# together with their own no-drafter executor under profiles/token-trees/: trees of depth 1..4.
profile-token-trees: install
	$(BIN)/twinserve-profile --model tiny-pair --block-sizes 16 --out-dir profiles/token-trees \
	    --speculative-models none medusa lookahead --speculative-ks 1 2 3 4 \
	    --medusa-heads models/tiny-pair/medusa

validate-token-trees: install
	$(BIN)/python bench/validate_speculation.py --drafter medusa --out validation/medusa
	$(BIN)/python bench/validate_speculation.py --drafter lookahead --out validation/lookahead
