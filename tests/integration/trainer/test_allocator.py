"""A CPU worker's allocator keeps freed tensors' pages for the next ones: a loop that
allocates and frees tensors the size of a step's activations faults pages in at every
round with glibc's defaults and not at all once keep_freed_memory ran (each case in a
process of its own: malloc's settings are per process). A user's own settings stay."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from rlx.trainer.allocator import keep_freed_memory

# 40 MiB tensors: above the largest mapping threshold glibc adapts to by itself (32 MiB), so
# its defaults map and unmap every one; below the one keep_freed_memory sets.
LOOP = textwrap.dedent(
    """
    import json, resource, sys
    import torch
    from rlx.trainer.allocator import keep_freed_memory
    kept = keep_freed_memory() if sys.argv[1] == "keep" else False
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(30):  # warm up: the heap settles over the first ten or so
        torch.ones(10 * 2**20).sum()
    before = faults()
    for _ in range(20):
        torch.ones(10 * 2**20).sum()  # 40 MiB written, read, freed
    print(json.dumps({"kept": kept, "faults": faults() - before}))
    """
)


def faults_of(mode: str) -> dict:
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}  # no MALLOC_* or LD_PRELOAD
    run = subprocess.run(
        [sys.executable, "-c", LOOP, mode], capture_output=True, text=True, env=env, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_tensors_pages_are_reused() -> None:
    default, kept = faults_of("default"), faults_of("keep")
    assert kept["kept"] and not default["kept"]
    pages = 20 * 40 * 2**20 // 4096  # what the loop touches: 204,800 pages of 4 KiB
    assert default["faults"] > pages // 2  # glibc maps every tensor afresh
    assert kept["faults"] < pages // 100  # kept: next to none


def test_a_users_own_allocator_settings_stay() -> None:
    assert not keep_freed_memory({"MALLOC_TRIM_THRESHOLD_": "0"})
    assert not keep_freed_memory({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"})
