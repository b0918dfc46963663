"""A transformers model from the inside: its attention (segment attention), its decode step,
the CPU's linears, LoRA wiring, tiny models, DTensor helpers. The learner (learn/) and the
HF engine (rollout/) both build on it; it imports neither."""
