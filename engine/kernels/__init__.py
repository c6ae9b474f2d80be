"""Compute kernels: CPU C++ (built on first use) and, for the GPU path, Triton."""
