"""rlx.procfs reads /proc: a process's children, as an engine checks before it lets its
process end without tearing it down (rlx/trainer/rollout/vllm.py)."""

from __future__ import annotations

import os

from rlx import procfs


def test_children_are_the_running_processes_a_process_started() -> None:
    assert os.getpid() in procfs.children(os.getppid())
    assert os.getppid() not in procfs.children()
    assert all(procfs.running(pid) for pid in procfs.children(os.getppid()))
