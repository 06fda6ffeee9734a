"""What a run records on the hot path of both backends: one row per step and each replica's
inter-token latencies as a histogram (`StepRecorder`, per replica), held and read back for the
whole run by `MetricsCollector`."""
from __future__ import annotations

import array
import bisect
import itertools
import math
import operator

from collections.abc import Callable
from typing import Protocol

import numpy as np

from policies.protocols import Scheduler
from policies.types import Request, Sequence, StepPlan, StepResult
from runtime.metrics.statistics import histogram_stats_ms
from runtime.metrics.streaming import QuantileSketch
from runtime.metrics.summary import DEFAULT_FAIRNESS_WINDOW_S, run_summary



class StepEnergy(Protocol):
    """What the recorder charges each step's joules to (the simulator's sim/core/energy/meter.py)."""

    def add_step(self, plan: StepPlan, duration: float) -> None: ...

    def add_repeated_steps(self, plan: StepPlan, durations) -> None: ...

STEP_COLUMNS: tuple[str, ...] = (
    "replica_id", "start_time", "duration",
    "num_seqs", "num_prefill_seqs", "num_prefill_tokens", "num_decode_seqs", "num_batched_tokens",
    "kv_blocks_used", "kv_slots_allocated", "kv_tokens_stored",
    "num_waiting", "num_running", "num_swapped",
    "num_preempted_recompute", "num_preempted_swap",
    "num_blocks_swapped_out", "num_blocks_swapped_in", "num_blocks_copied",
    "num_draft_tokens", "num_accepted_tokens",
    "num_blocks_offloaded", "num_blocks_loaded",
)

_COL = {name: index for index, name in enumerate(STEP_COLUMNS)}
# A streamed run keeps its newest rows when it spills, since a step in flight still amends them.
SPILL_AT_ROWS = 1 << 17
SPILL_KEEP_ROWS = 1 << 16
STREAMED_LOGGED_ITLS = 1 << 16
# record_repeated_steps sets these by position: the memory columns stand side by side.
_DURATION, _BLOCKS, _TOKENS = _COL["duration"], _COL["kv_blocks_used"], _COL["kv_tokens_stored"]
_START_TIME = operator.itemgetter(_COL["start_time"])


