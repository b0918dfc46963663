"""What a weight push is made of: tensors grouped into buckets of a bounded size, and a bucket
packed into one flat buffer for Ray's object store. A leaf: torch only."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]

# Bytes of tensors per bucket of a weight push: the most extra memory a push holds at once
# on either side (two buckets while one is sent and the next gathered), whatever the model.
DEFAULT_BUCKET_BYTES = 256 * 2**20


def bucket_plan(sizes: Iterable[tuple[str, int]], bucket_bytes: int) -> list[list[str]]:
    """Names grouped, in order, into buckets of at most bucket_bytes (a larger tensor
    travels alone)."""
    plan: list[list[str]] = []
    size = 0
    for name, nbytes in sizes:
        if not plan or (plan[-1] and size + nbytes > bucket_bytes):
            plan.append([])
            size = 0
        plan[-1].append(name)
        size += nbytes
    return plan


def buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Named tensors grouped as bucket_plan groups them, taken one at a time (a lazy source,
    such as parameters gathered from shards, stays lazy)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


@dataclass
class PackedBucket:
    """One bucket's tensors in one flat byte buffer. Ray's object store carries a numpy
    array without pickling it: the sender writes it once into shared memory and a reader on
    the node gets a view of it, so neither side holds a second copy of the bucket."""

    names: list[str]
    dtypes: list[str]
    shapes: list[tuple[int, ...]]
    offsets: list[int]
    data: Any  # numpy uint8 array

    ALIGN = 64  # bytes: every tensor starts where any dtype may view it

    @classmethod
    def pack(cls, tensors: Sequence[tuple[str, torch.Tensor]]) -> PackedBucket:
        offsets, total = [], 0
        for _, tensor in tensors:
            offsets.append(total)
            nbytes = tensor.numel() * tensor.element_size()
            total += -(-nbytes // cls.ALIGN) * cls.ALIGN
        flat = torch.empty(total, dtype=torch.uint8)
        for (_, tensor), offset in zip(tensors, offsets, strict=True):
            raw = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            flat[offset : offset + raw.numel()].copy_(raw)
        return cls(
            names=[name for name, _ in tensors],
            dtypes=[str(tensor.dtype).removeprefix("torch.") for _, tensor in tensors],
            shapes=[tuple(tensor.shape) for _, tensor in tensors],
            offsets=offsets,
            data=flat.numpy(),
        )

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Views into the buffer (read them, do not write: it may be shared memory)."""
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a read-only object-store buffer
            flat = torch.from_numpy(self.data)
        out = []
        for name, dtype, shape, offset in zip(
            self.names, self.dtypes, self.shapes, self.offsets, strict=True
        ):
            kind = getattr(torch, dtype)
            nbytes = math.prod(shape) * torch.empty((), dtype=kind).element_size()
            out.append((name, flat[offset : offset + nbytes].view(kind).view(shape)))
        return out
