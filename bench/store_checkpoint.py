"""Seconds per step with a checkpoint every step: to object storage (S3) next to local disk.

    python bench/store_checkpoint.py [--model tiny:qwen2-h512-l4] [--rounds 3] [--steps 8]
                                     [--warmup 2] [--ranks 1]

Each run is a fresh `rlx train` of GRPO on a tiny random model (the synthetic
letters_or_digits task), `checkpoint.every: 1`, so every step ends with a save of the whole
training state (policy, AdamW moments, schedules, RNG, the model's config and tokenizer).
The two sides differ only in `checkpoint.dir`: a folder on this machine's disk (rlx's
rename-into-place protocol with fsyncs), or `s3://` on moto's S3 server running in this
process on loopback (shards staged on local disk, uploaded by each rank, metadata and
COMPLETE last). Runs alternate disk, S3, disk, S3, ... for --rounds rounds.

Seconds per step: the wall time between the metrics lines of consecutive steps (the line is
written when a step ends, the save follows it, so each interval holds one step and one
save), pooled over the runs of a side after --warmup steps; median and p90. The ratio is
S3 over disk, within one run of this script. The S3 server shares the machine's cores with
the trainer, so the figure includes the server's own work; a real store is remote.
Printed with the load average: a figure taken under load is not a result.

Then, how a rank's shard should reach the store: one DCP save of --direct-mib MiB written
straight into S3 (torch's fsspec writer) against staged on local disk and uploaded (what
rlx does), in this process, three times each.
"""

from __future__ import annotations

import argparse
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
sys.path.insert(0, str(REPO))


def recipe(folder: Path, name: str, model: str, steps: int, ckpt: str, ranks: int) -> Path:
    data: dict[str, Any] = {
        "name": name,
        "resources": {"nodes": ranks},
        "trainer": {
            "algorithm": "grpo",
            "model": {"path": model, "dtype": "float32"},
            "data": {"train": "synthetic:letters_or_digits", "max_prompt_length": 64},
            "reward": {"function": "letters_or_digits"},
            "rollout": {"engine": "hf", "n": 8, "max_new_tokens": 16},
            "algo": {"kl": {"coef": 0.0}},
            "batch": {"prompts_per_step": 2, "micro_batch_size": 16},
            "parallel": {"strategy": "fsdp" if ranks > 1 else "auto"},
            "steps": steps,
            "seed": 0,
            "checkpoint": {"dir": ckpt, "every": 1, "keep": 2},
            "logging": {"dir": str(folder / "runs"), "tensorboard": False},
        },
    }
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run(path: Path, run_id: str, env: dict[str, str]) -> list[float]:
    """Seconds between consecutive steps' metrics lines of one `rlx train`."""
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "rlx", "train", str(path)],
        cwd=path.parent,
        env={**env, "RLX_RUN_ID": run_id},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise SystemExit(f"run {run_id} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    lines = (path.parent / "runs" / run_id / "metrics.jsonl").read_text().splitlines()
    times = [json.loads(line)["time"] for line in lines if line.strip()]
    print(f"  {run_id}: {len(times)} steps, {time.perf_counter() - started:.0f} s", flush=True)
    return [b - a for a, b in itertools.pairwise(times)]


def checkpoint_bytes(folder: Path, run_id: str) -> int | None:
    result = folder / "runs" / run_id / "result.json"
    try:
        return json.loads(result.read_text()).get("checkpoint_bytes")
    except (OSError, ValueError):
        return None


def direct_or_staged(prefix: str, mib: int, repeats: int) -> dict[str, list[float]]:
    """Seconds to save one DCP state of `mib` MiB (one rank, float32 tensors of 16 MiB) into
    the store: straight (torch's fsspec writer, each file streamed to the store) or staged
    (written to local disk, then uploaded by rlx's path: one fs.put of every file)."""
    import shutil

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    from rlx.storage import filesystem, storage_options
    from rlx.trainer.checkpoint.training import single_process_quiet

    count = max(mib // 16, 1)
    state = {f"t{i}": torch.randn(4 * 2**20) for i in range(count)}
    fs, base = filesystem(prefix)
    times: dict[str, list[float]] = {"straight": [], "staged": []}
    with single_process_quiet():
        for i in range(repeats):
            url = f"{prefix}/direct-{i}"
            started = time.perf_counter()
            dcp.save(state, storage_writer=FsspecWriter(url, **storage_options(url)), no_dist=True)
            times["straight"].append(time.perf_counter() - started)
            local = Path(tempfile.mkdtemp(prefix="rlx-bench-stage-"))
            started = time.perf_counter()
            dcp.save(
                state,
                storage_writer=dcp.FileSystemWriter(str(local), sync_files=True),
                no_dist=True,
            )
            names = sorted(p.name for p in local.iterdir())
            fs.put([str(local / n) for n in names], [f"{base}/staged-{i}/{n}" for n in names])
            times["staged"].append(time.perf_counter() - started)
            shutil.rmtree(local, ignore_errors=True)
    return times


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny:qwen2-h512-l4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--direct-mib", type=int, default=256, help="state size, 0: skip")
    args = parser.parse_args()

    from tests.support.stores import s3_server

    load_before = os.getloadavg()
    results: dict[str, list[float]] = {"disk": [], "s3": []}
    sizes: dict[str, int | None] = {}
    with tempfile.TemporaryDirectory(prefix="rlx-bench-store-") as tmp, s3_server() as s3:
        folder = Path(tmp)
        prefix = s3.new_prefix("bench")
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RLX_"))},
            **s3.env,
            "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "RLX_STAGING_DIR": str(folder / "staging"),
            "OMP_WAIT_POLICY": "PASSIVE",
        }
        where = {"disk": str(folder / "ckpt"), "s3": f"{prefix}/ckpt"}
        direct: dict[str, list[float]] = {}
        if args.direct_mib:
            for key, value in s3.env.items():
                os.environ[key] = value
            direct = direct_or_staged(prefix, args.direct_mib, 3)
        for round_ in range(args.rounds):
            for side in ("disk", "s3"):
                name = f"bench-{side}"
                path = recipe(folder, name, args.model, args.steps, where[side], args.ranks)
                run_id = f"{side}-{round_}"
                results[side] += run(path, run_id, env)[args.warmup :]
                sizes[side] = checkpoint_bytes(folder, run_id)
    load_after = os.getloadavg()

    print()
    print(
        f"checkpoint every step, {args.model}, {args.ranks} rank(s), {args.rounds} rounds x "
        f"{args.steps} steps ({args.warmup} dropped per run), {os.cpu_count()} CPUs"
    )
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    size = sizes.get("disk")
    print(f"checkpoint size: {size / 2**20:.1f} MiB" if size else "checkpoint size: unknown")
    print()
    print(f"{'where':<8} {'s/step median':>14} {'p90':>8} {'steps':>6}")
    for side in ("disk", "s3"):
        values = results[side]
        print(f"{side:<8} {statistics.median(values):>14.3f} {p90(values):>8.3f} {len(values):>6}")
    ratio = statistics.median(results["s3"]) / statistics.median(results["disk"])
    print()
    print(f"S3 / disk (median seconds per step): {ratio:.2f}x (target <= 1.2x)")
    if direct:
        print()
        print(f"one DCP save of {args.direct_mib} MiB into S3, 3 times (seconds, median):")
        for way, values in direct.items():
            print(f"  {way:<9} {statistics.median(values):.2f}")


if __name__ == "__main__":
    main()
