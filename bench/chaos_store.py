"""Kill -9 a random rank at random moments of a 3-host FSDP run whose checkpoints live in S3,
resume each time, and check every resume loaded the newest complete checkpoint.

    python bench/chaos_store.py [--kills 20] [--steps 40] [--seed 0] [--store s3|gcs|azure]

Needs root (emulated hosts: Linux network, mount and PID namespaces; tests/support/hosts),
and the store's server (moto's S3, gcp-storage-emulator or Azurite), started here on the
hosts' bridge so every host reaches it. The hosts
share no state but the store: each stages its shards in its own folder (RLX_STAGING_DIR) and
the run folder (metrics, log) is in the store too.

1. A straight run: SkyPilot's rendered run block on each of 3 hosts, the head forms the Ray
   cluster and trains (one FSDP rank per host, gloo), a checkpoint every step.
2. The same run under chaos, as attempts of one run id: each attempt starts all hosts,
   waits for a random step among the next few (the kills left spread evenly over the steps
   left), then a random moment (up to 1.5 s: within that
   step or its save and upload, which take about as long), then SIGKILLs the training
   worker of a random rank. Before the next
   attempt the script lists the store itself for the newest complete step; the attempt
   must say it resumed from exactly that one. After --kills kills, the last attempt runs to
   the end.
3. The run's per-step rewards (metrics.jsonl in the store) must equal the straight run's.
4. A resume at 2 ranks (2 hosts) of the run saved at 3 trains two more steps.

Prints a table: per kill, when it landed (which phase, as the head's log shows it), the
newest complete step before the next attempt, and the step the attempt resumed from.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

RESUMED = re.compile(r"resumed from (\S+) \(step (\d+)\)")
TASK_ID = "chaos"


def recipe_text(root: str, steps: int, nodes: int, resume: str = "auto", every: int = 1) -> str:
    from tests.support.recipes import trainer_section

    section = trainer_section(
        Path("/unused"),
        batch={"prompts_per_step": 3, "micro_batch_size": 16},
        rollout={"n": 8, "max_new_tokens": 16},
        parallel={"strategy": "fsdp"},
        steps=steps,
        checkpoint={"dir": f"{root}/ckpt", "every": every, "keep": 2, "resume": resume},
        logging={"dir": f"{root}/runs", "tensorboard": False},
    )
    return yaml.safe_dump(
        {
            "name": "chaos",
            "resources": {"nodes": nodes},
            "ray": {"join_timeout": 240},
            "setup": ["pip install 'rlx[train,s3]'"],
            "trainer": section,
        }
    )


class Job:
    """One attempt: the rendered SkyPilot run block on each host."""

    def __init__(self, hosts: Any, work: Path, text: str, env: dict[str, str], name: str):
        import sky

        from rlx.launchers import render
        from rlx.recipe import parse_recipe
        from tests.support.hosts import backend_env

        recipe = parse_recipe(text, "chaos.yaml").recipe
        task = sky.Task.from_yaml_config(yaml.safe_load(render("sky", recipe, "chaos.yaml")))
        self.hosts = hosts
        self.logs = [work / f"{name}-node{rank}.log" for rank in range(len(hosts))]
        self.procs = []
        for rank, host in enumerate(hosts):
            node_env = {
                **env,
                **dict(task.envs),
                **backend_env("sky", hosts, rank, task_id=TASK_ID),
                "RLX_STAGING_DIR": str(work / f"staging-{host.name}"),
            }
            log = self.logs[rank].open("w")
            self.procs.append(
                host.popen(task.run, env=node_env, cwd=work, stdout=log, stderr=subprocess.STDOUT)
            )

    def head_log(self) -> str:
        return self.logs[0].read_text(errors="replace")

    def wait(self, timeout: float) -> list[int | None]:
        deadline = time.monotonic() + timeout
        codes = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(timeout=max(deadline - time.monotonic(), 1)))
            except subprocess.TimeoutExpired:
                codes.append(None)
        return codes

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill_tree()
        for host in self.hosts:
            host.kill_all()


def host_env(work: Path, s3: Any) -> dict[str, str]:
    """What every host's run block starts with: this checkout and its Python first, the
    store's settings, a private HOME and a job's Ray token; this process reads the store
    too."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RLX_"))}
    base.update(s3.env)
    base["PYTHONPATH"] = f"{REPO}{os.pathsep}{base.get('PYTHONPATH', '')}"
    base["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{base.get('PATH', '')}"
    base["HOME"] = str(work / "home")
    base["RLX_RAY_TOKEN"] = os.urandom(32).hex()
    base["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ.update(s3.env)
    return base


def training_worker(host: Any) -> int | None:
    for proc in host.processes():
        if "ray::TrainWorker" in proc.cmdline:
            return proc.pid
    return None


def newest_in_store(fs: Any, run: str) -> int | None:
    from rlx.checkpoints import newest_complete_step, step_of

    newest = newest_complete_step(run)
    return None if newest is None else step_of(newest)


def store_rewards(fs: Any, url: str) -> list[tuple[int, float]]:
    text = fs.cat_file(fs._strip_protocol(url)).decode()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [(r["step"], r["reward/mean"]) for r in rows]


def phase(log: str) -> str:
    """Where the head's log stopped: the last step logged and whether a save was under way."""
    steps = re.findall(r"^step (\d+) ", log, re.MULTILINE)
    saved = re.findall(r"^checkpoint \S+step-(\d+) ", log, re.MULTILINE)
    last = int(steps[-1]) if steps else 0
    done = int(saved[-1]) if saved else 0
    return f"step {last} logged, " + ("inside its save" if done < last else "between steps")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--store", choices=["s3", "gcs", "azure"], default="s3")
    args = parser.parse_args()
    rng = random.Random(args.seed)

    from tests.support import stores
    from tests.support.hosts.netns import Hosts

    work = Path(os.environ.get("CHAOS_DIR") or f"/tmp/rlx-chaos-{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    (work / "home").mkdir(exist_ok=True)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; work in {work}")
    server = {"s3": stores.s3_server, "gcs": stores.gcs_server, "azure": stores.azure_server}
    print(f"store: {args.store}")
    with Hosts.create(3) as hosts, server[args.store](hosts.bridge_ip) as s3:
        base = host_env(work, s3)
        fs = s3.filesystem()

        # 1. straight
        straight_root = s3.new_prefix("straight")
        started = time.monotonic()
        job = Job(hosts, work, recipe_text(straight_root, args.steps, 3), base, "straight")
        codes = job.wait(1200)
        job.stop()
        if codes != [0, 0, 0]:
            raise SystemExit(f"the straight run failed: {codes}\n{job.head_log()[-3000:]}")
        attempt_s = time.monotonic() - started
        want = store_rewards(fs, f"{straight_root}/runs/{TASK_ID}/metrics.jsonl")
        print(f"straight run: {len(want)} steps in {attempt_s:.0f} s")

        # 2. chaos
        root = s3.new_prefix("chaos")
        run = f"{root}/ckpt/{TASK_ID}"
        rows = []
        kills = 0
        attempt = 0
        partial_loads = 0
        wrong = 0
        while True:
            expected = newest_in_store(fs, run)
            text = recipe_text(root, args.steps, 3)
            job = Job(hosts, work, text, base, f"attempt{attempt}")
            start = (expected or 0) + 1
            if kills < args.kills and start < args.steps - 1:
                # A random step among the next few (the kills left spread over the steps
                # left), then a random moment within it or its save.
                room = max((args.steps - 1 - start) // (args.kills - kills), 1)
                target = start + rng.randrange(room)
                deadline = time.monotonic() + 600
                while not re.search(rf"^step {target} ", job.head_log(), re.MULTILINE):
                    if time.monotonic() > deadline or any(p.poll() is not None for p in job.procs):
                        break
                    time.sleep(0.05)
                time.sleep(rng.uniform(0.0, 1.5))
                victim = rng.randrange(3)
                pid = training_worker(hosts[victim])
                where = phase(job.head_log())
                if pid is not None:
                    os.kill(pid, 9)
                    kills += 1
                codes = job.wait(300)
            else:
                victim, where, pid = None, "no kill: runs to the end", None
                codes = job.wait(1200)
            log = job.head_log()
            job.stop()
            resumed = RESUMED.findall(log)
            got = int(resumed[-1][1]) if resumed else None
            if got != expected:
                wrong += 1
            if "is not a complete checkpoint" in log or "missing or truncated" in log:
                partial_loads += 1
            rows.append(
                (attempt, victim, where if pid else "worker not found", expected, got, codes[0])
            )
            print(
                f"attempt {attempt}: resumed {got} (newest complete {expected}), "
                f"killed rank {victim} ({where}), head exit {codes[0]}",
                flush=True,
            )
            attempt += 1
            if kills >= args.kills and codes == [0, 0, 0]:
                break
            if attempt > args.kills * 3:
                raise SystemExit("too many attempts")
        got_rewards = store_rewards(fs, f"{root}/runs/{TASK_ID}/metrics.jsonl")

        # 4. resume at 2 ranks
        final = newest_in_store(fs, run)
        two = Job(
            list(hosts)[:2],
            work,
            recipe_text(root + "-two", args.steps + 2, 2, resume=f"{run}/step-{final:06d}"),
            base,
            "two-ranks",
        )
        two_codes = two.wait(900)
        two_log = two.head_log()
        two.stop()

    print()
    print(f"{'attempt':>7} {'killed':>6}  {'where':<32} {'newest':>6} {'resumed':>7} {'exit':>5}")
    for attempt, victim, where, expected, got, code in rows:
        print(f"{attempt:>7} {victim!s:>6}  {where:<32} {expected!s:>6} {got!s:>7} {code!s:>5}")
    same = got_rewards == want
    print()
    print(
        f"kills: {kills}; resumes that loaded the newest complete checkpoint: "
        f"{len(rows) - wrong} of {len(rows)}; partial loads: {partial_loads}"
    )
    print(f"per-step rewards equal the straight run's: {same} ({len(got_rewards)} steps)")
    trained = re.findall(r"^step (\d+) ", two_log, re.MULTILINE)
    print(
        f"resume at 2 ranks of the 3-rank checkpoint step {final}: exit {two_codes}, "
        f"steps trained {trained}"
    )


if __name__ == "__main__":
    main()
