"""duet: deploy."""
