"""The GPU cost model's decode steps against the decode steps of real vLLM runs.

A second of vLLM's own log (`vllm_timeseries.csv` of data/real-runs/llmservingsim/) in which no
prompt token was computed is decode steps only: each running request gained one token a step,
so the step took running / generated-tokens-per-second. The batch is the log's own `running`
count (the mean of the second's two ticks: a preempted request waiting for its recompute is not
in it); its context per request in the middle of that second comes from the per-request first-
and last-token times (tokens spread evenly between them). The cost model predicts the same
decode step from these aggregates; the ratio model / real, second by second, measures the decode
kernels and the per-step terms alone, without scheduling, preemption or prefill in the way.
Seconds with prompt tokens are reported too, as predicted busy time (about 1 s when the GPU was
busy all the second), a coarser check of prefill: the second's prompt tokens spread over as many
steps as its prompts took (one each, more for a prompt past the token budget the decodes leave),
its other steps decodes only. The run's saturated opening (prompts queued, every step a full token budget)
measures the board's prefill rate: `--fit-compute` gives the hardware compute_efficiency that
reproduces it.

    python bench/real_run_steps.py [RUN_FOLDER ...] [--fit-bandwidth] [--fit-compute] [overrides]

Overrides are cost_model keys (`step_overhead_s=0`, `workstation_bandwidth_efficiency=1.0`).
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import statistics
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from policies.types import StepPlan
from calibration.realrun.prompt_blocks import seen_before_tokens
from calibration.realrun.readers import llmservingsim_hash_ids, llmservingsim_settings
from calibration.realrun.settings import V1_DEFAULTS, is_v1, match_hardware, match_model
from runtime.policy_config import CONF_DIR
from sim.cost.gpu.cost_model import GPUCostModel

REPO = Path(__file__).resolve().parents[1]
RUNS = REPO / "data" / "real-runs" / "llmservingsim"
DEFAULT_RUNS = [RUNS / "RTX4090" / "Llama-3.1-8B", RUNS / "RTXPRO6000" / "Llama-3.1-8B",
                RUNS / "RTXPRO6000" / "Qwen3-32B",
                RUNS / "RTXPRO6000" / "Qwen3-30B-A3B-Instruct-2507"]
# A decode chunk's prefill context: mid-prompt of the runs' mean 857-token prompts.
PREFILL_CONTEXT = 400
# A second whose KV cache use reached this share (vLLM's kv_cache_pct) may have preempted.
KV_PRESSURE_PCT = 95.0
# A request scheduled this long after it was queued waited for the token budget (a backlog).
ADMISSION_WAIT_S = 0.01
# A saturated stretch shorter than this is too few steps to measure a rate on.
MIN_SATURATED_S = 1.5


def batch_at(requests: list[dict], offset: float, when: float) -> tuple[int, float]:
    """(decoding requests, their total context in tokens) at unix time `when`."""
    num, context = 0, 0.0
    for r in requests:
        first, last = r["first_token_ts"] + offset, r["last_token_ts"] + offset
        if first <= when < last:
            num += 1
            context += r["input_toks"] + (r["output_toks"] - 1) * (when - first) / (last - first)
    return num, context


def cost_model_of(folder: Path, overrides: dict, **hardware_fields) -> GPUCostModel:
    """The shipped GPU cost model for the run's model, hardware (its fields replaced by
    `hardware_fields`) and TP, its cost_model keys replaced by `overrides`."""
    meta = json.loads((folder / "vllm_meta.json").read_text())
    config = json.loads((folder / "config.json").read_text())["nodes"][0]["instances"][0]
    model = match_model(meta["model"])
    hardware = match_hardware(config["hardware"])
    tp = int(meta["engine_kwargs"].get("tensor_parallel_size") or 1)
    gpu = OmegaConf.load(CONF_DIR / "cost_model" / "gpu.yaml")
    terms = {k: gpu[k] for k in ("step_overhead_s", "per_sequence_overhead_s",
                                 "workstation_bandwidth_efficiency")}
    if meta["engine_kwargs"].get("enable_expert_parallel"):   # the experts over every GPU
        terms["expert_parallel_size"] = tp * data_parallel_size(meta)
    return GPUCostModel(OmegaConf.load(CONF_DIR / "model" / f"{model}.yaml"),
                        {**OmegaConf.to_container(OmegaConf.load(
                            CONF_DIR / "hardware" / f"{hardware}.yaml")), **hardware_fields}, tp,
                        **{**terms, **overrides})


def data_parallel_size(meta: dict) -> int:
    return int(meta["engine_kwargs"].get("data_parallel_size") or 1)


def seconds(folder: Path, cost_model: GPUCostModel) -> list[dict]:
    """One row per logged second with decoding requests: measured and predicted. With data
    parallelism the log counts every rank's requests and tokens; each rank steps its share
    (taken as equal) at the same rate, so a step is predicted at that share."""
    meta = json.loads((folder / "vllm_meta.json").read_text())
    start = datetime.datetime.fromisoformat(meta["started_at"].replace("Z", "+00:00")).timestamp()
    requests = [json.loads(line) for line in (folder / "vllm_requests.jsonl").open()]
    offset = float(np.median([r["arrival_time"] - r["queued_ts"] for r in requests]))
    budget = int(meta["engine_kwargs"]["max_num_batched_tokens"])
    rows = []
    with open(folder / "vllm_timeseries.csv", newline="") as file:
        ticks = list(csv.DictReader(file))
    for before, tick in zip([None, *ticks], ticks):
        prompt, generated = float(tick["prompt_throughput"]), float(tick["gen_throughput"])
        end = start + float(tick["t"])
        decoding, context = batch_at(requests, offset, end - 0.5)
        # The log's running count excludes requests preempted and waiting for their recompute,
        # which the per-request times would count as decoding from first to last token.
        running = (float(tick["running"]) + float(before["running"] if before else 0)) / 2
        num = min(decoding, round(running)) if decoding else 0
        if num == 0 or generated < 2 * num:   # too few steps in the second to read one
            continue
        context *= num / decoding
        steps = generated / num
        ranks = data_parallel_size(meta)
        decodes = max(1, round(num / ranks))
        # The steps that carried the prompt tokens: the log counts a prompt in the second of its
        # first token, and a prompt takes one step, or several where it exceeds the token budget
        # the decodes leave; the second's other steps were decodes only.
        room = max(1, budget - decodes)
        prompt_steps = sum(-(-r["input_toks"] // room) for r in requests
                           if end - 1 <= r["first_token_ts"] + offset < end) / ranks
        mixed = min(steps, max(1.0, prompt_steps)) if prompt else 0.0
        chunk = int(prompt / mixed / ranks) if prompt else 0
        plan = StepPlan(num_decode_seqs=decodes, decode_context_tokens=int(context / ranks),
                        num_prefill_tokens=chunk, num_prefill_seqs=1 if chunk else 0,
                        prefill_attention_work=chunk * (chunk + PREFILL_CONTEXT),
                        prefill_context_tokens=chunk + PREFILL_CONTEXT if chunk else 0,
                        sum_squared_prefill_chunks=chunk * chunk)
        busy = mixed * cost_model.step_time(plan) + (steps - mixed) * cost_model.step_time(
            StepPlan(num_decode_seqs=decodes, decode_context_tokens=int(context / ranks)))
        rows.append({"t": float(tick["t"]), "decodes": num, "context": int(context),
                     "prompt_tokens": prompt, "real_step_ms": 1e3 / steps,
                     "model_step_ms": 1e3 * busy / steps, "busy_s": busy,
                     # Requests waited all second (the GPU never idled); at KV pressure the
                     # engine may have recomputed preempted requests, which no counter logs.
                     "saturated": bool(before) and min(float(before["waiting"]),
                                                       float(tick["waiting"])) > 0,
                     "kv_pressure": max(float(tick["kv_cache_pct"]),
                                        float(before["kv_cache_pct"]) if before else 0.0)
                     >= KV_PRESSURE_PCT})
    return rows


# Per-request fields that count the prompt tokens served from the prefix cache (none of the
# LLMServingSim logs has one).
CACHED_PROMPT_FIELDS = ("num_cached_tokens", "cached_toks")


def cached_prompt_tokens(folder: Path, requests: list[dict]) -> list[int] | None:
    """Each request's prompt tokens the prefix cache served (vLLM counts a prompt whole, its
    cache hits included), `requests` being vllm_requests.jsonl's lines in file order: none
    without prefix caching (as recorded, else vLLM V1's default); else the log's own count, or
    the blocks an earlier prompt already had by the workload file's hash ids (an unlimited
    cache: before KV pressure nothing was evicted). None when neither tells."""
    settings, _ = llmservingsim_settings(folder)
    caching = settings.get("enable_prefix_caching",
                           is_v1(settings) and V1_DEFAULTS["enable_prefix_caching"])
    if not caching:
        return [0] * len(requests)
    field = next((name for name in CACHED_PROMPT_FIELDS if name in requests[0]), None)
    if field is not None:
        return [int(r[field]) for r in requests]
    hash_ids = llmservingsim_hash_ids(folder / "vllm_requests.jsonl", requests, [])
    if hash_ids is None:
        return None
    return seen_before_tokens(hash_ids, [r["input_toks"] for r in requests]).tolist()


def uncomputed_prompts(folder: Path) -> str | None:
    """Why the run's prompt counts cannot measure compute (None if they can): with prefix caching
    on, vLLM counts a prompt whole, its cache hits included, and a log without a per-request
    count of cached tokens or the prompts' hash ids cannot tell the computed part."""
    requests = [json.loads(line) for line in (folder / "vllm_requests.jsonl").open()]
    if cached_prompt_tokens(folder, requests) is not None:
        return None
    return ("prefix caching was on and the log has no per-request cached-token count "
            f"({' or '.join(CACHED_PROMPT_FIELDS)}) nor a workload file with the prompts' "
            "hash_ids: its prompt tokens include cache hits")


