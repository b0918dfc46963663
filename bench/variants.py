"""The quickstart with each loss variant: does it learn as the default does?

Runs recipes/quickstart.yaml (same seed, same prompts) once per variant, each a private
`rlx train` on this machine, and prints the mean reward at a few steps, the mean of the
first and last ten steps, and what dynamic sampling did. Learning, not speed, is measured:
two runs go at once.

    python bench/variants.py [--steps 80] [--only default,gspo]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "gspo": {
        "algo": {"policy_loss": "gspo", "loss_agg": "seq-mean-token-mean"},
    },
    "cispo": {"algo": {"policy_loss": "cispo"}},
    "dr-grpo": {"algo": {"loss_agg": "seq-mean-token-sum-norm", "norm_adv_by_std": False}},
    "reinforce++-baseline": {"algorithm": "reinforce_pp", "algo": {"baseline": "group"}},
    "dynamic-sampling": {"batch": {"filter_groups": {"max_rounds": 4}}},
    "dapo": {
        "algo": {"clip_eps_high": 0.28, "overlong": {"buffer": 8}},
        "batch": {"filter_groups": {"max_rounds": 4}},
    },
}
SHOWN_STEPS = (1, 10, 20, 40, 60, 80)


def merged(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def run(name: str, steps: int, folder: Path) -> list[dict[str, Any]]:
    recipe = yaml.safe_load((REPO / "recipes" / "quickstart.yaml").read_text())
    trainer = merged(recipe["trainer"], VARIANTS[name])
    trainer["steps"] = steps
    trainer["validation"] = None
    trainer["checkpoint"] = {}
    trainer["logging"] = {"dir": str(folder / "runs"), "tensorboard": False}
    recipe["trainer"] = trainer
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    env = {**os.environ, "RLX_RUN_ID": name}
    done = subprocess.run(
        [sys.executable, "-m", "rlx", "train", str(path)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{name}: rlx train exited {done.returncode}\n{done.stderr[-2000:]}")
    lines = (folder / "runs" / name / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "reward/mean" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--only", default=",".join(VARIANTS))
    args = parser.parse_args()
    names = args.only.split(",")
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    with (
        tempfile.TemporaryDirectory(prefix="rlx-variants-") as scratch,
        ThreadPoolExecutor(max_workers=2) as pool,
    ):
        runs = pool.map(lambda name: run(name, args.steps, Path(scratch)), names)
        records = dict(zip(names, runs, strict=True))
    shown = [s for s in SHOWN_STEPS if s <= args.steps]
    print(
        "| variant | "
        + " | ".join(f"step {s}" for s in shown)
        + " | first 10 | last 10 | rounds | kept/step |"
    )
    print("|---" * (len(shown) + 5) + "|")
    for name, rows in records.items():
        by_step = {r["step"]: r for r in rows}
        rewards = [r["reward/mean"] for r in rows]
        first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
        rounds = [r.get("batch/sampling_rounds") for r in rows if "batch/sampling_rounds" in r]
        kept = [r.get("batch/kept_groups") for r in rows if "batch/kept_groups" in r]
        cells = [f"{by_step[s]['reward/mean']:.3f}" for s in shown]
        extra = (
            f"{sum(rounds) / len(rounds):.2f} | {min(kept):.0f}-{max(kept):.0f}"
            if rounds
            else "- | -"
        )
        print(f"| {name} | " + " | ".join(cells) + f" | {first:.3f} | {last:.3f} | {extra} |")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