class MetricsCollector:
    """Every replica's step rows and ITL histograms for a run, and its summary."""

    def __init__(self, kv_bytes_per_block: int = 0, streamed: bool = False):
        self.kv_bytes_per_block = kv_bytes_per_block
        self.replica_labels: dict[int, str] = {}
        self.step_rows: list[tuple] = []
        self.itl_counts: dict[float, int] = {}
        # A long run streams: rows are folded and written out as they pile up, and latencies
        # go into a sketch, so memory stays bounded.
        self.streamed = streamed
        self.itl_sketch = QuantileSketch() if streamed else None
        self.write_step_rows: Callable[[list[tuple]], None] | None = None
        self.num_spilled_rows = 0
        self._spilled_totals = np.zeros(len(STEP_COLUMNS), dtype=np.float64)
        self._spilled_peaks = np.zeros(len(STEP_COLUMNS), dtype=np.float64)
        self._spilled_waste: list[float] = []   # each spilled chunk's fsum of its steps' waste
        self._spilled_waste_steps = 0

    @property
    def num_steps(self) -> int:
        """Steps recorded so far, spilled ones included: the index the next row will have."""
        return self.num_spilled_rows + len(self.step_rows)

    def set_step_duration(self, index: int, duration: float) -> None:
        """Set the duration of step `index` (counted from the run's first), recorded before it
        ended (a pipelined replica's step, whose row is the replica as the step began)."""
        held = self._held_index(index)
        row = list(self.step_rows[held])
        row[_DURATION] = duration
        self.step_rows[held] = tuple(row)

    def _held_index(self, index: int) -> int:
        held = index - self.num_spilled_rows
        if held < 0:
            raise RuntimeError(f"step row {index} was already spilled (a step in flight over "
                               f"more than {len(self.step_rows)} later rows)")
        return held

    def spill_steps_if_many(self) -> None:
        """spill_steps once SPILL_AT_ROWS rows are held (called as requests finish)."""
        if len(self.step_rows) >= SPILL_AT_ROWS:
            self.spill_steps()

    def spill_steps(self, keep: int | None = None) -> None:
        """Fold all but the newest `keep` held rows into the totals, write them out, drop them."""
        num_rows = len(self.step_rows) - (SPILL_KEEP_ROWS if keep is None else keep)
        if num_rows <= 0:
            return
        rows = self.step_rows[:num_rows]
        del self.step_rows[:num_rows]
        self.num_spilled_rows += num_rows
        if self.write_step_rows is not None:
            self.write_step_rows(rows)
        steps = np.asarray(rows, dtype=np.float64)
        self._spilled_totals += steps.sum(axis=0)
        np.maximum(self._spilled_peaks, steps.max(axis=0), out=self._spilled_peaks)
        waste = _waste(steps[:, _COL["kv_slots_allocated"]], steps[:, _COL["kv_tokens_stored"]])
        self._spilled_waste.append(math.fsum(waste))
        self._spilled_waste_steps += waste.size

    def record_step(self, replica_id: int, start_time: float, plan: StepPlan, duration: float, *,
                    kv_blocks_used: int, kv_slots_allocated: int, kv_tokens_stored: int,
                    num_waiting: int, num_running: int, num_swapped: int,
                    num_accepted_tokens: int = 0) -> None:
        """Append one row; it runs every step of every replica, so all analysis waits for
        summary()."""
        self.step_rows.append((
            replica_id, start_time, duration,
            len(plan.seqs), plan.num_prefill_seqs, plan.num_prefill_tokens, plan.num_decode_seqs,
            plan.num_prefill_tokens + plan.num_decode_seqs + plan.num_draft_tokens,
            kv_blocks_used, kv_slots_allocated, kv_tokens_stored,
            num_waiting, num_running, num_swapped,
            len(plan.preempted_recompute), len(plan.preempted_swap),
            len(plan.blocks_to_swap_out), len(plan.blocks_to_swap_in), len(plan.blocks_to_copy),
            plan.num_draft_tokens, num_accepted_tokens,
            len(plan.blocks_to_offload), len(plan.blocks_to_load),
        ))

    def add_itl_counts(self, itl_counts: dict[float, int]) -> None:
        """Merge one scheduler's ITL histogram {seconds: number of tokens}."""
        if self.itl_sketch is not None:
            self.itl_sketch.add(np.fromiter(itl_counts.keys(), np.float64, len(itl_counts)),
                                np.fromiter(itl_counts.values(), np.int64, len(itl_counts)))
            return
        merged = self.itl_counts
        if not merged:
            merged.update(itl_counts)   # the first (or only) replica's: in one C call
            return
        for itl, count in itl_counts.items():
            merged[itl] = merged.get(itl, 0) + count

    def step_totals(self) -> dict[str, int]:
        """Each STEP_COLUMNS count summed over every recorded step."""
        totals = self.step_array().sum(axis=0)
        return {name: int(totals[index]) for name, index in _COL.items()}

    def order_steps_by_start(self) -> None:
        """Sort the rows by start time, since a replica records repeated steps ahead of other
        replicas' steps in between."""
        self.step_rows.sort(key=operator.itemgetter(1))

    def step_array(self) -> np.ndarray:
        """The step rows as a (num_steps, len(STEP_COLUMNS)) float array."""
        if not self.step_rows:
            return np.empty((0, len(STEP_COLUMNS)), dtype=np.float64)
        return np.asarray(self.step_rows, dtype=np.float64)

    def step_column(self, name: str) -> np.ndarray:
        """One of STEP_COLUMNS over the steps, as a float array."""
        index = _COL[name]
        return np.fromiter(map(operator.itemgetter(index), self.step_rows), dtype=np.float64,
                           count=len(self.step_rows))

    def step_column_total(self, name: str) -> int:
        """The integer sum of one of STEP_COLUMNS' counts over the steps."""
        return (int(self._spilled_totals[_COL[name]])
                + int(sum(map(operator.itemgetter(_COL[name]), self.step_rows))))

    def step_column_peak(self, name: str) -> int:
        """The largest of one of STEP_COLUMNS' counts over the steps; 0 without steps."""
        held = max(map(operator.itemgetter(_COL[name]), self.step_rows), default=0)
        return int(max(held, self._spilled_peaks[_COL[name]]))

    def kv_waste_fraction(self) -> float:
        """The mean share of allocated KV slots storing no token; fsum, so replica order does
        not change it."""
        waste = _waste(self.step_column("kv_slots_allocated"), self.step_column("kv_tokens_stored"))
        num_steps = waste.size + self._spilled_waste_steps
        if not num_steps:
            return 0.0
        if not self._spilled_waste:
            return math.fsum(waste) / num_steps
        return math.fsum([*self._spilled_waste, *waste.tolist()]) / num_steps

    def itl_stats_ms(self) -> dict[str, float]:
        """mean/median/p90/p99 of the inter-token latencies in ms (streamed: from the sketch)."""
        if self.itl_sketch is not None:
            return self.itl_sketch.stats_ms("itl")
        return histogram_stats_ms(self.itl_counts, "itl")

    def summary(self, requests: list[Request], wall_time_s: float,
                slos_ms: dict[str, float] | None = None,
                fairness_window_s: float = DEFAULT_FAIRNESS_WINDOW_S) -> dict:
        """The run's headline numbers (summary.py's run_summary)."""
        return run_summary(self, requests, wall_time_s, slos_ms, fairness_window_s)


