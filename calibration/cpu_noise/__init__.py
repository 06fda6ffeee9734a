"""A shared CPU machine's timing noise: a probe's speed factor, by which the profiler's samples
and an engine run's steps are timed at one machine speed (a profile's `speed_reference`,
`backend.speed_reference`).

- speed: the probe, the profile's speed reference and the executor that normalises by it.
- engine_timing: the probes built on the engine's model, and the engine's step-timing hook.

The cost model's own CPU layer (attention-tile features, local correction) is sim/cost/profiled/'s.
"""
