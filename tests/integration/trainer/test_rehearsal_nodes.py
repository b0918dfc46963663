"""Ray on a busy machine (the rehearsal's nodes, a run's private Ray): a raylet that misses
Ray's fixed 30 s to register is started again, and what the late try started goes."""

from __future__ import annotations

import subprocess

from rlx.trainer.main import RAYLET_LATE, started_on_a_busy_machine


def test_nodes_whose_raylet_missed_rays_30_s_start_again_and_their_processes_go() -> None:
    started: list[subprocess.Popen] = []

    def start() -> str:
        started.append(subprocess.Popen(["sleep", "300"]))
        if len(started) < 3:
            raise Exception(f"The current node {RAYLET_LATE}. This could happen because ...")
        return "up"

    assert started_on_a_busy_machine(start, "the nodes") == "up"
    assert [proc.wait(timeout=10) for proc in started[:2]] == [-9, -9]  # the late tries' own
    assert started[2].poll() is None  # the try that worked keeps what it started
    started[2].kill()
    started[2].wait()
