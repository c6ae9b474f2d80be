"""duet: benchmarks."""
