"""What a weight push is made of, the group it travels over, and its two ends. Torch,
background.py and rlx.errors only.

A push is a list of buckets. A bucket's layout (BucketLayout) places named tensors, in the
engines' dtype, at aligned offsets of one flat byte buffer; every side computes the same
layouts from the global shapes. Training rank 0 fills a bucket's buffer (under FSDP each
rank sends its rows straight into rank 0's buffer), then broadcasts it over the weight group
(WeightGroup): a torch.distributed group of its own, apart from the training ranks' group,
holding training rank 0 and every process that holds an engine's weights (each
tensor-parallel worker of each vLLM engine). NCCL on GPUs: the bytes go GPU to GPU and
never through host memory. gloo on CPU: one copy on rank 0 (its own rows into the buffer);
every receiver gets the bucket straight into a buffer of its own and loads the tensors as
views of it. WeightSender is the sending side (training rank 0), receive_push the
receiving side, for any engine.

Every wait of a push is bounded by the group's timeout (GroupAddress.timeout_s, from
trainer.stall_timeout): a peer that never comes fails the push with one line naming the
bucket, this side's rank and the peer it waited for (PushFailed, exit 75).
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlx.errors import TRY_AGAIN, RlxError
from rlx.trainer.background import Background

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]

# Bytes of tensors per bucket of a weight push: the most extra memory a push holds at once
# on either side (two buckets while one is sent and the next gathered), whatever the model.
DEFAULT_BUCKET_BYTES = 256 * 2**20
ALIGN = 64  # bytes: every tensor of a bucket starts where any dtype may view it
GROUP_PREFIX = "rlx-weights"  # the weight group's keys in its rendezvous store


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


def dtype_named(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


@dataclass(frozen=True)
class BucketLayout:
    """Where each tensor of one bucket lies in its flat byte buffer. Plain values only, so
    that it travels as an argument of any RPC (vLLM's included)."""

    names: tuple[str, ...]
    dtype: str  # every tensor of a push is in the engines' dtype
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    nbytes: int  # the buffer's size

    @classmethod
    def of(cls, tensors: Sequence[tuple[str, tuple[int, ...]]], dtype: torch.dtype) -> BucketLayout:
        offsets, total = [], 0
        itemsize = dtype.itemsize
        for _, shape in tensors:
            offsets.append(total)
            total += -(-math.prod(shape) * itemsize // ALIGN) * ALIGN
        return cls(
            names=tuple(name for name, _ in tensors),
            dtype=str(dtype).removeprefix("torch."),
            shapes=tuple(tuple(shape) for _, shape in tensors),
            offsets=tuple(offsets),
            nbytes=total,
        )

    def to_wire(self) -> dict[str, Any]:
        """Lists, strings and ints: what vLLM's own RPC encoding carries."""
        return {
            "names": list(self.names),
            "dtype": self.dtype,
            "shapes": [list(shape) for shape in self.shapes],
            "offsets": list(self.offsets),
            "nbytes": self.nbytes,
        }

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> BucketLayout:
        return cls(
            names=tuple(wire["names"]),
            dtype=str(wire["dtype"]),
            shapes=tuple(tuple(shape) for shape in wire["shapes"]),
            offsets=tuple(wire["offsets"]),
            nbytes=int(wire["nbytes"]),
        )

    def empty(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.empty(self.nbytes, dtype=torch.uint8, device=device)

    def views(self, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Each tensor as a view of the buffer (no copy)."""
        dtype = dtype_named(self.dtype)
        out = []
        for name, shape, offset in zip(self.names, self.shapes, self.offsets, strict=True):
            nbytes = math.prod(shape) * dtype.itemsize
            out.append((name, buffer[offset : offset + nbytes].view(dtype).view(shape)))
        return out


@dataclass
class Traffic:
    """Bytes a rank moved for a push: copied within its own memory, sent and received."""

    copied: int = 0
    sent: int = 0
    received: int = 0

    def add(self, other: Traffic) -> None:
        self.copied += other.copied
        self.sent += other.sent
        self.received += other.received


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as flat uint8 (a view: point-to-point and broadcast move
    bytes, whatever the dtype)."""
    return tensor.reshape(-1).view(torch.uint8)


class PushFailed(RlxError):
    """A weight push that did not complete: a peer gone or silent past the timeout."""

    exit_code = TRY_AGAIN


@dataclass(frozen=True)
class GroupAddress:
    """Where a weight group meets: rank 0's store (host, port) and the group's size."""

    host: str
    port: int
    world_size: int
    timeout_s: float = 1800.0


class WeightGroup:
    """A torch.distributed group of its own for weight pushes (never the default group, which
    belongs to the training ranks or to an engine's tensor-parallel workers): NCCL between
    GPUs, gloo otherwise. Rank 0 (the sender) hosts the rendezvous store."""

    def __init__(
        self,
        group: Any,
        rank: int,
        world_size: int,
        device: torch.device,
        address: GroupAddress | None = None,
    ):
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.address = address
        self.bytes_sent = 0
        self.bytes_received = 0

    @classmethod
    def join(cls, address: GroupAddress, rank: int, device: torch.device) -> WeightGroup:
        """Join (rank 0: open) the group; returns once every member has joined."""
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=address.timeout_s)
        store = dist.TCPStore(
            address.host,
            address.port,
            address.world_size,
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
        prefixed = dist.PrefixStore(GROUP_PREFIX, store)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            group = dist.ProcessGroupNCCL(prefixed, rank, address.world_size, options)
        else:
            group = dist.ProcessGroupGloo(prefixed, rank, address.world_size, timeout)
        joined = cls(group, rank, address.world_size, device, address)
        joined._store = store  # the store lives as long as the group
        joined.barrier()
        return joined

    def barrier(self) -> None:
        """Every member has reached this point (a one-byte broadcast, not counted)."""
        work = self._broadcast(torch.zeros(1, dtype=torch.uint8, device=self.device))
        self.wait(work, "joining the weight group")

    def wait(self, work: Any, phase: str) -> None:
        """work.wait(), a failure (a peer gone, or silent past the timeout) as PushFailed."""
        try:
            work.wait()
        except RuntimeError as exc:
            raise PushFailed(self.failure_line(phase, exc)) from None

    def failure_line(self, phase: str, exc: BaseException) -> str:
        """One line: the phase, this side's rank, the peer it waited for, the bound."""
        text = str(exc).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        address = self.address
        where = "" if address is None else f", rendezvous {address.host}:{address.port}"
        bound = "" if address is None else f" within {address.timeout_s:.0f} s"
        if self.rank == 0:
            side = (
                f"training rank 0 (weight-group rank 0 of {self.world_size}{where}) could not "
                f"reach the engines' processes (weight-group ranks 1-{self.world_size - 1})"
            )
        else:
            side = (
                f"engine process (weight-group rank {self.rank} of {self.world_size}) got "
                f"nothing from training rank 0 (weight-group rank 0{where})"
            )
        return (
            f"weight push, {phase}: {side}{bound}: {first}; the run stops here, exit "
            f"{TRY_AGAIN} so it is run again from its last checkpoint"
        )

    def _broadcast(self, buffer: torch.Tensor) -> Any:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = 0
        return self.group.broadcast([buffer], options)

    def broadcast(self, buffer: torch.Tensor) -> Any:
        """Rank 0's buffer into every member's, as bytes; returns the work to wait on."""
        work = self._broadcast(buffer)
        if self.rank == 0:
            self.bytes_sent += buffer.numel() * (self.world_size - 1)
        else:
            self.bytes_received += buffer.numel()
        return work

    def close(self) -> None:
        shutdown = getattr(self.group, "shutdown", None)
        if callable(shutdown):
            shutdown()


def receive_push(
    group: WeightGroup,
    layouts: Sequence[BucketLayout],
    load: Callable[[list[tuple[str, torch.Tensor]]], int],
    *,
    drop: int = 0,
    skip: bool = False,
) -> int:
    """The receiving side of a push: every bucket from rank 0 into a buffer of its own, its
    tensors loaded as views of it. Returns how many tensors were loaded. Each bucket gets a
    fresh buffer (an engine may keep a view until the rest of its layer arrives). Test
    hooks: skip loads nothing (a broken transport), drop loses the first `drop` buckets
    (a partial push); both still take part in every broadcast, or the group would hang."""
    loaded = 0
    for index, layout in enumerate(layouts):
        buffer = layout.empty(group.device)
        group.wait(group.broadcast(buffer), f"bucket {index + 1} of {len(layouts)}")
        if skip or index < drop:
            continue
        loaded += load(layout.views(buffer))
    return loaded


# What fills a bucket's buffer (training rank 0) with the policy's tensors in the layout;
# returns what the rank moved (learn.sharding.fill_bucket over the policy).
FillBucket = Callable[[BucketLayout, torch.Tensor], Traffic]


class WeightSender:
    """The sending side of a push, on training rank 0: every bucket filled (fill) and
    broadcast over the weight group to the engines, the next one filled while one is on the
    wire, so a push holds two buckets. queued (rollouts under way on the engines): every
    bucket is filled now and held on the host, and a thread of its own sends them once the
    engines take them, so the learners go on; finish waits for it. One push on the wire at
    a time."""

    def __init__(self, group: WeightGroup, device: torch.device):
        self.group = group
        self.device = device
        self._queued: Background | None = None

    def send(self, layouts: Sequence[BucketLayout], fill: FillBucket, queued: bool) -> Traffic:
        """Send a whole push; returns what this rank moved."""
        self.finish()
        if queued:
            return self._stage(layouts, fill)
        traffic = Traffic()
        # (the work, its buffer: held until it is sent, the phase for a failure's line)
        on_wire: tuple[Any, torch.Tensor, str] | None = None
        for index, layout in enumerate(layouts):
            buffer = layout.empty(self.device)
            traffic.add(fill(layout, buffer))
            if on_wire is not None:
                self.group.wait(on_wire[0], on_wire[2])
            phase = f"bucket {index + 1} of {len(layouts)}"
            on_wire = (self.group.broadcast(buffer), buffer, phase)
            traffic.sent += buffer.numel() * (self.group.world_size - 1)
        if on_wire is not None:
            self.group.wait(on_wire[0], on_wire[2])
        return traffic

    def _stage(self, layouts: Sequence[BucketLayout], fill: FillBucket) -> Traffic:
        traffic = Traffic()
        staged = []
        for layout in layouts:
            buffer = layout.empty(self.device)
            traffic.add(fill(layout, buffer))
            # Held on the host until the engines take it: GPU memory is the learners'.
            staged.append(buffer.to("cpu", non_blocking=True) if buffer.is_cuda else buffer)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self._queued = Background(lambda: self._send_staged(staged), name="rlx-weight-send")
        traffic.sent += sum(b.numel() for b in staged) * (self.group.world_size - 1)
        return traffic

    def _send_staged(self, staged: list[torch.Tensor]) -> None:
        """A queued push's buckets, in order, to the engines (a thread of its own)."""
        for index, buffer in enumerate(staged):
            work = self.group.broadcast(buffer.to(self.device))
            self.group.wait(work, f"bucket {index + 1} of {len(staged)}, queued")

    def finish(self) -> None:
        """Wait for a queued push's sending thread; raises what it raised."""
        queued, self._queued = self._queued, None
        if queued is not None:
            queued.result()
