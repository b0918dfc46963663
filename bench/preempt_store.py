"""SIGTERM to every process of a run whose checkpoints live in S3, as a spot reclaim or a VM
shutdown delivers it: the step done is in the store before the run exits 75, within the
grace, and the resumed run loses no step.

    python bench/preempt_store.py [--where local,hosts] [--tries 10] [--steps 16] [--at 9]
                                  [--only-nodes]

Needs moto's S3 server (started here); `hosts` needs root (emulated hosts,
tests/support/hosts). Both trains with a cadence checkpoint every 10 steps, so the step
saved at the signal is the stop's own save.

- local: `rlx launch` (the local backend, a private Ray, one rank). Once it has logged step
  --at, SIGTERM goes at the same moment to it and every descendant: Ray's GCS, raylet,
  agents and the workers that host the actors.
- hosts: SkyPilot's rendered run block on each of 3 emulated hosts (`exec rlx node --backend
  sky`), one FSDP rank per host. Once the head has logged step --at, SIGTERM goes at the same
  moment to every process on every host (all but each host's PID 1): the node processes,
  Ray's daemons, the trainer and the actors' workers. --only-nodes signals only the node
  processes instead (a scheduler's cancel).

Measured per try: seconds from the signal to the checkpoint being complete in the store (the
trainer's own line) and to each node's exit; exit codes; whether the newest complete step in
the store is the last step the run logged. Then the run is started again with the same run
id: it must resume from there, and its per-step rewards must equal a straight run's. Each
try uses a fresh run. Prints a table and the load average before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from chaos_store import TASK_ID, Job, host_env, newest_in_store, store_rewards  # noqa: E402
from chaos_store import recipe_text as chaos_recipe  # noqa: E402

from rlx import procfs  # noqa: E402

STOPPING = re.compile(r"stopping on SIGTERM: step (\d+) is in \S+, ([0-9.]+) s after the signal")
RESUMED = re.compile(r"resumed from \S+ \(step (\d+)\)")
EXIT_WAIT = 120.0  # how long a try waits for the nodes to exit before it says so


def recipe_text(root: str, steps: int, nodes: int) -> str:
    """chaos_store's run, with a cadence checkpoint every 10 steps instead of every step."""
    return chaos_recipe(root, steps, nodes, every=10)


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def tree(root: int) -> set[int]:
    """`root` and every descendant it has now."""
    parents = procfs.parents()
    found = {root}
    while grown := {pid for pid, ppid in parents.items() if ppid in found} - found:
        found |= grown
    return found


