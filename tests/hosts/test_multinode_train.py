"""The trainer across emulated hosts: SkyPilot's rendered run block runs on each of two
hosts with the variables SkyPilot injects; the head forms the Ray cluster and runs `rlx
train`, which places one training worker on every host (CPU-only: one rank per node, FSDP2
over gloo between them) and learns the quickstart task, its prompts read by dataset id from
an offline hub cache at the commit the head resolved. (Three hosts, with kills and
resumes: bench/chaos_store.py.) Every host runs this checkout's rlx
(PYTHONPATH).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rlx.launchers import render
from rlx.recipe import parse_recipe
from rlx.runs import read_metrics
from tests.conftest import REPO
from tests.support.hosts import Hosts, backend_env
from tests.support.hub import ANSWER_COLUMN, DATASET_ID, PROMPT_COLUMN
from tests.support.recipes import trainer_section

pytest.importorskip("ray")
pytestmark = [pytest.mark.hosts, pytest.mark.timeout(900)]

NODES = 2
TASK_ID = "sky-train-test"
STEPS = 40


def node_env(tmp_path: Path) -> dict[str, str]:
    """What every host's run block starts with: this checkout first on the import path,
    the test's Python first on PATH (its `rlx` and `ray`), and a job's Ray token."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RLX_"))}
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["HOME"] = str(tmp_path / "home")  # each test's own ~/.ray, nothing from the machine
    env["RLX_RAY_TOKEN"] = os.urandom(32).hex()  # SkyPilot delivers the job's secret so
    return env


def test_training_runs_on_every_host(hosts_factory, dataset_cache, tmp_path: Path) -> None:
    sky = pytest.importorskip("sky")
    hosts: Hosts = hosts_factory(NODES)
    spec = f"hf://{DATASET_ID}"  # the quickstart's task by id, from an offline hub cache
    section = trainer_section(
        tmp_path,
        data={
            "train": spec,
            "config": "letters",
            "prompt_key": PROMPT_COLUMN,
            "answer_key": ANSWER_COLUMN,
            "max_prompt_length": 64,
        },
        batch={"prompts_per_step": 3, "micro_batch_size": 24},  # 48 samples, 24 per rank
        steps=STEPS,
        checkpoint={"dir": str(tmp_path / "ckpt"), "every": STEPS},
    )
    recipe = parse_recipe(
        yaml.safe_dump(
            {
                "name": "multinode-train",
                "resources": {"nodes": NODES},
                "ray": {"join_timeout": 240},
                "trainer": section,
            }
        ),
        "multinode-train.yaml",
    ).recipe
    task = sky.Task.from_yaml_config(yaml.safe_load(render("sky", recipe, "x.yaml")))
    base = {**node_env(tmp_path), **dataset_cache.env}
    (tmp_path / "home").mkdir()
    procs, logs = [], []
    for rank, host in enumerate(hosts):
        env = {**base, **dict(task.envs), **backend_env("sky", hosts, rank, task_id=TASK_ID)}
        log = (tmp_path / f"node{rank}.log").open("w")
        logs.append(log)
        procs.append(
            host.popen(task.run, env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
        )
    try:
        deadline = time.monotonic() + 800
        codes = {}
        for rank, proc in enumerate(procs):
            codes[rank] = proc.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill_tree()
        for log in logs:
            log.close()
    output = {rank: (tmp_path / f"node{rank}.log").read_text() for rank in range(NODES)}
    assert codes == dict.fromkeys(range(NODES), 0), output

    head = output[0]
    ranks = [f"rank {rank} on " for rank in range(NODES)]
    workers = next(line for line in head.splitlines() if line.startswith("training workers:"))
    assert all(r in workers for r in ranks), workers
    assert f"rank 0 on {hosts[0].ip}," in workers  # beside the controller, on the head
    assert sorted(h.ip for h in hosts) == sorted(
        part.split(" on ")[1] for part in workers.removeprefix("training workers: ").split(", ")
    ), workers
    run_dir = tmp_path / "runs" / TASK_ID  # the run id is SkyPilot's task id
    assert "sharding: FSDP2" in head, head  # several ranks: sharded by default
    assert f"data: 64 prompts from {spec}@{dataset_cache.commit[:12]} (split train" in head
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    rewards = [r["reward/mean"] for r in records]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"FSDP on {NODES} hosts: first 10 steps {first:.3f}, last 10 steps {last:.3f}")
    assert last > first + 0.1, rewards  # the quickstart task is learned across the hosts
    assert workers in (run_dir / "train.log").read_text()
    assert (tmp_path / "ckpt" / TASK_ID / f"step-{STEPS:06d}" / "COMPLETE").is_file()
    for host in hosts:
        left = [p.cmdline for p in host.processes()]
        assert left == [], (host.name, left)
