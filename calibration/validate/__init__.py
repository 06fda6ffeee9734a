"""`twinserve-validate`: run one workload on the engine and on the profiled simulator, and compare.

One module per job, each readable alone:

- compare:            the compared metrics, signed errors, gates (pure functions on summaries)
- configs:            the engine's and the simulator's configs, composed from conf/ alike
- profile_conditions: running the engine as the profile was measured (threads, machine speed)
- run:                one validation: both backends, validation.json/.md and the CDF plot
- sweep:              a Hydra sweep's overrides expanded into the grid's jobs
- grid:               every job of a sweep validated, with one table for the grid
- report:             the rich table, the markdown report and the CDF plot
- cli:                the command line (`python -m calibration.validate`)
"""
