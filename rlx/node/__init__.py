"""What every node of a job runs: the bootstrap, the Ray node, the node environment."""
