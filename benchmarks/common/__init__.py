"""What the benchmarks share: the machine's description, CPU usage and idle waits."""
