"""duet: kv_transfer."""
