"""dstack backend."""
