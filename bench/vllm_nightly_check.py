"""The simulator against vLLM's nightly benchmark rows on an A100 (aggregate checks).

Each row of data/real-runs/vllm-nightly/ is 500 ShareGPT prompts sent to vLLM 0.5.x serving
Llama-3-8B on one A100-80GB or Llama-3-70B on four, as a Poisson process at 2-16 req/s or all at
once, with its mean TTFT and TPOT. The prompts themselves were not recorded, so each row is
replayed with `--draws` length mixes of ShareGPT's shape (lognormal, the sigmas of
conf/workload/sharegpt_like.yaml), every draw rescaled to the row's own total input and output
tokens, under vLLM 0.5's defaults of the time (no chunked prefill, prefills first, 256
sequences, a token budget of the model's context). The spread over draws is printed beside
every error: it is how much the unknown prompt sample alone moves the prediction.

    python bench/vllm_nightly_check.py [--engine vllm_055] [--draws 3] [--gate 15]
        [--fit-row vllm_055_llama8B_tp1_sharegpt_qps_2
         [--fit-load-row vllm_055_llama8B_tp1_sharegpt_qps_8]] [overrides...]

With --fit-row, two terms are first fitted to that one row, each to the measurement that
determines it, and the other rows check them: the engine's per-step overhead
(cost_model.step_overhead_s: vLLM 0.5's V0 engine does not hide its CPU work behind the GPU as V1
does) to its mean TPOT, then the HTTP server's per-request latency (cluster.frontend_latency_s:
the API layer, tokenising, the RPC to the engine, the first chunk's way back) to its mean TTFT.
With --fit-load-row too, the per-sequence overhead (V0's Python work per scheduled sequence) is
fitted beside the step overhead to the two rows' mean TPOTs: a light row's few sequences a step
cannot tell the two apart.

Each row also says whether the simulation is overloaded there (twinserve-validate's call: TTFT
grows by 0.1 s or more per second of arrivals); the real rows record no per-request times.

Extra arguments are simulator overrides (e.g. `cost_model=roofline`). Exits 1 when a mean TTFT
or TPOT of a row the real system sustained is outside the gate.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import re
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
from hydra import compose, initialize_config_dir

from calibration.realrun.stage_metrics import OVERLOAD_SLOPE, ttft_slope
from calibration.term_fit import fit_terms
from sim.core.experiment import run_experiment

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data" / "real-runs" / "vllm-nightly"
MODELS = {"llama8B": "llama-3-8b", "llama70B": "llama-3-70b"}
NUM_PROMPTS = 500
# conf/workload/sharegpt_like.yaml's shape: log-space sigmas and the benchmark's length caps.
PROMPT_SIGMA, OUTPUT_SIGMA = 1.1, 0.8
MAX_PROMPT, MAX_TOTAL = 1024, 2048
# Where the overheads' search starts (seconds): a step's and a sequence's CPU work in vLLM V0.
OVERHEAD_START = {"step_overhead_s": 1e-3, "per_sequence_overhead_s": 1e-5}
TEST_NAME = re.compile(r"(?P<engine>vllm_\w+?)_(?P<model>llama\d+B)_tp(?P<tp>\d+)_sharegpt_qps_"
                       r"(?P<rate>[\d.]+|inf)$")


def nightly_rows(engine: str | None = None) -> list[dict]:
    """The Llama rows of every shipped nightly file, with the test name parsed."""
    rows = []
    for path in sorted(DATA.glob("*.json")):
        for row in json.loads(path.read_text()):
            match = TEST_NAME.match(row["Test name"])
            if match is None or (engine and match["engine"] != engine):
                continue
            rows.append({**row, "engine": match["engine"], "model": MODELS[match["model"]],
                         "tp": int(match["tp"]), "rate": float(match["rate"])})
    return rows


def scaled_lengths(rng: np.random.Generator, total: int, sigma: float, cap: np.ndarray | int,
                   count: int) -> np.ndarray:
    """`count` lognormal lengths of log-sigma `sigma`, capped, rescaled so they add up to
    `total` (within rounding)."""
    lengths = np.exp(rng.normal(0.0, sigma, count))
    for _ in range(20):   # rescaling moves some lengths over the cap: repeat until it settles
        lengths = np.clip(lengths * total / lengths.sum(), 4, cap)
    return np.maximum(np.rint(lengths), 4).astype(int)


def write_draw(path: Path, row: dict, seed: int) -> None:
    """One replayable trace for `row`: Poisson arrivals at its rate, lengths of its totals."""
    rng = np.random.default_rng([seed, int(row["rate"]) if math.isfinite(row["rate"]) else 0])
    prompts = scaled_lengths(rng, row["Total input tokens"], PROMPT_SIGMA, MAX_PROMPT,
                             NUM_PROMPTS)
    outputs = scaled_lengths(rng, row["Total output tokens"], OUTPUT_SIGMA,
                             MAX_TOTAL - prompts, NUM_PROMPTS)
    if math.isinf(row["rate"]):
        arrivals = np.zeros(NUM_PROMPTS)
    else:
        arrivals = np.cumsum(rng.exponential(1.0 / row["rate"], NUM_PROMPTS))
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["arrival_time", "prompt_len", "output_len"])
        writer.writerows(zip(arrivals.round(6).tolist(), prompts.tolist(), outputs.tolist()))


def simulate(row: dict, trace: Path, overrides: list[str]) -> dict:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose("config", overrides=[
            "progress=false", f"model={row['model']}", "hardware=a100-80gb",
            f"cluster.tensor_parallel_size={row['tp']}", "workload=trace",
            f"workload.trace_path={trace}", "scheduler=continuous",
            "scheduler.max_num_seqs=256", "scheduler.max_num_batched_tokens=8192",
            "preemption=recompute", *overrides])
    result = run_experiment(cfg, plots=False)
    requests = [request for request in result.requests if request.first_token_time is not None]
    # The replay's overload call (twinserve-validate's): TTFT growing with arrival time.
    return {**result.summary, "ttft_slope": ttft_slope(
        np.array([request.arrival_time for request in requests]),
        np.array([request.first_token_time - request.arrival_time for request in requests]))}


def error_pct(real: float, sim: float) -> float:
    return 100.0 * (sim - real) / real


def mean_metric(row: dict, metric: str, draws: int, overrides: list[str], tmp: Path) -> float:
    """`metric` of the summary of `row` replayed, averaged over `draws` length mixes."""
    values = []
    for draw in range(draws):
        trace = tmp / f"fit{draw}.csv"
        write_draw(trace, row, draw)
        values.append(simulate(row, trace, overrides)[metric])
    return statistics.mean(values)


def fit_overheads(rows: list[dict], terms: tuple[str, ...], draws: int,
                  overrides: list[str]) -> dict[str, float]:
    """The cost model's `terms` (step_overhead_s, per_sequence_overhead_s) at which `rows`' mean
    TPOTs come out right: a decode step's duration is what they set, and TPOT measures it."""
    with tempfile.TemporaryDirectory() as tmp:
        def loss(values: dict[str, float]) -> float:
            set_terms = [f"cost_model.{term}={value!r}" for term, value in values.items()]
            return statistics.mean(
                math.log(mean_metric(row, "mean_tpot_ms", draws, [*overrides, *set_terms],
                                     Path(tmp)) / row["Mean TPOT (ms)"]) ** 2 for row in rows)

        fitted, _ = fit_terms(loss, {term: OVERHEAD_START[term] for term in terms},
                              {term: (1e-7, 0.05) for term in terms},
                              passes=1 if len(terms) == 1 else 4, tolerance=0.01)
    return fitted


