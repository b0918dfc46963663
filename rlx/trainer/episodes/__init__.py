"""Multi-turn episodes: environments (env.py), token-exact trajectories (trajectory.py) and
the controller's driver of turns over the rollout engines (runner.py)."""
