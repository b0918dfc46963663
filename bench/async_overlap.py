"""Rollouts during training: seconds per step and learning speed at max_staleness 0, 1, 2.

    python bench/async_overlap.py [--rounds 3] [--steps 14] [--warmup 4] [--ks 0 1 2]
    python bench/async_overlap.py --learn [--rounds 1] [--steps 60]
    python bench/async_overlap.py --recipe tool-lookup [--ks 0 1]

The run is recipes/quickstart-vllm.yaml (GRPO, tiny Qwen2, vLLM's CPU build) in the split
layout: one vLLM engine in a rollout actor and one training worker. On 2 cores each side
gets a core of its own, so an overlap shows as it would on GPUs of their own:
  - the engine's OpenMP threads are bound to core 0 by vLLM itself
    (VLLM_CPU_OMP_THREADS_BIND=0), and every thread of its actor process and of the
    processes below it (vLLM's engine core and model worker) is pinned there;
  - the training worker runs one torch thread (RLX_NUM_THREADS=1) and every thread of its
    process is pinned to core 1 (os.sched_setaffinity on each /proc/PID/task entry, once the
    actors are up; the pids come from the workers' own host_memory() report).
The controller, Ray's daemons and the reward are not pinned (they are light).

--recipe tool-lookup times recipes/tool-lookup.yaml's multi-turn episodes instead (three
turns each, the engine vLLM's as above): at k > 0 the turns of the steps ahead are played
while the learner updates.

Timing (the default): validation off, `--steps` steps per run, the first `--warmup` dropped;
seconds per step are the gaps between the ends of consecutive steps in metrics.jsonl. Runs
alternate k = 0, 1, 2, 0, 1, 2, ... (interleaved, so a drift of the machine hits every k);
the table gives each k's median over its runs' medians and the ratio to k = 0.

--learn: the quickstart's own settings (80 steps, validation of 32 held-out prompts every
10 steps; here every 5) at k = 0 and k = 1, interleaved: the wall time from the first step
until validation pass@1, and the validation reward mean, first reach 0.4; and the mean
training reward of the last 10 steps (equal samples: both train the same prompts, the same
number of times).

It is a measurement, not a test: nothing passes or fails. Print the load average: a figure
taken while something else runs is not a result.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
RECIPES = {"quickstart-vllm": "quickstart-vllm.yaml", "tool-lookup": "tool-lookup.yaml"}
PASS_TARGET = 0.4
# Greedy pass@1 of this task jumps to 0.5 once the greedy answer is all letters or all
# digits (half the prompts); the validation reward mean (share of requested characters
# over n samples) is the slower, finer curve. Both are timed.
VALIDATION_KEYS = ("val/pass@1", "val/reward_mean")


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def descendants(pid: int) -> list[int]:
    """pid and every process below it (vLLM runs its engine core and its model worker as
    processes of their own under the actor)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                parent = int(stat.rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def pin(pid: int, core: int) -> int:
    """Every thread of process pid and of its descendants onto one core (affinity is per
    thread). Returns how many processes were pinned."""
    processes = descendants(pid)
    for process in processes:
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{process}/task"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(task), {core})
    return len(processes)


def recipe_for(k: int, steps: int, learn: bool, out: Path, name: str) -> Any:
    from rlx.recipe import parse_recipe

    path = REPO / "recipes" / RECIPES[name]
    data = yaml.safe_load(path.read_text())
    trainer = data["trainer"]
    trainer["rollout"]["engine"] = "vllm"
    trainer["layout"] = "split"
    trainer["rollout_gpus"] = 1  # on CPU: one rollout actor
    trainer["rollout"]["max_staleness"] = k
    trainer["steps"] = steps
    trainer.pop("checkpoint", None)  # no saves: the step time is the loop's own
    trainer["logging"] = {"dir": str(out / "runs"), "tensorboard": False}
    if learn:
        trainer["validation"]["every"] = 5
    else:
        trainer.pop("validation")
    return parse_recipe(json.dumps(data), path.name).recipe


def child(k: int, steps: int, learn: bool, out: Path, name: str) -> None:
    """One run in this process; writes its metrics file's path to stdout's last line."""
    os.environ["RLX_NUM_THREADS"] = "1"
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0"
    from rlx.trainer.main import trainer_for

    env = {k_: v for k_, v in os.environ.items() if k_ != "RAY_ADDRESS"}  # a private Ray
    env["RLX_RUN_ID"] = f"k{k}"
    log = io.StringIO()
    with trainer_for(recipe_for(k, steps, learn, out, name), env, log) as trainer:
        cluster = trainer.cluster
        (_, train_pid, _), (_, engine_pid, _) = cluster.worker_memory()  # train, then rollout
        pin(engine_pid, 0)
        pin(train_pid, 1)
        started = time.time()
        trainer.run()
    print(json.dumps({"metrics": str(trainer.logger.jsonl_path), "started": started}))


def one_run(k: int, steps: int, learn: bool, name: str) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="bench-async-") as scratch:
        command = [
            sys.executable,
            __file__,
            "--child",
            str(k),
            "--steps",
            str(steps),
            "--out",
            scratch,
            "--recipe",
            name,
        ] + (["--learn"] if learn else [])
        done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
        if done.returncode != 0:
            sys.exit(f"k={k}: the run failed:\n{done.stderr[-3000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        records = [json.loads(line) for line in Path(result["metrics"]).read_text().splitlines()]
        for record in records:
            record["_started"] = result["started"]
        return records


def step_seconds(records: list[dict[str, Any]], warmup: int) -> list[float]:
    ends = [r["time"] for r in records if r["step"] > 0]
    return [b - a for a, b in itertools.pairwise(ends)][warmup - 1 :]


def timing(args: argparse.Namespace) -> None:
    medians: dict[int, list[float]] = {k: [] for k in args.ks}
    for round_index in range(args.rounds):
        for k in args.ks:
            before = load_average()
            records = one_run(k, args.steps, learn=False, name=args.recipe)
            seconds = step_seconds(records, args.warmup)
            medians[k].append(statistics.median(seconds))
            stale = max(r.get("staleness/max", 0.0) for r in records)
            print(
                f"round {round_index + 1} k={k}: median {medians[k][-1]:.3f} s/step over "
                f"{len(seconds)} steps (max staleness {stale:.0f}), load before {before} "
                f"after {load_average()}",
                flush=True,
            )
    base = statistics.median(medians[args.ks[0]])
    print(f"\n{'max_staleness':<14} {'s/step':>8} {'runs':>24} {'ratio':>7}")
    for k in args.ks:
        figure = statistics.median(medians[k])
        runs = " ".join(f"{m:.3f}" for m in medians[k])
        print(f"{k:<14} {figure:>8.3f} {runs:>24} {figure / base:>6.2f}x")


def first_reaching(records: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
    return next((r for r in records if r["step"] > 0 and r.get(key, 0.0) >= PASS_TARGET), None)


def learning(args: argparse.Namespace) -> None:
    rows = []
    for round_index in range(args.rounds):
        for k in args.ks:
            before = load_average()
            records = one_run(k, args.steps, learn=True, name=args.recipe)
            started = records[0]["_started"]
            reached = {key: first_reaching(records, key) for key in VALIDATION_KEYS}
            seconds = {
                key: None if record is None else record["time"] - started
                for key, record in reached.items()
            }
            rewards = [r["reward/mean"] for r in records if "reward/mean" in r]
            last = statistics.mean(rewards[-10:])
            rows.append((k, seconds, last))
            when = ", ".join(
                f"{key} >= {PASS_TARGET} after "
                + ("never" if record is None else f"{seconds[key]:.0f} s (step {record['step']})")
                for key, record in reached.items()
            )
            print(
                f"round {round_index + 1} k={k}: {when}; mean reward of the last 10 steps "
                f"{last:.3f}; load before {before} after {load_average()}",
                flush=True,
            )
    header = "".join(f"{'s to ' + key + '>=' + str(PASS_TARGET):>28}" for key in VALIDATION_KEYS)
    print(f"\n{'max_staleness':<14}{header} {'last-10 reward':>15}")
    for k in args.ks:
        mine = [row for row in rows if row[0] == k]
        cells = ""
        for key in VALIDATION_KEYS:
            times = [row[1][key] for row in mine if row[1][key] is not None]
            cells += f"{(f'{statistics.median(times):.1f}' if times else 'never'):>28}"
        print(f"{k:<14}{cells} {statistics.median(row[2] for row in mine):>15.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--ks", type=int, nargs="+", default=None)
    parser.add_argument("--learn", action="store_true")
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="quickstart-vllm")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    if args.child is not None:
        child(args.child, args.steps, args.learn, args.out, args.recipe)
        return
    args.rounds = args.rounds or 3
    args.steps = args.steps or (80 if args.learn else 14)
    args.ks = args.ks or ([0, 1] if args.learn else [0, 1, 2])
    print(
        f"{'learning' if args.learn else 'timing'}: {args.recipe}, layout split, engine on "
        f"core 0, learner on core 1; {args.rounds} rounds x {args.steps} steps; "
        f"{os.cpu_count()} cores; load {load_average()}",
        flush=True,
    )
    (learning if args.learn else timing)(args)


if __name__ == "__main__":
    main()
