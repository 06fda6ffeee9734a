"""Running the engine as its profile was measured: the profile's torch thread count and, with a
speed reference, step durations normalised to the profile's machine speed, since a shared CPU's
speed drifts by tens of % over minutes, which no cost model can predict."""
from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from calibration.cpu_noise.speed import PREFILL_PROBE_POINTS


def match_profile_conditions(profile_path: str, engine_cfg, normalize_speed: bool,
                             console: Console) -> dict:
    """Run the engine (engine_cfg) as the profile was measured: the profile's thread count and,
    with normalize_speed, its machine speed (else a warning and the wall clock); warns when the
    torch version differs. Returns what was set."""
    import torch
    from omegaconf import open_dict

    profile = json.loads(Path(profile_path).read_text())
    metadata = profile.get("metadata") or {}
    conditions: dict = {"torch_version": torch.__version__, "clock": "wall"}
    if metadata.get("torch_version") not in (None, torch.__version__):
        console.print(f"[yellow]warning: the profile was taken with torch "
                      f"{metadata['torch_version']}, this is {torch.__version__}[/yellow]")
    threads = metadata.get("threads")
    if metadata.get("device_type", "cpu") == "cpu" and isinstance(threads, int) and threads > 0:
        torch.set_num_threads(threads)
    conditions["threads"] = torch.get_num_threads()
    if normalize_speed:
        if "speed_reference" not in profile:
            console.print(f"[yellow]warning: {profile_path} has no speed_reference (taken "
                          f"without the speed probe): the engine's steps are timed as measured, "
                          f"drift of the machine since profiling included[/yellow]")
        else:
            with open_dict(engine_cfg):
                engine_cfg.backend.speed_reference = profile_path
            conditions["clock"] = "profile speed"
    return conditions


def engine_clock_line(conditions: dict) -> str:
    """How the engine's steps were timed, in words, for the markdown report."""
    if conditions.get("clock") != "profile speed":
        return "engine steps timed as measured (wall clock)"
    line = (f"engine steps normalised to the profile's machine speed: the machine ran "
            f"{conditions['speed_factor_median']:.3f}× the profile's step times (median of "
            f"{conditions['speed_probes']} probes; 5-95 %: {conditions['speed_factor_p05']:.3f}-"
            f"{conditions['speed_factor_p95']:.3f}×)")
    if "prefill_speed_factor_medians" in conditions:
        medians = " / ".join(f"{m:.3f}" for m in conditions["prefill_speed_factor_medians"])
        lengths = " / ".join(str(point.prefills[0][0]) for point in PREFILL_PROBE_POINTS)
        line += (f"; lone prompts of {lengths} tokens {medians}× (medians of "
                 f"{conditions['prefill_speed_probes']} prefill probes)")
    return line