def fit_frontend_latency(row: dict, draws: int, overrides: list[str]) -> float:
    """The cluster.frontend_latency_s at which `row`'s mean TTFT comes out right: the real mean
    TTFT less the simulated one without it (the latency shifts every request's TTFT by itself
    and moves nothing else, so no search is needed); 0 when the simulation is already slower."""
    with tempfile.TemporaryDirectory() as tmp:
        sim = mean_metric(row, "mean_ttft_ms", draws,
                          [*overrides, "cluster.frontend_latency_s=0.0"], Path(tmp))
    return max(0.0, (row["Mean TTFT (ms)"] - sim) / 1e3)


def check_row(row: dict, draws: int, overrides: list[str], gate: float,
              tmp: Path) -> tuple[list[str], list[str]]:
    """`row` replayed `draws` times: its table cells (real, simulated with the draws' spread and
    error of mean TTFT and TPOT; the replay's overload call) and its errors outside `gate` %
    (a row the real system sustained only: the all-at-once rows are reported, not gated)."""
    ttfts, tpots, slopes = [], [], []
    for draw in range(draws):
        trace = tmp / f"draw{draw}.csv"
        write_draw(trace, row, draw)
        summary = simulate(row, trace, overrides)
        ttfts.append(summary["mean_ttft_ms"])
        tpots.append(summary["mean_tpot_ms"])
        slopes.append(summary["ttft_slope"])
    cells, failures = [], []
    for name, real, sims in (("TTFT", row["Mean TTFT (ms)"], ttfts),
                             ("TPOT", row["Mean TPOT (ms)"], tpots)):
        sim = statistics.mean(sims)
        spread = 100 * (max(sims) - min(sims)) / 2 / sim
        error = error_pct(real, sim)
        cells += [f"{real:.1f}", f"{sim:.1f} (±{spread:.1f} %)", f"{error:+.1f} %"]
        if math.isfinite(row["rate"]) and abs(error) > gate:
            failures.append(f"{row['Test name']} {name} {error:+.1f} %")
    slope = statistics.mean(slopes)
    verdict = "yes" if slope >= OVERLOAD_SLOPE else "no"
    # (+ 0.0: a slope that rounds to -0 prints as 0.00)
    cells.append("n/a (all at once)" if math.isinf(row["rate"]) else
                 f"{verdict} ({round(slope, 2) + 0.0:.2f} s/s)")
    return cells, failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", default="vllm_055", help="rows of this engine version")
    parser.add_argument("--draws", type=int, default=3, help="length mixes per row")
    parser.add_argument("--gate", type=float, default=15.0, help="|error| %% of mean TTFT/TPOT")
    parser.add_argument("--fit-row", default=None, metavar="TEST_NAME",
                        help="first fit step_overhead_s to this row's mean TPOT (the engine "
                             "version's per-step work), then frontend_latency_s to its mean "
                             "TTFT (the HTTP server's per-request latency), and check every "
                             "other row with them")
    parser.add_argument("--fit-load-row", default=None, metavar="TEST_NAME",
                        help="with --fit-row: also fit per_sequence_overhead_s, both overheads "
                             "to the two rows' mean TPOTs (a loaded row's batch is what tells "
                             "a sequence's CPU work from a step's)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if args.fit_load_row is not None and args.fit_row is None:
        parser.error("--fit-load-row needs --fit-row (the light row the other terms come from)")
    rows = nightly_rows(args.engine)
    if not rows:
        parser.error(f"--engine {args.engine}: no such rows in {DATA}")
    if args.fit_row is not None:
        def find_row(name: str) -> dict | None:
            return next((row for row in rows if row["Test name"] == name), None)

        fit_row = find_row(args.fit_row)
        if fit_row is None:
            parser.error(f"--fit-row {args.fit_row}: no such row of --engine {args.engine}")
        fit_rows, terms = [fit_row], ("step_overhead_s",)
        if args.fit_load_row is not None:
            load_row = find_row(args.fit_load_row)
            if load_row is None or load_row is fit_row:
                parser.error(f"--fit-load-row {args.fit_load_row}: no such row of --engine "
                             f"{args.engine} other than --fit-row")
            fit_rows, terms = [fit_row, load_row], ("step_overhead_s", "per_sequence_overhead_s")
        overheads = fit_overheads(fit_rows, terms, args.draws, args.overrides)
        args.overrides = [*args.overrides,
                          *(f"cost_model.{term}={value!r}" for term, value in overheads.items())]
        frontend_latency_s = fit_frontend_latency(fit_row, args.draws, args.overrides)
        args.overrides = [*args.overrides, f"cluster.frontend_latency_s={frontend_latency_s!r}"]
        names = " and ".join(row["Test name"] for row in fit_rows)
        print(f"fitted to {names}'s mean TPOT: " + ", ".join(
            f"{term} {1e3 * value:.3g} ms" for term, value in overheads.items())
            + f"; to {args.fit_row}'s mean TTFT: frontend_latency_s "
              f"{1e3 * frontend_latency_s:.1f} ms; the other rows are the check")
        rows = [row for row in rows if all(row is not fitted for fitted in fit_rows)]
    print(f"| row | real TTFT ms | sim TTFT ms (draws' spread) | error | real TPOT ms | "
          f"sim TPOT ms (spread) | error | sim overloaded (TTFT slope) |\n"
          f"|---|---|---|---|---|---|---|---|")
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        for row in rows:
            cells, row_failures = check_row(row, args.draws, args.overrides, args.gate, Path(tmp))
            failures += row_failures
            print(f"| {row['Test name']} | " + " | ".join(cells) + " |", flush=True)
    if failures:
        print(f"outside ±{args.gate:g} %: " + "; ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
