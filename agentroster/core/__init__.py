"""Pure, deterministic domain logic: no I/O, no clock, no Temporal.

`lifecycle` (the agent state machine), `index` (capability index and
selection), `leases` (the lease book), `drift`, `scaling` (scale-demand
coalescing) and `pool` (the pool's decisions, combining them).
"""