def saturated_prefill(folder: Path) -> dict | None:
    """The run's saturated opening: the longest stretch of requests, in first-token order, each
    of which waited to be scheduled (a backlog of prompts: the GPU never idled and each step
    filled its token budget), ending before vLLM's log first shows KV pressure (past it,
    preempted requests are recomputed and no counter logs that work) or max_num_seqs running.
    None when no stretch lasts MIN_SATURATED_S.

    {"seconds", "prompt_tokens" (those computed: the prefix cache's left out where known),
    "cached_prompt_tokens", "decode_tokens", "decodes" (mean decoding requests), "context" (their
    mean total context)}: what the GPU computed in those seconds."""
    meta = json.loads((folder / "vllm_meta.json").read_text())
    requests = [json.loads(line) for line in (folder / "vllm_requests.jsonl").open()]
    # Unknown cached counts (--count-cached-prompts) count whole prompts: an upper bound.
    cached = cached_prompt_tokens(folder, requests) or [0] * len(requests)
    for r, served in zip(requests, cached):
        r["cached_prompt_toks"] = served
    requests.sort(key=lambda r: r["first_token_ts"])
    start = min(r["queued_ts"] for r in requests)
    max_num_seqs = int(meta["engine_kwargs"]["max_num_seqs"])
    with open(folder / "vllm_timeseries.csv", newline="") as file:
        # Past these ticks steps no longer fill the token budget with prompts: the KV cache or
        # max_num_seqs holds admission back.
        limited = [float(t["t"]) - 1 for t in csv.DictReader(file)
                   if float(t["kv_cache_pct"]) >= KV_PRESSURE_PCT
                   or float(t["running"]) >= max_num_seqs]
    # The log's t counts from the engine's start; the first request arrives within its first
    # second, so the tick before the limit is a safe bound in the requests' clock.
    end = start + (min(limited) if limited else float("inf"))
    best, stretch = [], []
    for r in requests:
        if r["scheduled_ts"] - r["queued_ts"] > ADMISSION_WAIT_S and r["first_token_ts"] < end:
            stretch.append(r)
            if len(stretch) > len(best):
                best = list(stretch)
        else:
            stretch = []
    if len(best) < 2 or best[-1]["first_token_ts"] - best[0]["first_token_ts"] < MIN_SATURATED_S:
        return None
    # From the first's first token to the last's: the prompts in between were computed there.
    t0, t1 = best[0]["first_token_ts"], best[-1]["first_token_ts"]
    decode_tokens, decoding_s, context_s = 0.0, 0.0, 0.0
    for r in requests:
        first, last = r["first_token_ts"], r["last_token_ts"]
        overlap = min(t1, last) - max(t0, first)
        if overlap <= 0 or last <= first:
            continue
        rate = (r["output_toks"] - 1) / (last - first)
        decode_tokens += rate * overlap
        decoding_s += overlap
        middle = (max(t0, first) + min(t1, last)) / 2
        context_s += overlap * (r["input_toks"] + rate * (middle - first))
    seconds_ = t1 - t0
    return {"seconds": seconds_,
            "prompt_tokens": sum(r["input_toks"] - r["cached_prompt_toks"] for r in best[1:]),
            "cached_prompt_tokens": sum(r["cached_prompt_toks"] for r in best[1:]),
            "decode_tokens": decode_tokens, "decodes": decoding_s / seconds_,
            "context": context_s / seconds_,
            "token_budget": int(meta["engine_kwargs"]["max_num_batched_tokens"])}


