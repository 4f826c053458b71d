"""Measuring on the devices present: the profiler (``profiler``, with ``links``, ``rates`` and
``timing``), its calibration (``calibrate``), the measured ablation (``ablate``) and ``hx bench``
(``bench``); it imports JAX and the executor, which the planner (``hx.planner``) does not
(docs/architecture.md, "Layout")."""
