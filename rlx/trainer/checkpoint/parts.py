"""How one checkpoint part becomes one durable file, and comes back."""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file as load_safetensors
from safetensors.torch import save_file as save_safetensors

HASH_CHUNK_BYTES = 1 << 22


def is_flat_tensor_dict(value: Any) -> bool:
    return (
        isinstance(value, Mapping)
        and len(value) > 0
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items())
    )


def is_plain_json(value: Any) -> bool:
    # Exactly what json round-trips unchanged: str keys only, lists not tuples.
    if value is None or type(value) in (str, bool, int, float):
        return True
    if type(value) is list:
        return all(is_plain_json(item) for item in value)
    if type(value) is dict:
        return all(isinstance(k, str) and is_plain_json(v) for k, v in value.items())
    return False


# Exact types: numpy scalars subclass float but weights_only loading refuses them.
_PLAIN_LEAVES = (str, bytes, bool, int, float, complex)
_TORCH_LEAVES = (torch.dtype, torch.device, torch.Tensor)


def check_weights_only(value: Any, where: str) -> None:
    """Raise if torch.load(weights_only=True) would refuse value: find out at save, not resume."""
    if value is None or type(value) in _PLAIN_LEAVES or isinstance(value, _TORCH_LEAVES):
        return
    if type(value) in (dict, OrderedDict):
        for key, item in value.items():
            check_weights_only(key, f"{where} key {key!r}")
            check_weights_only(item, f"{where}[{key!r}]")
        return
    if type(value) in (list, tuple, set, torch.Size):
        for index, item in enumerate(value):
            check_weights_only(item, f"{where}[{index}]")
        return
    raise TypeError(
        f"checkpoint part {where}: a {type(value).__module__}.{type(value).__qualname__} "
        "cannot be restored safely; store tensors, numbers, strings, lists, tuples and dicts "
        "(convert numpy arrays with torch.from_numpy or .tolist())"
    )


def contiguous_unshared(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # safetensors refuses tensors that share memory (tied embeddings) or are not contiguous;
    # copy only those, so a large state dict is not duplicated in memory.
    seen: set[tuple[int, int]] = set()
    flat: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach().cpu()
        storage = (tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        if storage in seen or not tensor.is_contiguous() or tensor.storage_offset() != 0:
            tensor = tensor.contiguous().clone()
        elif tensor.numel() * tensor.element_size() != storage[1]:
            tensor = tensor.clone()  # a view of a bigger storage would be saved whole
        seen.add((tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()))
        flat[name] = tensor
    return flat


def write_part(folder: Path, name: str, value: Any) -> dict[str, str]:
    """Write one part, fsync it, and say which file and format hold it."""
    if is_flat_tensor_dict(value):
        file, kind = f"{name}.safetensors", "safetensors"
        save_safetensors(contiguous_unshared(value), str(folder / file))
        fsync_path(folder / file)
    elif is_plain_json(value):
        file, kind = f"{name}.json", "json"
        write_synced(folder / file, json.dumps(value, indent=1).encode())
    else:
        check_weights_only(value, repr(name))
        file, kind = f"{name}.pt", "torch"
        with open(folder / file, "wb") as handle:
            torch.save(value, handle)
            handle.flush()
            os.fsync(handle.fileno())
    return {"file": file, "format": kind}


def read_part(folder: Path, entry: Mapping[str, str]) -> Any:
    path = folder / entry["file"]
    if entry["format"] in ("dcp", "folder"):  # a folder: its readers load from the path
        return path
    if entry["format"] == "safetensors":
        return load_safetensors(str(path), device="cpu")
    if entry["format"] == "json":
        return json.loads(path.read_text())
    return torch.load(path, map_location="cpu", weights_only=True)


# --------------------------------------------------------------------------- durability


def fsync_path(path: Path) -> None:
    """fsync a file or a folder (a folder's fsync makes renames and new entries durable)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()
