"""Rollout engines: sample responses with their log-probs, take weight pushes, pass the probe."""
