"""Seeds derived from the recipe's seed, so every random choice of a run can be replayed."""

from __future__ import annotations

import hashlib

SEED_BITS = 63


def derive_seed(seed: int, *parts: int | str) -> int:
    """A seed for one use (e.g. generation at a step on an engine) from the run's seed:
    stable across processes and Python versions (no hash randomisation), and unrelated for
    neighbouring inputs."""
    text = ":".join(str(part) for part in (seed, *parts))
    digest = hashlib.sha256(text.encode()).digest()
    return int.from_bytes(digest[:8], "little") >> (64 - SEED_BITS)
