"""vgpu benchmarks: admission latency, scale, footprint, packing quality and hook cost.

Run ``python -m bench`` (full, a few minutes) or ``python -m bench --quick`` (under a minute,
used in CI). Results are printed as a table and written as JSON (default
``bench/results/latest.json``). See BENCHMARKS.md at the repository root.
"""
