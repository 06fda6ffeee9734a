"""`python -m calibration.profiler`: the same as `twinserve-profile`."""
from calibration.profiler.cli import main

raise SystemExit(main())
