"""Host-CPU kernels for ops placed on the host (see docs/architecture.md)."""
