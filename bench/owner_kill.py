"""`kill -9` of `rlx launch` at step 3, tried again and again: how long until every process
of its run is gone, and whether the next launch starts clean.

    python bench/owner_kill.py [--tries 5] [--engines hf,vllm]

Each try launches recipes/quickstart.yaml (hf) or quickstart-vllm.yaml (vllm, vLLM's CPU
build) on the local backend in a fresh folder, waits for its console's
`step 3` line, sends SIGKILL to `rlx launch` alone (as the OOM killer, a closed terminal or a
scheduler would), and times how long the run's processes (rlx.owner's mark: Ray's daemons
with SIGTERM blocked, its workers, the actors, vLLM's engine processes) take to go. The
product's bound is rlx.owner.END_BOUND_S. After the last try of an engine, one more launch
runs the quickstart for 3 steps to its end: the next launch after the kills starts clean.

Prints one row per engine: tries, the worst and median seconds until everything was gone,
how many tries left a process past twice the bound, and the clean launch's exit code. Print
the load average: a figure taken under load is not a result. It is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rlx import owner, procfs  # noqa: E402


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def recipe_for(engine: str, folder: Path, steps: int) -> Path:
    shipped = "quickstart-vllm.yaml" if engine == "vllm" else "quickstart.yaml"
    data = yaml.safe_load((REPO / "recipes" / shipped).read_text())
    trainer = data["trainer"]
    assert trainer["rollout"].get("engine", "hf") == engine, shipped
    trainer["steps"] = steps
    trainer.pop("validation", None)
    path = folder / f"quickstart-{engine}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def env() -> dict[str, str]:
    out = dict(os.environ)
    out["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{out.get('PATH', '')}"
    out["PYTHONUNBUFFERED"] = "1"
    out.pop(owner.OWNER_ENV, None)
    return out


def tokens_of(pid: int) -> set[str]:
    return {
        token
        for other in procfs.pids()
        for token in owner._tokens(owner._environ(other))
        if token.startswith(f"{pid}-")
    }


def one_kill(recipe: Path, folder: Path) -> float | None:
    """Seconds from the SIGKILL to the last of the run's processes gone; None past 2x the
    bound (what was left is killed, so the next try starts clean)."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "rlx", "launch", str(recipe)],
        cwd=folder,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in launcher.stdout], daemon=True).start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 900
        while not any(line.startswith("step 3 ") for line in seen):
            if launcher.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("".join(seen[-40:]) + "\nthe launch never reached step 3")
            with contextlib.suppress(queue.Empty):
                seen.append(lines.get(timeout=1))
        (token,) = tokens_of(launcher.pid)
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
    killed = time.monotonic()
    limit = 2 * owner.END_BOUND_S
    while owner.carrying(token) and time.monotonic() - killed < limit:
        time.sleep(0.05)
    gone = time.monotonic() - killed
    left = owner.carrying(token)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return None if left else gone


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tries", type=int, default=5)
    parser.add_argument("--engines", default="hf,vllm")
    args = parser.parse_args()
    print(f"load average before: {load()}; bound {owner.END_BOUND_S:.0f} s")
    rows = []
    for engine in args.engines.split(","):
        times: list[float | None] = []
        for attempt in range(args.tries):
            with tempfile.TemporaryDirectory(prefix=f"rlx-kill-{engine}-") as work:
                folder = Path(work)
                times.append(one_kill(recipe_for(engine, folder, 200), folder))
            print(f"{engine} try {attempt + 1}: {times[-1]}", flush=True)
        with tempfile.TemporaryDirectory(prefix=f"rlx-clean-{engine}-") as work:
            folder = Path(work)
            clean = subprocess.run(
                [sys.executable, "-m", "rlx", "launch", str(recipe_for(engine, folder, 3))],
                cwd=folder,
                env=env(),
                capture_output=True,
                text=True,
                timeout=900,
            ).returncode
        done = [t for t in times if t is not None]
        rows.append(
            (
                engine,
                len(times),
                max(done) if done else float("nan"),
                statistics.median(done) if done else float("nan"),
                len(times) - len(done),
                clean,
            )
        )
    print(
        f"{'engine':<7} {'tries':>5} {'worst s':>8} {'median s':>9} {'left':>5} {'next launch':>12}"
    )
    for engine, tries, worst, median, left, clean in rows:
        print(
            f"{engine:<7} {tries:>5} {worst:>8.2f} {median:>9.2f} {left:>5} "
            f"{'exit ' + str(clean):>12}"
        )
    print(f"load average after: {load()}")


if __name__ == "__main__":
    main()
