"""The host-memory metric counts the whole process tree, children and grandchildren, read
with psutil or from /proc, and forgets them once they exit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from rlx import procfs
from rlx.trainer.report.metrics import host_memory_bytes

HOLDER = textwrap.dedent(
    """
    import subprocess, sys
    # A child that starts a grandchild holding ~100 MB, so the tree is two levels deep.
    grandchild = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; block = bytearray(b'x') * (100 * 2**20); print('ready', flush=True);"
         " sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    print(grandchild.stdout.readline().strip(), flush=True)
    sys.stdin.read()
    grandchild.stdin.close()
    grandchild.wait()
    """
)


@pytest.mark.parametrize("reader", ["psutil", "proc"])
def test_host_memory_counts_every_descendant(reader: str) -> None:
    def measure() -> int:
        if reader == "psutil":
            return host_memory_bytes()
        return procfs.tree_rss_bytes(os.getpid())

    before = measure()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        during = measure()
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=60)
    assert during - before > 100 * 2**20
    assert measure() - before < 50 * 2**20  # and it is gone once they exit
