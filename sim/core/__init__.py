"""The simulator's core: the simpy replica loop, the experiment runner, workloads, energy and the
cost-model builders. It runs the shared runtime (runtime/) and never imports the engine."""
