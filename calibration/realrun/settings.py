"""A measured run's engine settings as simulator overrides, the command line's winning
(docs/calibration.md lists the mapping). A run of twinserve's own CPU engine replays on its
shipped profile; a vLLM >= 0.10 run that does not record chunked prefill or prefix caching had
them (V1's defaults). Model and hardware are required; any other setting left out keeps the
simulator's default, and the report says which."""
from __future__ import annotations

import re
from functools import lru_cache

import yaml

from calibration.realrun.run import RealRunError
from sim.cost.experts import EP_KEY
from runtime.policy_config import CONF_DIR

REQUIRED = ("model", "hardware")
# setting -> the override key it sets (the scheduler group and model/hardware are special).
FIELD_KEYS = {
    "tensor_parallel_size": "cluster.tensor_parallel_size",
    "data_parallel_size": "cluster.num_replicas",
    "max_num_seqs": "scheduler.max_num_seqs",
    "max_num_batched_tokens": "scheduler.max_num_batched_tokens",
    "block_size": "kv_cache.block_size",
    "num_gpu_blocks": "kv_cache.num_blocks",
    "enable_prefix_caching": "kv_cache.enable_prefix_caching",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "watermark": "kv_cache.watermark",
}
# The V1 engine (the only one from vLLM 0.10) schedules chunked prefill by default.
V1_ONLY_VERSION = (0, 10)
# Other V1 defaults a run may leave unrecorded. V1 admits a request when its blocks are free,
# keeping none back (V0 kept 1 %, as conf/kv_cache/paged.yaml does; `--watermark`, default 0,
# came in 2026).
V1_DEFAULTS = {"enable_prefix_caching": True, "watermark": 0.0}
# Suffixes of fine-tuned variants that keep the base model's shape (after a release date).
VARIANT_SUFFIXES = ("-instruct", "-chat", "-hf", "-it")


@lru_cache(maxsize=None)
def _conf_group(group: str) -> tuple[tuple[str, dict], ...]:
    return tuple((path.stem, yaml.safe_load(path.read_text()) or {})
                 for path in sorted((CONF_DIR / group).glob("*.yaml")))


def _strip_variant(name: str) -> str:
    name = re.sub(r"-\d{4}$", "", name)   # a release date (Qwen's -2507) keeps the shape
    for suffix in VARIANT_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def match_model(hf_name: str) -> str | None:
    """`hf_name` itself when it is a conf/model name; the conf/model whose hf_repo is `hf_name` (case-insensitive), else whose repo's last
    part is the name's last part (a local path), also with -Instruct/-Chat/-hf/-it removed."""
    wanted = str(hf_name).strip().rstrip("/").lower()
    if wanted in {name for name, _ in _conf_group("model")}:   # a conf name (twinserve-serve's)
        return wanted
    models = [(name, str(conf.get("hf_repo", "")).lower()) for name, conf in _conf_group("model")
              if conf.get("hf_repo")]
    for name, repo in models:
        if repo == wanted:
            return name
    base = wanted.rsplit("/", 1)[-1]
    for transform in (lambda text: text, _strip_variant):
        found = [name for name, repo in models
                 if transform(repo.rsplit("/", 1)[-1]) == transform(base)]
        if len(found) == 1:
            return found[0]
    return None


def _words(text: str) -> list[str]:
    return [word for word in re.split(r"[^a-z0-9]+", text.lower()) if word]


def match_hardware(device_name: str, memory_bytes: float | None = None) -> str | None:
    """`device_name` itself when it is a conf/hardware name, else the entry whose name's words
    all appear in it (or whose name without separators does, "RTX4090"); among several, the
    nearest in memory to `memory_bytes`."""
    if str(device_name).strip().lower() in {name for name, _ in _conf_group("hardware")}:
        return str(device_name).strip().lower()   # a conf name (twinserve-serve's, "cpu" too)
    words = _words(device_name)
    squashed = "".join(words)
    device_memory = {word for word in words if re.fullmatch(r"\d+gb", word)}
    found = []
    for name, conf in _conf_group("hardware"):
        if name == "cpu":
            continue
        parts = _words(name)
        memory = {word for word in parts if re.fullmatch(r"\d+gb", word)}
        chip = [word for word in parts if word not in memory]
        if memory and device_memory and not memory & device_memory:
            continue
        if all(word in words for word in chip) or "".join(chip) in squashed:
            found.append((name, float(conf.get("memory_gb", 0))))
    if len(found) > 1 and memory_bytes:
        gib = float(memory_bytes) / 2**30
        found = [min(found, key=lambda item: abs(item[1] - gib))]
    return found[0][0] if len(found) == 1 else None


def _version(text) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", str(text))[:2])


def v1_default_overrides() -> list[str]:
    """V1_DEFAULTS as overrides, for a replay that records no engine settings."""
    return [f"{FIELD_KEYS[setting]}={str(value).lower()}" for setting, value in V1_DEFAULTS.items()]