def _waste(allocated: np.ndarray, stored: np.ndarray) -> np.ndarray:
    """Each step's share of its allocated KV slots storing no token (steps with slots)."""
    has_slots = allocated > 0
    return 1.0 - stored[has_slots] / allocated[has_slots]


class StepRecorder:
    """One replica's step rows and inter-token latencies, as a histogram {seconds: tokens} since
    a float per token is too much memory for a long run.

    Latencies are logged in arrays and counted into the histogram only when read or when the log
    grows long, since a dict update per repeated step cost more than the rest of its row."""

    MAX_LOGGED_ITLS = 1 << 22

    def __init__(self, metrics: MetricsCollector, replica_id: int = 0,
                 energy: StepEnergy | None = None):
        self.metrics = metrics
        self.replica_id = replica_id
        self.energy = energy
        self._itl_counts: dict[float, int] = {}
        self._logged_itls = array.array("d")
        self._logged_tokens = array.array("q")
        self.max_logged_itls = (STREAMED_LOGGED_ITLS if metrics.itl_sketch is not None
                                else self.MAX_LOGGED_ITLS)

    @property
    def itl_counts(self) -> dict[float, int]:
        """{seconds: tokens} of the latencies so far, in the order they first arose."""
        if self._logged_itls:
            self._count_logged_itls()
        return self._itl_counts

    def _count_logged_itls(self) -> None:
        """Add the logged pairs to the histogram as one dict update per pair, in order, would."""
        latencies = np.frombuffer(self._logged_itls, dtype=np.float64)
        tokens = np.frombuffer(self._logged_tokens, dtype=np.int64)
        if self.metrics.itl_sketch is not None:   # (a streamed run keeps no histogram)
            self.metrics.itl_sketch.add(latencies, tokens)
            self._logged_itls, self._logged_tokens = array.array("d"), array.array("q")
            return
        values, first_index, inverse = np.unique(latencies, return_index=True,
                                                 return_inverse=True)
        # bincount's float sums of integer counts are exact below 2**53 and far quicker than
        # np.add.at.
        totals = np.bincount(inverse, weights=tokens, minlength=values.size).astype(np.int64)
        order = np.argsort(first_index)   # the order a dict would have inserted them in
        new_counts = zip(values[order].tolist(), totals[order].tolist())
        if self._itl_counts:
            counts = self._itl_counts
            for latency, total in new_counts:
                counts[latency] = counts.get(latency, 0) + total
        else:
            self._itl_counts = dict(new_counts)
        self._logged_itls, self._logged_tokens = array.array("d"), array.array("q")

    def record_step(self, start_time: float, plan: StepPlan, result: StepResult,
                    scheduler: Scheduler) -> None:
        """The step's row, memory and queues as they stand before its finished requests leave."""
        self._record_row(start_time, plan, result.duration, scheduler,
                         sum(result.num_accepted.values()) if result.num_accepted else 0)
        if self.energy is not None:
            self.energy.add_step(plan, result.duration)

    def record_step_row(self, start_time: float, plan: StepPlan, duration: float,
                        scheduler: Scheduler) -> None:
        """The step's row alone (a pipelined replica charges its stages' energy itself)."""
        self._record_row(start_time, plan, duration, scheduler)

    def _record_row(self, start_time: float, plan: StepPlan, duration: float,
                    scheduler: Scheduler, num_accepted_tokens: int = 0) -> None:
        kv_cache = scheduler.kv_cache
        waiting, running, swapped = scheduler.queue_lengths()
        self.metrics.record_step(
            self.replica_id, start_time, plan, duration,
            kv_blocks_used=kv_cache.num_used_blocks(),
            kv_slots_allocated=kv_cache.num_slots_allocated(),
            kv_tokens_stored=kv_cache.num_tokens_stored(),
            num_waiting=waiting, num_running=running, num_swapped=swapped,
            num_accepted_tokens=num_accepted_tokens)

    def record_repeated_steps(self, start_time: float, plan: StepPlan, durations: list[float],
                              scheduler: Scheduler, first_step: int,
                              new_blocks: list[int]) -> None:
        """The rows of a decode batch run len(durations) times, as separate steps would record
        them: copies of the first with the start, duration and memory columns moved (the decodes
        grow into new_blocks[i] at step i; after `first_step` steps the first row adds what they
        grew into since)."""
        self._record_row(start_time, plan, durations[0], scheduler)
        if self.energy is not None:
            self.energy.add_repeated_steps(plan, durations)
        rows = self.metrics.step_rows
        row = list(rows[-1])
        block_size, num_decodes = scheduler.kv_cache.block_size, plan.num_decode_seqs
        blocks, slots, tokens = row[_BLOCKS:_TOKENS + 1]
        if first_step:
            tokens += num_decodes * first_step
            blocks += new_blocks[0]
            slots += new_blocks[0] * block_size
            row[_BLOCKS:_TOKENS + 1] = blocks, slots, tokens
            rows[-1] = tuple(row)
        # Setting fields in one list and copying it costs fewer operations than a tuple display.
        start, duration_at, blocks_at, slots_at, tokens_at = (
            _COL["start_time"], _DURATION, _BLOCKS, _COL["kv_slots_allocated"], _TOKENS)
        append = rows.append
        previous = durations[0]
        for duration, added in zip(itertools.islice(durations, 1, None),
                                   itertools.islice(new_blocks, 1, None)):
            start_time += previous
            previous = duration
            tokens += num_decodes
            if added:
                blocks += added
                slots += added * block_size
                row[blocks_at], row[slots_at] = blocks, slots
            row[start], row[duration_at], row[tokens_at] = start_time, duration, tokens
            append(tuple(row))

    def count_arrivals(self, first_row: int, num_rows: int, arrival_times: list[float]) -> None:
        """Count requests that arrived during repeated steps as waiting in the rows that started
        after them, as separate steps' rows would."""
        if not arrival_times:
            return
        metrics, column = self.metrics, _COL["num_waiting"]
        rows, first = metrics.step_rows, metrics._held_index(first_row)
        end = first + num_rows
        # The rows that started by the first arrival count none (their starts are in order).
        first = bisect.bisect_right(rows, arrival_times[0], first, end, key=_START_TIME)
        bisect_left = bisect.bisect_left
        for index in range(first, end):
            row = list(rows[index])
            row[column] += bisect_left(arrival_times, row[1])
            rows[index] = tuple(row)

    def record_repeated_itls(self, times_before: list[float], step_end_times: list[float]) -> None:
        """Inter-token latencies of a decode batch's repeated steps: in the first, each
        sequence's since its last token; in each later one, the step itself for every sequence."""
        self._add_one_token_each(times_before, step_end_times[0])
        self._logged_itls.extend(map(operator.sub, step_end_times[1:], step_end_times[:-1]))
        self._logged_tokens.extend(itertools.repeat(len(times_before), len(step_end_times) - 1))
        if len(self._logged_itls) > self.max_logged_itls:
            self._count_logged_itls()

    def _add_one_token_each(self, times_before: list[float], end: float) -> None:
        """One token per sequence, `end - its last token's time` later, logged one run per
        earlier step since hashing each sequence's time would cost more than its step."""
        log_itl, log_tokens = self._logged_itls.append, self._logged_tokens.append
        if times_before.count(times_before[0]) == len(times_before):
            log_itl(end - times_before[0])
            log_tokens(len(times_before))
            return
        for last_time, same_time in itertools.groupby(times_before):
            log_itl(end - last_time)
            log_tokens(len(list(same_time)))

    def record_itls(self, seqs: list[Sequence], outputs_before: list[int],
                    times_before: list[float], now: float) -> None:
        """Inter-token latencies of a step that ended at `now`, from the sequences'
        `num_output_tokens` and `last_token_time` before its update."""
        gained = list(map(operator.sub, [seq.num_output_tokens for seq in seqs], outputs_before))
        num_seqs = len(gained)
        if num_seqs and gained.count(1) == num_seqs and 0 not in outputs_before:
            self._add_one_token_each(times_before, now)   # most steps: one token each
        else:
            for before, num_gained, last_time in zip(outputs_before, gained, times_before):
                if before and num_gained:
                    self._logged_itls.append(now - last_time)
                    self._logged_tokens.append(num_gained)
        if len(self._logged_itls) > self.max_logged_itls:
            self._count_logged_itls()

