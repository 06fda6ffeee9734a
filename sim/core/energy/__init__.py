"""Energy per token: what a step's work (sim/cost/work.py) costs in joules (docs/energy.md).

`power`: the power-model protocol and the default utilisation-based model; `meter`: each
replica's running total, fed by its step recorder; `stages`: a pipelined replica's, one meter per
stage; `trace`: the traced meters a run that plots keeps for its power plot; `summary`: the run's
energy keys.
"""
