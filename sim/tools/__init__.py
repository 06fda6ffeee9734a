"""The tools around the simulator: the Hydra app, reports, capacity search, loggers and plots."""
