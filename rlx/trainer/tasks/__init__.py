"""What the policy is trained on: prompts, rewards, synthetic tasks, validation."""
