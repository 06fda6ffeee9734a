"""GPU cost model fitted to public GPU measurements (data/gpu/)."""
