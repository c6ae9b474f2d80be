"""duet: decode_worker."""
