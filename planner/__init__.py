"""Planner: cost model, placement policies, CP-SAT, simulator; it imports neither JAX nor the
executor (measuring is ``hx.measure``; docs/architecture.md, "Layout")."""
