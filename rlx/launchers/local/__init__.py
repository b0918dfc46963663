"""local backend."""
