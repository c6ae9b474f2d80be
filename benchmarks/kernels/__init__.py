"""Kernel- and device-level benchmarks: CPU prefill attention, the engine against the GPU roofline."""
