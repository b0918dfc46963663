"""Random generator state for exact resume: python, numpy, torch CPU and, in a process that
computes on a GPU, its CUDA device's. The controller never touches CUDA: it holds no GPU of
its own, and asking CUDA for generator states would open a context on a GPU that belongs to
a training rank or an engine."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def capture_rng_state(*, cuda: bool = False) -> dict[str, Any]:
    """Python, numpy, torch CPU and (cuda: a process computing on its one GPU) that device's
    generator state.

    Plain values and tensors only, so it stores with torch.save and loads with
    weights_only=True.
    """
    numpy_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": numpy_state["bit_generator"],
            "key": [int(word) for word in numpy_state["state"]["key"]],
            "pos": int(numpy_state["state"]["pos"]),
            "has_gauss": int(numpy_state["has_gauss"]),
            "gauss": float(numpy_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if cuda:
        state["cuda"] = [torch.cuda.get_rng_state()]
    return state


def restore_rng_state(state: Mapping[str, Any], *, cuda: bool = False) -> None:
    """Put back what capture_rng_state took; the CUDA state (cuda: this process's device)
    only where it computes on a GPU."""
    random.setstate(_as_tuple(state["python"]))
    saved = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": saved["bit_generator"],
            "state": {"key": np.asarray(saved["key"], dtype=np.uint32), "pos": saved["pos"]},
            "has_gauss": saved["has_gauss"],
            "gauss": saved["gauss"],
        }
    )
    torch.set_rng_state(state["torch"])
    if cuda and state.get("cuda"):
        torch.cuda.set_rng_state(state["cuda"][0])


def _as_tuple(value: Any) -> Any:
    # random.setstate wants the exact nested tuples getstate gave.
    if isinstance(value, list | tuple):
        return tuple(_as_tuple(item) for item in value)
    return value
