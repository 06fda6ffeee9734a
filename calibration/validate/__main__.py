"""`python -m calibration.validate`: the same as `twinserve-validate`."""
import sys

from calibration.validate.cli import main

sys.exit(main())
