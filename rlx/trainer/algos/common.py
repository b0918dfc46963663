"""Shared pieces of the algos package: name tables and a numeric guard."""

from collections.abc import Mapping
from typing import TypeVar

from torch import Tensor

Metrics = dict[str, Tensor]

# exp(20) ~ 4.9e8 is finite in fp32 and far beyond any ratio the clip lets through.
MAX_LOG_RATIO = 20.0

_Entry = TypeVar("_Entry")


def lookup(table: Mapping[str, _Entry], name: str, kind: str) -> _Entry:
    """table[name], or a ValueError that lists the valid names."""
    if name not in table:
        valid = ", ".join(repr(key) for key in sorted(table))
        raise ValueError(f"unknown {kind} {name!r}; valid names: {valid}")
    return table[name]
