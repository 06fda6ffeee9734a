"""Calibration: the profiled cost model fitted to engine measurements, and validation of the
simulator against the engine."""
