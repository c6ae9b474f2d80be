"""duet: prefill_worker."""
