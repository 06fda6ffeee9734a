"""The cost models: how long a simulated step takes. A new one is a class with `step_time(plan)`
(policies.protocols.CostModel) named by a conf/cost_model/*.yaml `_target_`; build.py builds the
run's. roofline.py (spec sheets), gpu/ (measured kernels), profiled/ (fitted to the engine) and
pipeline.py (stages of either of the first two) are the shipped ones; overheads.py and drafting.py
are what the roofline and the GPU cost model share."""
