"""Tensor parallelism's plumbing: the process group (`state`) and the worker processes (`workers`).

Rank 0 is the engine process; ranks 1..N-1 are workers it spawns. See docs/engine.md,
"Tensor parallelism".
"""
