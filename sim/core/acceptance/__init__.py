"""The simulator's acceptance model: how many of a sequence's k draft tokens the target accepts
(`sampling` draws, `fitting` reads an engine's statistics file); docs/calibration.md has the
measurements behind it."""
from sim.core.acceptance.fitting import (
    FRESH_KEYS, NODE_KEYS, STATISTICS_KEYS, fit_sequence_shifts)
from sim.core.acceptance.sampling import ENDLESS_RUN, AcceptanceModel

__all__ = ["ENDLESS_RUN", "FRESH_KEYS", "NODE_KEYS", "STATISTICS_KEYS", "AcceptanceModel",
           "fit_sequence_shifts"]
