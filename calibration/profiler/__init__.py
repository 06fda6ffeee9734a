"""twinserve-profile, by job: the designed grid of step shapes and its timing runs (grid), the
linear fit with its local correction (fit), reading and writing profiles and the command line
(cli)."""
