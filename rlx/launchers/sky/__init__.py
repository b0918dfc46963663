"""sky backend."""
