"""The steps of the lent-GPU check (bench/gpu_check.py runs each in its own process): kernels,
engine, speculative decoding, the 7B-shaped fidelity grid, decode bandwidth, throughput, and
the sm_90 compile report; common.py holds what they share, ties.py the tie-aware greedy
comparison, goals.py the thresholds each step gates on."""
