"""How the sweep report (sim/tools/report.py) names things: metrics in figure titles and table
headings, override keys in legends and headings (less their config group), override values
(a policy's class path by its class name), and numbers in the table."""
from __future__ import annotations

import re
from typing import Any

METRIC_LABELS: dict[str, str] = {
    "request_throughput": "request throughput (req/s)",
    "output_throughput": "output throughput (tok/s)",
    "total_token_throughput": "total throughput (tok/s)",
    "kv_waste_fraction": "KV waste (fraction of allocated slots)",
    "peak_kv_blocks": "peak KV blocks in use",
    "num_kv_blocks": "KV blocks in the pool",
    "num_preemptions": "preemptions",
    "swap_bytes": "bytes swapped",
    "goodput": "goodput (req/s)",
    "slo_attainment": "SLO attainment",
    "energy_j": "energy (J, modelled)",
    "avg_power_w": "average power (W, modelled)",
    "joules_per_output_token": "energy per output token (J, modelled)",
    "tokens_per_joule": "output tokens per joule (modelled)",
    "peak_num_seqs": "largest batch (sequences in a step)",
    "peak_num_running": "peak running requests",
    "mean_kv_blocks_used": "mean KV blocks in use (busy time)",
    "jain_fairness": "Jain fairness (whole run)",
    "windowed_jain_fairness": "Jain fairness of backlogged tenants (mean over windows)",
    "max_backlogged_service_diff": "max service gap between backlogged tenants (tok/window)",
    "fairness_windows": "windows with two tenants backlogged",
    "mean_backlogged_service": "service per window while backlogged (tok)",
    "backlogged_windows": "windows backlogged beside another tenant",
}
LATENCY_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E latency"}
# Column headings of the terminal table, short so that it fits 80 columns.
METRIC_HEADINGS: dict[str, str] = {
    "request_throughput": "req/s", "output_throughput": "out tok/s",
    "total_token_throughput": "tok/s", "kv_waste_fraction": "KV waste",
    "peak_kv_blocks": "peak KV", "mean_kv_blocks_used": "mean KV", "peak_num_seqs": "max batch",
    "peak_num_running": "max running", "num_preemptions": "preempted", "swap_bytes": "swapped B",
    "jain_fairness": "Jain", "windowed_jain_fairness": "Jain/window",
    "max_backlogged_service_diff": "max gap tok", "fairness_windows": "windows",
    "mean_backlogged_service": "tok/window", "backlogged_windows": "windows",
    "energy_j": "J", "avg_power_w": "W", "joules_per_output_token": "J/tok",
    "tokens_per_joule": "tok/J",
}
# A group's key in a sweep's summaries: per_tenant.<name>.<key>, per_priority.<name>.<key>,
# per_pool.<name>.<key>, and the energy's energy_per_replica.<id>.<key>, energy_per_pool.<...>.
GROUP_KEY = re.compile(r"(?:energy_)?per_(tenant|priority|replica|pool)\.([^.]+)\.(.+)")
# A policy named by its class (`scheduler._target_=my_policies.ShortestPromptFirst`,
# `cluster.router=my_policies.FewestOutstandingRouter`): a dotted path ending in a class name.
CLASS_PATH = re.compile(r"(?:[A-Za-z_]\w*\.)+([A-Z]\w*)")
TARGET_SUFFIX = "._target_"
# A latency statistic: mean_ttft_ms, p99_itl_ms, ...
LATENCY_KEY = re.compile(r"(mean|median|p90|p99)_(ttft|tpot|itl|e2el)_ms")


def short_names(keys: list[str]) -> dict[str, str]:
    """Each key less its config group (`kv_cache.block_size` -> `block_size`, `scheduler._target_`
    -> `scheduler`) where that stays unambiguous, for legends and headings."""
    shortened = {key: key.removesuffix(TARGET_SUFFIX) if key.endswith(TARGET_SUFFIX)
                 else key.split(".", 1)[1] if "." in key else key for key in keys}
    counts: dict[str, int] = {}
    for name in [*shortened.values(), *(key for key in keys if "." in key)]:
        counts[name] = counts.get(name, 0) + 1
    return {key: name if counts[name] == 1 else key for key, name in shortened.items()}


def value_texts(overrides: list[dict[str, str]], keys: list[str]) -> dict[str, dict[str, str]]:
    """Per key, each of its values (as written in the overrides) as legends and tables show it:
    a class path by its class name, unless two of the key's values share that name."""
    texts = {}
    for key in keys:
        values = list(dict.fromkeys(job[key] for job in overrides if key in job))
        names = {value: (match[1] if (match := CLASS_PATH.fullmatch(value)) else value)
                 for value in values}
        shared = len(set(names.values())) < len(names)
        texts[key] = {value: value if shared else name for value, name in names.items()}
    return texts


def policy_label(overrides: dict[str, str], policy_keys: list[str],
                 texts: dict[str, dict[str, str]]) -> str:
    """`scheduler=static, block_size=16`: the job's values of the other varying keys, each as
    `texts` (value_texts) shows it."""
    if not policy_keys:
        return "all jobs"
    names = short_names(policy_keys)
    return ", ".join(f"{names[key]}={texts[key].get(overrides[key], overrides[key])}"
                     if key in overrides else f"{names[key]}=(unset)" for key in policy_keys)


def metric_label(key: str) -> str:
    if key in METRIC_LABELS:
        return METRIC_LABELS[key]
    group = GROUP_KEY.fullmatch(key)
    if group:
        return f"{metric_label(group[3])}, {group[1]} {group[2]}"
    match = LATENCY_KEY.fullmatch(key)
    if match:
        return f"{match[1]} {LATENCY_NAMES[match[2]]} (ms)"
    return key


def metric_heading(key: str) -> str:
    group = GROUP_KEY.fullmatch(key)
    if group:   # (a replica by its kind and id: "0 tok/J" would say nothing)
        name = f"replica {group[2]}" if group[1] == "replica" else group[2]
        return f"{name} {metric_heading(group[3])}"
    match = LATENCY_KEY.fullmatch(key)
    if match:
        return f"{match[1]} {match[2].upper()} ms"
    return METRIC_HEADINGS.get(key, key)


def format_value(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if abs(value) < 1:
            return f"{value:.4f}"
        return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)
