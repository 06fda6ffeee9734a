"""Leave-one-out errors of the transfer rule per kind of transfer, for linear layers and attention:
computed by this module as a script, read back by `expected_errors` (docs/gpu-cost-model.md).

    python -m sim.cost.gpu.transfer_errors          # writes data/gpu/transfer_errors.json
"""
from __future__ import annotations

import functools
import json

import numpy as np

from sim.cost.gpu.attention import attention_cost
from sim.cost.gpu.linear import nearest_op_table, predict_layer_ms
from sim.cost.gpu.tables import DATA_DIR, LAYER_OPS, attention_tables, op_tables
from sim.cost.gpu.transfer import MEASURED, TRANSFER_KINDS, transfer_kind

ERRORS_PATH = DATA_DIR / "transfer_errors.json"
SERVING_MAX_TOKENS = 4096


def _linear_errors() -> dict:
    tables = op_tables()
    per_table = []
    for target in tables:
        tokens = np.array([n for n in target.tokens if n <= SERVING_MAX_TOKENS], dtype=float)
        index = [target.tokens.index(int(n)) for n in tokens]
        measured = np.array([sum(target.op_ms[op][i] for op in LAYER_OPS) for i in index])
        for kind in TRANSFER_KINDS[1:]:
            pool = tuple(t for t in tables if t is not target and transfer_kind(
                target.hardware, t.shape == target.shape
                and t.tensor_parallel_size == target.tensor_parallel_size, t.hardware) == kind)
            if not pool:
                continue
            reference = nearest_op_table(target.hardware, target.shape,
                                         target.tensor_parallel_size, pool)
            predicted = predict_layer_ms(reference, tokens, target.hardware, target.shape,
                                         target.tensor_parallel_size, 2)
            error = np.abs(predicted - measured) / measured * 100
            per_table.append({"target": target.name, "kind": kind, "reference": reference.name,
                              "mean_pct": round(float(error.mean()), 2),
                              "max_pct": round(float(error.max()), 2)})
    by_kind = {MEASURED: round(float(np.mean([t.duplicate_spread_pct for t in tables])), 2)}
    for kind in TRANSFER_KINDS[1:]:
        errors = [row["mean_pct"] for row in per_table if row["kind"] == kind]
        by_kind[kind] = round(float(np.mean(errors)), 2)
    return by_kind, per_table


def _attention_errors() -> list[dict]:
    tables = attention_tables()
    rows = []
    for target in tables:
        others = tuple(t for t in tables if t is not target)
        cost = attention_cost(target.hardware, target.shape, target.tensor_parallel_size, 2,
                              target.backend, others)
        decode, prefill = [], []
        for row in target.rows:
            if row.is_prefill:
                seconds = (cost.prefill_fixed_s
                           + row.prefill_chunk_size * row.kv_cache_size * cost.prefill_s_per_context_pair
                           + row.prefill_chunk_size ** 2 / 2 * cost.prefill_s_per_causal_pair)
                prefill.append(abs(seconds * 1e3 - row.ms) / row.ms)
            else:
                seconds = (cost.decode_fixed_s + row.batch_size * (
                    row.kv_cache_size * cost.decode_s_per_context_token + cost.decode_s_per_seq))
                decode.append(abs(seconds * 1e3 - row.ms) / row.ms)
        rows.append({"target": target.name, "backend": target.backend, "source": cost.source,
                     "decode_mean_pct": round(100 * float(np.mean(decode)), 1),
                     "prefill_mean_pct": round(100 * float(np.mean(prefill)), 1)})
    return rows


def compute() -> dict:
    linear_by_kind, linear_per_table = _linear_errors()
    return {"linear": linear_by_kind, "linear_per_table": linear_per_table,
            "attention_per_table": _attention_errors(),
            "metric": "mean |predicted - measured| / measured (%) of one layer's kernels over the "
                      f"table's token counts <= {SERVING_MAX_TOKENS}; attention: per call"}


@functools.lru_cache(maxsize=None)
def expected_errors() -> dict:
    """The errors data/gpu/transfer_errors.json keeps (written by this module's main)."""
    with open(ERRORS_PATH) as file:
        return json.load(file)


def main() -> None:
    errors = compute()
    ERRORS_PATH.write_text(json.dumps(errors, indent=1) + "\n")
    print(f"wrote {ERRORS_PATH}")
    print("linear layers, leave-one-out mean error by kind of transfer:")
    for kind, pct in errors["linear"].items():
        print(f"  {kind:10s} {pct:6.1f} %")
    for row in errors["linear_per_table"]:
        print(f"  {row['target']:28s} {row['kind']:10s} from {row['reference']:28s} "
              f"mean {row['mean_pct']:5.1f} %  max {row['max_pct']:5.1f} %")
    print("attention, each table from the others:")
    for row in errors["attention_per_table"]:
        print(f"  {row['target']:28s} decode {row['decode_mean_pct']:5.1f} %  prefill "
              f"{row['prefill_mean_pct']:5.1f} %  ({row['source']})")


if __name__ == "__main__":
    main()