def is_v1(settings: dict) -> bool:
    """Whether the run records a vLLM version with the V1 engine only (>= 0.10), whose defaults
    (V1_DEFAULTS, chunked prefill) hold for what it leaves unrecorded."""
    return "vllm_version" in settings and _version(settings["vllm_version"]) >= V1_ONLY_VERSION


def add_engine_profile(settings: dict, given: set[str], user_cost_model: str | None,
                       overrides: list[str], provenance: dict[str, dict]) -> None:
    """A run of twinserve's own engine on a CPU replays on that engine's shipped profile of its
    model unless the command line gives another cost model or profile."""
    if (settings.get("engine") != "twinserve" or "cost_model.profile" in given
            or (user_cost_model or "profiled") != "profiled"
            or str(settings.get("hardware", "")).lower() != "cpu"
            or match_model(settings.get("model", "")) is None):
        return
    model = match_model(settings["model"])
    profile = f"profiles/cpu/{model}.json"
    if not (CONF_DIR.parent / profile).is_file():
        provenance["cost_model"] = {
            "value": None, "override": None,
            "source": f"no {profile} for twinserve's CPU engine: the default cost model (the "
                      f"roofline, uncalibrated) replays it; profile the engine (twinserve-profile "
                      f"--model {model}) and give cost_model=profiled cost_model.profile=PATH"}
        return
    chosen = [*([] if user_cost_model else ["cost_model=profiled"]),
              f"cost_model.profile={profile}"]
    overrides.extend(chosen)
    provenance["cost_model"] = {"value": "profiled", "override": " ".join(chosen),
                                "source": "file: engine twinserve on cpu, its shipped profile"}


def override_key(override: str) -> str:
    """The config key an override sets: 'scheduler.max_num_seqs=8' -> 'scheduler.max_num_seqs'."""
    return override.split("=", 1)[0].lstrip("+~").strip()


def settings_overrides(settings: dict, user_overrides: list[str],
                       where: str) -> tuple[list[str], dict[str, dict]]:
    """(overrides for the replay, provenance {setting: {"value", "override", "source"}}): the
    file's settings as overrides, leaving out any whose key the command line sets (it wins).
    Raises RealRunError naming a required setting that neither gives, or a name that no conf
    matches."""
    given = {override_key(override) for override in user_overrides}
    overrides: list[str] = []
    provenance: dict[str, dict] = {}

    def add(setting: str, key: str, value, override: str, source: str) -> None:
        if key in given:
            provenance[setting] = {"value": value, "override": None,
                                   "source": "command line (the file's value ignored)"}
            return
        overrides.append(override)
        provenance[setting] = {"value": value, "override": override, "source": source}

    for setting in REQUIRED:
        value = settings.get(setting)
        if value is None:
            if setting not in given:
                choices = ", ".join(name for name, _ in _conf_group(setting) if name != "cpu")
                raise RealRunError(f"{where}: the run does not record the {setting}; give it on "
                                   f"the command line: {setting}=<one of {choices}>")
            provenance[setting] = {"value": None, "override": None, "source": "command line"}
            continue
        if setting in given:
            add(setting, setting, value, "", "")
            continue
        conf = (match_model(value) if setting == "model"
                else match_hardware(value, settings.get("device_memory_bytes")))
        if conf is None:
            what = "hf_repo" if setting == "model" else "name"
            raise RealRunError(f"{where}: {setting} {value!r} matches no conf/{setting} {what}; "
                               f"give it on the command line: {setting}=<name>")
        add(setting, setting, value, f"{setting}={conf}", f"file: {value}")

    user_cost_model = next((override.split("=", 1)[1].strip() for override in user_overrides
                            if override_key(override) == "cost_model"), None)
    add_engine_profile(settings, given, user_cost_model, overrides, provenance)
    chunked = settings.get("enable_chunked_prefill")
    chunked_source = "file"
    if chunked is None and is_v1(settings):
        chunked, chunked_source = True, f"vLLM {settings['vllm_version']} (V1) default"
    if chunked is not None:
        scheduler = "chunked_prefill" if chunked else "continuous"
        add("enable_chunked_prefill", "scheduler", chunked, f"scheduler={scheduler}",
            chunked_source if chunked_source != "file" else f"file: {chunked}")
    v1_default = is_v1(settings)
    if settings.get("enable_expert_parallel"):
        ep = (int(settings.get("tensor_parallel_size") or 1)
              * int(settings.get("data_parallel_size") or 1))
        add("enable_expert_parallel", EP_KEY, True, f"{EP_KEY}={ep}",
            "file: true (tensor x data parallel size)")
    for setting, key in FIELD_KEYS.items():
        value = settings.get(setting)
        if value is None and setting in V1_DEFAULTS and v1_default:
            value = V1_DEFAULTS[setting]
            text = str(value).lower() if isinstance(value, bool) else str(value)
            add(setting, key, value, f"{key}={text}",
                f"vLLM {settings['vllm_version']} (V1) default")
            continue
        if value is None:
            continue
        text = str(value).lower() if isinstance(value, bool) else str(value)
        add(setting, key, value, f"{key}={text}", f"file: {value}")
    return overrides, provenance