def predicted_saturated_s(window: dict, cost_model: GPUCostModel) -> float:
    """Seconds the cost model takes for the window's work in full steps of the token budget:
    each step the window's mean decodes plus a prompt chunk filling the rest."""
    decodes = max(1, round(window["decodes"]))
    chunk = window["token_budget"] - decodes
    steps = (window["prompt_tokens"] + window["decode_tokens"]) / window["token_budget"]
    plan = StepPlan(num_decode_seqs=decodes, decode_context_tokens=int(window["context"]),
                    num_prefill_tokens=chunk, num_prefill_seqs=1,
                    prefill_attention_work=chunk * (chunk + PREFILL_CONTEXT),
                    prefill_context_tokens=chunk + PREFILL_CONTEXT,
                    sum_squared_prefill_chunks=chunk * chunk)
    return steps * cost_model.step_time(plan)


def fitted_compute_efficiency(folder: Path, overrides: dict) -> float | None:
    """The hardware's compute_efficiency at which the run's saturated opening takes as long in
    the model as it did (None without one): the board's own prefill rate."""
    window = saturated_prefill(folder)
    if window is None:
        return None
    low, high = 0.25, 4.0
    for _ in range(30):
        middle = (low * high) ** 0.5
        model = cost_model_of(folder, overrides, compute_efficiency=middle)
        predicted = predicted_saturated_s(window, model)
        low, high = (middle, high) if predicted > window["seconds"] else (low, middle)
    return (low * high) ** 0.5


