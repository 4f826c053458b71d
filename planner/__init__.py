"""Planner: cost model, profiler, placement policies, simulator (see docs/architecture.md)."""
