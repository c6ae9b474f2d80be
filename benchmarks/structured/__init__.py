"""Structured-output benchmarks: `python -m benchmarks.structured` (see throughput.py)."""
