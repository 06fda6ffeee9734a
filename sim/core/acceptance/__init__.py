"""The simulator's acceptance model: how many of a sequence's k draft tokens the target accepts.

`sampling` draws the counts (`AcceptanceModel`: per draft position, in runs of acceptable drafts,
or walking a fixed token tree); `fitting` turns an engine's acceptance statistics file into the
rates and per-text shifts those draws use. docs/calibration.md has the measurements behind the
model and the variants tried and dropped.
"""
from sim.core.acceptance.fitting import (
    FRESH_KEYS, NODE_KEYS, STATISTICS_KEYS, fit_sequence_shifts)
from sim.core.acceptance.sampling import ENDLESS_RUN, AcceptanceModel

__all__ = ["ENDLESS_RUN", "FRESH_KEYS", "NODE_KEYS", "STATISTICS_KEYS", "AcceptanceModel",
           "fit_sequence_shifts"]
