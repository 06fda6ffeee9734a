"""What the simulator (sim/) and the engine (engine/) share: the step loop, the step recorder and
metrics, hardware and model specs, policy configs and their assembly, speculation settings and
step shapes. It imports policies/ and neither backend."""
