"""`python -m sim.calibration.validate`: the same as `twinserve-validate`."""
import sys

from sim.calibration.validate.cli import main

sys.exit(main())
