"""duet: session_store."""
