"""The learner: models, their sharding over ranks, the update. Plain torch: never Ray."""