def fitted_bandwidth_efficiency(folder: Path, overrides: dict) -> float:
    """The workstation_bandwidth_efficiency at which the run's decode-only seconds come out
    right at the median (bisection in log space: the decode step falls as the share rises)."""
    low, high = 0.5, 2.0
    for _ in range(30):
        middle = (low * high) ** 0.5
        model = cost_model_of(folder, {**overrides, "workstation_bandwidth_efficiency": middle})
        ratios = [r["model_step_ms"] / r["real_step_ms"] for r in seconds(folder, model)
                  if not r["prompt_tokens"]]
        low, high = (middle, high) if statistics.median(ratios) > 1 else (low, middle)
    return (low * high) ** 0.5


def parse_value(text: str):
    try:
        return float(text)
    except ValueError:
        return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("arguments", nargs="*", help="run folders, then cost_model key=value")
    parser.add_argument("--fit-bandwidth", action="store_true",
                        help="also print each workstation run's fitted bandwidth efficiency and "
                             "its decode steps predicted with the others' mean")
    parser.add_argument("--fit-compute", action="store_true",
                        help="also print each run's saturated opening (prompt tokens a second "
                             "while prompts queued, before KV pressure) and the hardware "
                             "compute_efficiency that reproduces it")
    parser.add_argument("--count-cached-prompts", action="store_true",
                        help="with --fit-compute: fit even where the log's prompt counts "
                             "include prefix-cache hits (an upper bound on the share)")
    args = parser.parse_args(argv)
    arguments = args.arguments
    runs = [Path(a) for a in arguments if "=" not in a] or DEFAULT_RUNS
    overrides = {key: parse_value(value) for key, value in
                 (a.split("=", 1) for a in arguments if "=" in a)}
    print("| run | decode-only seconds | model / real decode step, median (p10-p90) | "
          "seconds with prompts | predicted busy s, median (p10-p90) |\n|---|---|---|---|---|")
    for folder in (run if run.is_absolute() else Path.cwd() / run for run in runs):
        rows = seconds(folder, cost_model_of(folder, overrides))
        decode = [r["model_step_ms"] / r["real_step_ms"] for r in rows if not r["prompt_tokens"]]
        busy = [r["busy_s"] for r in rows if r["prompt_tokens"]]
        cells = []
        for values in (decode, busy):
            if values:
                p10, p90 = np.percentile(values, [10, 90])
                cells += [str(len(values)), f"{statistics.median(values):.3f} "
                                            f"({p10:.2f}-{p90:.2f})"]
            else:
                cells += ["0", "-"]
        name = f"{folder.parent.name}/{folder.name}"
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.fit_bandwidth:
        folders = [run if run.is_absolute() else Path.cwd() / run for run in runs]
        workstations = [f for f in folders
                        if cost_model_of(f, overrides).hardware.board == "workstation"]
        fitted = {f: fitted_bandwidth_efficiency(f, overrides) for f in workstations}
        for folder, value in fitted.items():
            others = [v for f, v in fitted.items() if f is not folder]
            line = f"{folder.parent.name}/{folder.name}: workstation_bandwidth_efficiency {value:.3f}"
            if others:
                held = cost_model_of(folder, {**overrides,
                                              "workstation_bandwidth_efficiency": np.mean(others)})
                ratios = [r["model_step_ms"] / r["real_step_ms"]
                          for r in seconds(folder, held) if not r["prompt_tokens"]]
                line += (f"; with the others' {np.mean(others):.3f} its decode steps come out "
                         f"{100 * (statistics.median(ratios) - 1):+.1f} % (median)")
            print(line)
    if args.fit_compute:
        for folder in (run if run.is_absolute() else Path.cwd() / run for run in runs):
            window = saturated_prefill(folder)
            name = f"{folder.parent.name}/{folder.name}"
            reason = uncomputed_prompts(folder)
            if reason is not None and not args.count_cached_prompts:
                print(f"{name}: compute_efficiency not measurable: {reason} (--count-cached-"
                      f"prompts measures it anyway, as an upper bound)")
                continue
            if window is None:
                print(f"{name}: no saturated opening (prompts never queued {MIN_SATURATED_S:g} s "
                      "before KV pressure or max_num_seqs running)")
                continue
            print(f"{name}: saturated opening {window['seconds']:.2f} s, "
                  f"{window['prompt_tokens'] / window['seconds']:,.0f} prompt tokens/s computed "
                  f"({window['cached_prompt_tokens']:,} more from the prefix cache) beside "
                  f"{window['decodes']:.0f} decodes; compute_efficiency "
                  f"{fitted_compute_efficiency(folder, overrides):.3f}")


if __name__ == "__main__":
    main()
