"""`twinserve-validate --real`: replay serving runs someone measured through the simulator and
compare them per load stage (docs/calibration.md, "Real runs"). run: the measured run in memory;
readers: its file formats; settings: its engine settings as overrides; stages: its load stages;
stage_metrics: per-stage metrics; replay: the simulator run; report: tables and plots; cli: the
command."""
