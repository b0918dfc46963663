"""A stand-in trainer for multi-node tests: the head command of the test recipes.

It records when it started, what the Ray cluster looks like from the driver (every node
the GCS knows, alive or dead, with its address) and the environment rlx gave it, as JSON in
OUT/probe-<attempt>.json. What it does next comes from OUT/control.json, which the test
writes before each attempt: {"exit": 3} exits with 3; {"hold": true} says so in
OUT/holding-<attempt> and waits until OUT/release exists (or it is killed).
Plain script: the standard library and ray only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import time
from pathlib import Path


def next_attempt(out: Path) -> int:
    taken = {int(p.stem.split("-")[1]) for p in out.glob("started-*")}
    attempt = max(taken, default=0) + 1
    (out / f"started-{attempt}").write_text(f"{time.time():.6f}\n")
    return attempt


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    attempt = next_attempt(out)
    control = json.loads((out / "control.json").read_text())

    import ray

    ray.init(address=os.environ["RAY_ADDRESS"], logging_level="WARNING")
    report = {
        "attempt": attempt,
        "hostname": socket.gethostname(),
        "nodes": [
            {"ip": n["NodeManagerAddress"], "alive": n["Alive"], "id": n["NodeID"]}
            for n in ray.nodes()
        ],
        "cpus": ray.cluster_resources().get("CPU", 0.0),
        # The token's value stays out of the report; whether the driver has one is enough.
        "env": {
            k: v
            for k, v in os.environ.items()
            if k.startswith(("RLX_", "RAY_")) and k not in ("RAY_AUTH_TOKEN", "RLX_RAY_TOKEN")
        },
        "token_set": bool(os.environ.get("RAY_AUTH_TOKEN")),
        # Tells tokens apart across attempts and jobs without writing one down.
        "token_sha256": hashlib.sha256(os.environ.get("RAY_AUTH_TOKEN", "").encode()).hexdigest(),
    }
    ray.shutdown()
    path = out / f"probe-{attempt}.json"
    path.with_suffix(".tmp").write_text(json.dumps(report))
    path.with_suffix(".tmp").rename(path)
    if control.get("hold"):
        (out / f"holding-{attempt}").touch()
        while not (out / "release").exists():
            time.sleep(0.1)
    return int(control.get("exit", 0))


if __name__ == "__main__":
    raise SystemExit(main())
