"""Weight-only quantization: formats, round-to-nearest, GGUF repacking (docs/quantization.md)."""
