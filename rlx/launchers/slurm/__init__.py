"""slurm backend."""
