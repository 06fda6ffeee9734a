"""`twinserve-validate`: run one workload on the engine and on the profiled simulator, and compare.
compare: metrics, errors and gates; configs: both backends' configs; profile_conditions: the
engine run as the profile was measured; run: one validation; sweep and grid: a Hydra sweep of
validations; report: tables and plots; cli: the command line (docs/calibration.md).
"""
