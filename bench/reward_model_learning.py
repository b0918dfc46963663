"""Does the policy learn from a reward model, and learn what the reward model was taught?

Makes the digits reward model (rlx.trainer.tasks.preferences: a tiny classifier trained here
on preference pairs that prefer the response with more digits), then launches
recipes/quickstart-rm.yaml with it through `rlx launch` (local backend), once with GRPO and
once with PPO, and prints, for the reward model's score (reward/rm/mean) and for the property
it was taught (reward/digit_share/mean, a weight-0 monitor), the mean of the first and the
last ten steps.

    python bench/reward_model_learning.py [--steps 60] [--only grpo,ppo]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
SCORES = ("reward/rm/mean", "reward/digit_share/mean")


def launch(algorithm: str, steps: int, model: Path, folder: Path) -> list[dict[str, Any]]:
    recipe = yaml.safe_load((REPO / "recipes" / "quickstart-rm.yaml").read_text())
    trainer = recipe["trainer"]
    trainer["algorithm"] = algorithm
    trainer["steps"] = steps
    trainer["rewards"][0]["model"] = str(model)
    trainer["checkpoint"] = {}
    trainer["logging"] = {"dir": str(folder / algorithm), "tensorboard": False}
    recipe["name"] = f"rm-{algorithm}"
    path = folder / f"{algorithm}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "rlx", "launch", str(path), "--backend", "local"],
        cwd=folder,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{algorithm}: rlx launch exited {done.returncode}\n{done.stderr[-3000:]}")
    print(f"{algorithm}: {steps} steps in {time.monotonic() - started:.0f} s")
    found = sorted((folder / algorithm).glob("*/metrics.jsonl"))
    rows = [json.loads(line) for line in found[-1].read_text().splitlines()]
    return [row for row in rows if SCORES[0] in row]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--only", default="grpo,ppo")
    args = parser.parse_args()
    from rlx.trainer.tasks.preferences import train_reward_model

    print(f"load average before: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory(prefix="rlx-rm-learning-") as scratch:
        folder = Path(scratch)
        started = time.monotonic()
        model, accuracy = train_reward_model(folder / "digits-rm")
        print(
            f"reward model: {accuracy:.1%} of held-out pairs ordered right "
            f"({time.monotonic() - started:.0f} s to make)"
        )
        runs = {name: launch(name, args.steps, model, folder) for name in args.only.split(",")}
    print("| run | score | first 10 | last 10 | change |")
    print("|---|---|---:|---:|---:|")
    for name, rows in runs.items():
        for key in SCORES:
            values = [row[key] for row in rows]
            first, last = sum(values[:10]) / 10, sum(values[-10:]) / 10
            print(f"| {name} | {key} | {first:.3f} | {last:.3f} | {last - first:+.3f} |")
    print(f"load average after: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
