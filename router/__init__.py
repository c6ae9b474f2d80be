"""duet: router."""
