"""A sharded parameter seen from one rank: the rows FSDP2 gave it."""

from __future__ import annotations

from torch import Tensor


def local_rows(tensor: Tensor) -> tuple[Tensor, int]:
    """(this rank's local tensor, the first global row it holds): a DTensor sharded on dim 0
    the way FSDP2 does it (torch.chunk: ceil(rows / ranks) per rank), or a plain tensor."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(tensor, DTensor):
        return tensor, 0
    placements = tensor.placements
    if len(placements) != 1 or placements[0] != Shard(0):
        raise ValueError(f"unexpected placements {placements}: only Shard(0) is supported")
    local = tensor.to_local()
    ranks = tensor.device_mesh.size()
    per_rank = -(-tensor.shape[0] // ranks)  # ceil
    first = min(per_rank * tensor.device_mesh.get_local_rank(), tensor.shape[0])
    if local.shape[0] != max(min(per_rank, tensor.shape[0] - first), 0):
        raise ValueError(f"local shard of {tuple(tensor.shape)} has {local.shape[0]} rows")
    return local, first
