"""The simulator: the simpy replica loop and its step, the experiment runner, the roofline cost
model, specs, workloads and metrics. Nothing here imports the engine."""
