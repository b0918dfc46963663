"""SIGTERM to every node of a 3-host FSDP run whose checkpoints live in S3: the step done is
in the store before the job exits 75, within the grace, and the resumed run loses no step.

    python bench/preempt_store.py [--steps 24] [--at 9] [--rounds 3]

Needs root (emulated hosts, tests/support/hosts) and moto's S3 server on the hosts' bridge.
SkyPilot's rendered run block runs on each host (`exec rlx node --backend sky`), the head
trains one FSDP rank per host with a cadence checkpoint every 10 steps. Once the head has
logged step --at, every host's node process gets SIGTERM at the same moment, as a
preemption or a cancel delivers it. Measured: seconds from the signal to the checkpoint being
complete in the store (the trainer's own line) and to each node's exit; exit codes; whether
the newest complete step in the store is the last step the run logged. Then the job is
started again with the same run id: it must resume there, and its per-step rewards must
equal a straight run's. --rounds repeats the preemption (each on a fresh run id).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from chaos_store import Job, host_env, newest_in_store, store_rewards  # noqa: E402
from chaos_store import recipe_text as chaos_recipe  # noqa: E402

STOPPING = re.compile(r"stopping on SIGTERM: step (\d+) is in \S+, ([0-9.]+) s after the signal")


def recipe_text(root: str, steps: int) -> str:
    """chaos_store's run, with a cadence checkpoint every 10 steps instead of every step."""
    return chaos_recipe(root, steps, 3, every=10)


def node_process(host) -> int | None:
    for proc in host.processes():
        if "rlx node --backend sky" in proc.cmdline:
            return proc.pid
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--at", type=int, default=9)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from tests.support.hosts.netns import Hosts
    from tests.support.stores import s3_server

    work = Path(os.environ.get("PREEMPT_DIR") or f"/tmp/rlx-preempt-{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    (work / "home").mkdir(exist_ok=True)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; work in {work}")
    rows = []
    with Hosts.create(3) as hosts, s3_server(hosts.bridge_ip) as s3:
        base = host_env(work, s3)
        fs = s3.filesystem()

        straight = s3.new_prefix("straight")
        job = Job(hosts, work, recipe_text(straight, args.steps), base, "straight")
        codes = job.wait(1200)
        job.stop()
        if codes != [0, 0, 0]:
            raise SystemExit(f"the straight run failed: {codes}\n{job.head_log()[-3000:]}")
        want = store_rewards(fs, f"{straight}/runs/chaos/metrics.jsonl")

        for round_ in range(args.rounds):
            root = s3.new_prefix(f"preempt{round_}")
            text = recipe_text(root, args.steps)
            job = Job(hosts, work, text, base, f"preempt{round_}")
            deadline = time.monotonic() + 900
            while not re.search(rf"^step {args.at} ", job.head_log(), re.MULTILINE):
                if time.monotonic() > deadline or any(p.poll() is not None for p in job.procs):
                    raise SystemExit(f"no step {args.at}:\n{job.head_log()[-3000:]}")
                time.sleep(0.05)
            pids = [node_process(host) for host in hosts]
            signalled = time.monotonic()
            for pid in pids:
                if pid is not None:
                    os.kill(pid, 15)
            exits: list[float | None] = [None] * 3
            while any(e is None for e in exits) and time.monotonic() - signalled < 120:
                for rank, proc in enumerate(job.procs):
                    if exits[rank] is None and proc.poll() is not None:
                        exits[rank] = time.monotonic() - signalled
                time.sleep(0.05)
            codes = [proc.poll() for proc in job.procs]
            log = job.head_log()
            job.stop()
            logged = [int(x) for x in re.findall(r"^step (\d+) ", log, re.MULTILINE)]
            stopping = STOPPING.search(log)
            newest = newest_in_store(fs, f"{root}/ckpt/chaos")
            resumed = Job(hosts, work, text, base, f"resumed{round_}")
            resumed_codes = resumed.wait(1200)
            resumed_log = resumed.head_log()
            resumed.stop()
            got = store_rewards(fs, f"{root}/runs/chaos/metrics.jsonl")
            rows.append(
                {
                    "round": round_,
                    "last step logged": max(logged) if logged else None,
                    "newest complete": newest,
                    "durable after s": float(stopping[2]) if stopping else None,
                    "node exits after s": [None if e is None else round(e, 1) for e in exits],
                    "exit codes": codes,
                    "resumed from": (re.findall(r"\(step (\d+)\)", resumed_log) or [None])[-1],
                    "resume exit": resumed_codes,
                    "rewards equal straight": got == want,
                }
            )
            print(json.dumps(rows[-1]), flush=True)

    print()
    print(f"SIGTERM to all 3 nodes at step {args.at} of {args.steps} (cadence every 10):")
    for row in rows:
        lost = (row["last step logged"] or 0) - (row["newest complete"] or 0)
        print(
            f"  round {row['round']}: step {row['newest complete']} durable "
            f"{row['durable after s']} s after the signal, nodes exited after "
            f"{row['node exits after s']} s with {row['exit codes']}; steps lost {lost}; "
            f"resumed from {row['resumed from']} (exit {row['resume exit']}); rewards equal "
            f"a straight run: {row['rewards equal straight']}"
        )


if __name__ == "__main__":
    main()
