"""Offline throughput and latency against HF transformers and vLLM (paired rounds)."""
