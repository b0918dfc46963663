"""rlx: one recipe for multi-node RL post-training of language models."""

__version__ = "0.1.0"
