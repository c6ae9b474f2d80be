"""Benchmarks of moving KV blocks between workers: raw transfer and prefill-to-decode handoff."""
