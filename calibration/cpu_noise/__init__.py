"""The optional layer of the profiled cost model for a shared CPU machine's timing noise and the
torch CPU kernels, applied only where a profile asks for it.

- speed: a probe's speed factor, by which the profiler's samples and an engine run's steps are
  timed at one machine speed (a profile's `speed_reference`, `backend.speed_reference`).
- local_correction: a kernel-weighted factor on the linear fit near its grid points (a
  profile's `correction`).
- tile_features: the attention tiles the torch CPU kernels pad a step to (attention-tile names
  in a profile's `features`, their tiling in `metadata.attention_tiling`).
"""
