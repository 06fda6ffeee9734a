"""The profiled cost model (cost_model) and what it predicts from: a step's features
(step_features), the torch CPU kernels' attention tiles (tile_features) and the local correction
of the linear fit (local_correction). calibration/profiler/ measures and fits the profiles it
reads."""
