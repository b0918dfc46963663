"""Random generator state for exact resume: python, numpy, torch CPU and CUDA."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def capture_rng_state() -> dict[str, Any]:
    """Python, numpy, torch CPU and (when present) every CUDA device's generator state.

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
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Put back what capture_rng_state took. CUDA states go to the devices that exist here."""
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
    if "cuda" in state and torch.cuda.is_available():
        for device, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)


def _as_tuple(value: Any) -> Any:
    # random.setstate wants the exact nested tuples getstate gave.
    if isinstance(value, list | tuple):
        return tuple(_as_tuple(item) for item in value)
    return value