def sigterm_all(pids: set[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


class LocalRun:
    """`rlx launch` on this machine, in a session of its own, output to a file."""

    def __init__(self, work: Path, text: str, env: dict[str, str], run_id: str, name: str):
        recipe = work / f"{name}.yaml"
        recipe.write_text(text)
        self.log = work / f"{name}.log"
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rlx", "launch", str(recipe)],
                env={**env, "RLX_RUN_ID": run_id},
                cwd=work,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs = [self.proc]

    def head_log(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float) -> list[int | None]:
        try:
            return [self.proc.wait(timeout=timeout)]
        except subprocess.TimeoutExpired:
            return [None]

    def stop(self) -> None:
        if self.proc.poll() is None:
            for pid in tree(self.proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.proc.wait()


def wait_for_step(job: Any, step: int) -> None:
    deadline = time.monotonic() + 900
    while not re.search(rf"^step {step} ", job.head_log(), re.MULTILINE):
        if time.monotonic() > deadline or any(p.poll() is not None for p in job.procs):
            raise SystemExit(f"no step {step}:\n{job.head_log()[-3000:]}")
        time.sleep(0.05)


def preempt(job: Any, everyone: Callable[[], set[int]]) -> tuple[list[float | None], list]:
    """SIGTERM to every process `everyone` names, at once; seconds to each node's exit."""
    pids = everyone()
    signalled = time.monotonic()
    sigterm_all(pids)
    exits: list[float | None] = [None] * len(job.procs)
    while any(e is None for e in exits) and time.monotonic() - signalled < EXIT_WAIT:
        for rank, proc in enumerate(job.procs):
            if exits[rank] is None and proc.poll() is not None:
                exits[rank] = time.monotonic() - signalled
        time.sleep(0.05)
    return exits, [proc.poll() for proc in job.procs]


def one_try(
    where: str,
    start: Callable[[str, str], Any],
    everyone: Callable[[Any], set[int]],
    fs: Any,
    root: str,
    at: int,
    want: list,
    try_: int,
) -> dict[str, Any]:
    job = start(root, f"{where}-try{try_}")
    wait_for_step(job, at)
    exits, codes = preempt(job, lambda: everyone(job))
    log = job.head_log()
    job.stop()
    logged = [int(x) for x in re.findall(r"^step (\d+) ", log, re.MULTILINE)]
    stopping = STOPPING.search(log)
    newest = newest_in_store(fs, f"{root}/ckpt/chaos")
    resumed = start(root, f"{where}-try{try_}-resumed")
    resumed_codes = resumed.wait(1200)
    resumed_log = resumed.head_log()
    resumed.stop()
    got = store_rewards(fs, f"{root}/runs/chaos/metrics.jsonl")
    found = RESUMED.search(resumed_log)
    return {
        "where": where,
        "try": try_,
        "last logged": max(logged) if logged else None,
        "newest complete": newest,
        "durable s": float(stopping[2]) if stopping else None,
        "exits s": exits,
        "codes": codes,
        "resumed from": int(found[1]) if found else None,
        "resume codes": resumed_codes,
        "rewards equal": got == want,
    }


def straight_rewards(start: Callable[[str, str], Any], fs: Any, root: str, where: str) -> list:
    job = start(root, f"{where}-straight")
    codes = job.wait(1200)
    job.stop()
    if any(code != 0 for code in codes):
        raise SystemExit(f"the straight run failed: {codes}\n{job.head_log()[-3000:]}")
    return store_rewards(fs, f"{root}/runs/chaos/metrics.jsonl")


def run_local(args: argparse.Namespace, work: Path, s3: Any, rows: list) -> None:
    fs = s3.filesystem()
    env = host_env(work, s3)
    env["RLX_STAGING_DIR"] = str(work / "staging-local")

    def start(root: str, name: str) -> LocalRun:
        # Each try has a bucket of its own, so one run id (SkyPilot's task id on the hosts)
        # does: its retry continues that run.
        return LocalRun(work, recipe_text(root, args.steps, 1), env, TASK_ID, name)

    want = straight_rewards(start, fs, s3.new_prefix("local-straight"), "local")
    for try_ in range(args.tries):
        root = s3.new_prefix(f"local{try_}")
        row = one_try("local", start, lambda job: tree(job.proc.pid), fs, root, args.at, want, try_)
        rows.append(row)
        print(row_line(row), flush=True)


def run_hosts(args: argparse.Namespace, work: Path, hosts: Any, s3: Any, rows: list) -> None:
    fs = s3.filesystem()
    base = host_env(work, s3)

    def start(root: str, name: str) -> Job:
        return Job(hosts, work, recipe_text(root, args.steps, len(hosts)), base, name)

    def everyone(job: Job) -> set[int]:
        if args.only_nodes:
            return {p.pid for h in hosts for p in h.processes() if "rlx node" in p.cmdline}
        return {p.pid for host in hosts for p in host.processes()}

    want = straight_rewards(start, fs, s3.new_prefix("hosts-straight"), "hosts")
    for try_ in range(args.tries):
        root = s3.new_prefix(f"hosts{try_}")
        rows.append(one_try("hosts", start, everyone, fs, root, args.at, want, try_))
        print(row_line(rows[-1]), flush=True)


def seconds(values: list[float | None]) -> str:
    return " ".join("-" if v is None else f"{v:.1f}" for v in values)


def row_line(row: dict[str, Any]) -> str:
    durable = "-" if row["durable s"] is None else f"{row['durable s']:.1f}"
    return (
        f"{row['where']:<6} {row['try']:>3} {row['last logged']!s:>6} "
        f"{row['newest complete']!s:>7} {durable:>9} {seconds(row['exits s']):>16} "
        f"{' '.join(map(str, row['codes'])):>10} {row['resumed from']!s:>8} "
        f"{' '.join(map(str, row['resume codes'])):>8} {row['rewards equal']!s:>8}"
    )


HEADER = (
    f"{'where':<6} {'try':>3} {'logged':>6} {'durable':>7} {'after s':>9} "
    f"{'node exits s':>16} {'codes':>10} {'resumed':>8} {'retry':>8} {'rewards':>8}"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--where", default="local,hosts")
    parser.add_argument("--tries", type=int, default=10)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--at", type=int, default=9)
    parser.add_argument("--only-nodes", action="store_true")
    args = parser.parse_args()

    from tests.support.stores import s3_server

    work = Path(os.environ.get("PREEMPT_DIR") or f"/tmp/rlx-preempt-{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    (work / "home").mkdir(exist_ok=True)
    before = load()
    print(f"load average {before}; work in {work}", flush=True)
    print(HEADER, flush=True)
    rows: list[dict[str, Any]] = []
    wheres = args.where.split(",")
    if "local" in wheres:
        with s3_server() as s3:
            run_local(args, work, s3, rows)
    if "hosts" in wheres:
        from tests.support.hosts.netns import Hosts

        with Hosts.create(3) as hosts, s3_server(hosts.bridge_ip) as s3:
            run_hosts(args, work, hosts, s3, rows)

    who = "the node processes" if args.only_nodes else "every process"
    print()
    print(f"SIGTERM to {who} of the run at step {args.at} of {args.steps} (cadence every 10)")
    print(f"load average before {before}, after {load()}")
    print(HEADER)
    for row in rows:
        print(row_line(row))
    for where in dict.fromkeys(row["where"] for row in rows):
        mine = [row for row in rows if row["where"] == where]
        good = [
            row
            for row in mine
            if row["durable s"] is not None
            and row["newest complete"] == row["last logged"]
            and all(e is not None and e < 25 for e in row["exits s"])
            and all(code == 75 for code in row["codes"])
            and row["resumed from"] == row["newest complete"]
            and all(code == 0 for code in row["resume codes"])
            and row["rewards equal"]
        ]
        print(
            f"{where}: {len(good)}/{len(mine)} tries saved the step done, every node exited "
            "75 within 25 s, and the retry resumed there with a straight run's rewards"
        )


if __name__ == "__main__":
    main()
