"""The simulator's core: the simpy replica loop, the experiment runner, workloads and energy;
the cost models are sim/cost/. It runs the shared runtime (runtime/) and never imports the engine."""
