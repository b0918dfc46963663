"""The weight group a push travels over (gloo here, in threads of this process): rank 0's
buckets arrive whole in every receiver's own buffer, in the layout's dtype, and the test
hooks that lose or ignore a push still take part in every broadcast."""

from __future__ import annotations

import socket
import threading
import time

import torch

from rlx.errors import TRY_AGAIN
from rlx.trainer.weights import (
    BucketLayout,
    GroupAddress,
    PushFailed,
    WeightGroup,
    receive_push,
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_push_reaches_every_receiver_whole() -> None:
    gen = torch.Generator().manual_seed(0)
    weights = {
        "embed": torch.randn(9, 4, generator=gen),
        "norm": torch.randn(4, generator=gen),
        "head": torch.randn(4, 9, generator=gen),
    }
    layouts = [
        BucketLayout.of([(n, tuple(weights[n].shape)) for n in names], torch.bfloat16)
        for names in (["embed", "norm"], ["head"])
    ]
    address = GroupAddress("127.0.0.1", free_port(), world_size=4, timeout_s=60)
    got: dict[int, dict[str, torch.Tensor]] = {}
    counts: dict[int, int] = {}
    errors: list[BaseException] = []

    def sender() -> None:
        group = WeightGroup.join(address, 0, torch.device("cpu"))
        for _ in range(2):  # two pushes
            for layout in layouts:
                buffer = layout.empty()
                for name, view in layout.views(buffer):
                    view.copy_(weights[name])
                group.broadcast(buffer).wait()
        assert group.bytes_sent == 2 * sum(layout.nbytes for layout in layouts) * 3

    def receiver(rank: int) -> None:
        group = WeightGroup.join(address, rank, torch.device("cpu"))
        mine: dict[str, torch.Tensor] = {}

        def load(views: list[tuple[str, torch.Tensor]]) -> int:
            mine.update((name, tensor.clone()) for name, tensor in views)
            return len(views)

        # rank 2 loses the first bucket of the first push, rank 3 ignores the first push
        first = receive_push(group, layouts, load, drop=int(rank == 2), skip=rank == 3)
        second = receive_push(group, layouts, load)
        got[rank], counts[rank] = mine, first * 10 + second

    def run(target, *args) -> None:
        try:
            target(*args)
        except BaseException as exc:  # handed to the test thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(sender,))]
    threads += [threading.Thread(target=run, args=(receiver, rank)) for rank in (1, 2, 3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    assert counts == {1: 33, 2: 13, 3: 3}  # tensors loaded by each push
    for rank in (1, 2, 3):
        assert got[rank].keys() == weights.keys()
        for name, tensor in weights.items():
            assert got[rank][name].dtype == torch.bfloat16
            assert torch.equal(got[rank][name], tensor.to(torch.bfloat16)), (rank, name)


def test_a_push_whose_sender_never_sends_fails_within_the_timeout_in_one_line() -> None:
    layouts = [BucketLayout.of([("w", (4,))], torch.float32)]
    address = GroupAddress("127.0.0.1", free_port(), world_size=2, timeout_s=2)
    joined = threading.Event()
    failures: list[BaseException] = []

    def sender() -> None:
        group = WeightGroup.join(address, 0, torch.device("cpu"))
        joined.set()
        time.sleep(4)  # joined, then silent: a rank 0 stuck elsewhere
        group.close()

    def receiver() -> None:
        group = WeightGroup.join(address, 1, torch.device("cpu"))
        try:
            receive_push(group, layouts, lambda views: len(views))
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=sender, daemon=True), threading.Thread(target=receiver)]
    for thread in threads:
        thread.start()
    started = time.monotonic()
    threads[1].join(timeout=30)
    assert joined.is_set() and time.monotonic() - started < 15
    (failure,) = failures
    assert isinstance(failure, PushFailed) and failure.exit_code == TRY_AGAIN
    line = str(failure)
    assert "\n" not in line
    assert line.startswith("weight push, bucket 1 of 1: engine process (weight-group rank 1 of 2)")
    assert f"training rank 0 (weight-group rank 0, rendezvous 127.0.0.1:{address.port})" in line
    assert "within 2 s" in line and "exit 75" in line
