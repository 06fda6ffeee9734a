"""A shared CPU machine's timing noise: a probe's speed factor, by which the profiler's samples
and an engine run's steps are timed at one machine speed (speed: the probe and the normalising
executor; engine_timing: the probes built on the engine's model)."""
