"""Energy per token: what a step's work costs in joules (docs/energy.md).

`work`: the FLOPs and device-memory bytes of a step, from the model's shape and the plan's
aggregates; `power`: the power-model protocol and the default utilisation-based model; `meter`:
each replica's running total, fed by its step recorder; `stages`: a pipelined replica's, one
meter per stage; `trace`: the traced meters a run that plots keeps for its power plot;
`summary`: the run's energy keys.
"""
