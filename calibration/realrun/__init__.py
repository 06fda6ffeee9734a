"""`twinserve-validate --real`: replay serving runs someone measured through the simulator and
compare them per load stage. One module per job:

- run:           RealRun (a measured run in memory), make_run (checks, order), RealRunError
- readers:       the formats: LLMServingSim JSONL, vllm bench serve / twinserve-bench JSON, CSV
- settings:      the run's engine settings as simulator overrides (the command line wins)
- stages:        load stages: labelled, or change points of the arrival rate
- stage_metrics: per-stage TTFT/TPOT/E2E and throughput, overload, the comparison
- replay:        the run through the simulator (`replay(run, overrides) -> dict`)
- report:        tables, validation.md, cdfs.png
- cli:           `validate_real`, behind twinserve-validate --real
"""
