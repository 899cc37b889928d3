"""Benchmarks (run from the repository root, e.g. ``python -m benchmarks.bench_ulysses``).

A package so that the per-rank worker functions are importable by module path in the processes
that :func:`dtensor_ulysses.launch.run_local_world` spawns.
"""
