"""Quantized weights: decode speed (bf16 vs int8 vs int4, and llama.cpp on the matching GGUF
when llama-cpp-python is importable) and accuracy (mean NLL of a public-domain text).
Run `python -m benchmarks.quantized --help`; docs/quantization.md."""
