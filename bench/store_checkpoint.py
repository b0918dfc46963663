"""Seconds per step with a checkpoint every step: to object storage (S3) next to local disk.

    python bench/store_checkpoint.py [--model tiny:qwen2-h512-l4] [--rounds 3] [--steps 8]
                                     [--warmup 2] [--ranks 1] [--every 1]

Each run is a fresh `rlx train` of GRPO on a tiny random model (the synthetic
letters_or_digits task), `checkpoint.every: 1` (or --every), so every step ends with a save
of the whole training state (policy, AdamW moments, schedules, RNG, the model's config and
tokenizer). Into S3 the step pays for staging the shards on local disk; the upload runs
beside the next steps, and the next save waits for it: when one upload takes longer than the
steps between saves, that wait sets the pace.
The two sides differ only in `checkpoint.dir`: a folder on this machine's disk (rlx's
rename-into-place protocol with fsyncs), or `s3://` on moto's S3 server running in this
process on loopback (shards staged on local disk, uploaded by each rank, metadata and
COMPLETE last). Runs alternate disk, S3, disk, S3, ... for --rounds rounds.

Seconds per step: the wall time between the metrics lines of consecutive steps (the line is
written when a step ends, the save follows it, so each interval holds one step and one
save), pooled over the runs of a side after --warmup steps; mean, median and p90. The ratio
is S3 over disk (means: with --every above 1, most steps save nothing), within one run of
this script. The S3 server shares the machine's cores with the trainer, so the figure includes
the server's own work (about 3.8 CPU-seconds per 195 MiB uploaded, more than a step here); a
real store is remote. --own-core gives the server the last CPU and every run (disk and S3
alike) the others.
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


def recipe(
    folder: Path, name: str, model: str, steps: int, ckpt: str, ranks: int, every: int
) -> Path:
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
            "checkpoint": {"dir": ckpt, "every": every, "keep": 2},
            "logging": {"dir": str(folder / "runs"), "tensorboard": False},
        },
    }
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run(path: Path, run_id: str, env: dict[str, str], cpus: set[int] | None) -> list[float]:
    """Seconds between consecutive steps' metrics lines of one `rlx train` (on cpus)."""
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "rlx", "train", str(path)],
        preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus),
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
    parser.add_argument("--every", type=int, default=1, help="checkpoint.every")
    parser.add_argument("--direct-mib", type=int, default=256, help="state size, 0: skip")
    parser.add_argument(
        "--own-core",
        action="store_true",
        help="the S3 server on the last CPU, every run on the others",
    )
    args = parser.parse_args()

    # A real store is another machine: with --own-core this process (and the S3 server's
    # threads in it) keeps the last CPU and every run, disk and S3 alike, trains on the others.
    trainer_cpus: set[int] | None = None
    cpus = sorted(os.sched_getaffinity(0))
    if args.own_core and len(cpus) >= 2:
        trainer_cpus = set(cpus[:-1])
        os.sched_setaffinity(0, {cpus[-1]})

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
                path = recipe(
                    folder, name, args.model, args.steps, where[side], args.ranks, args.every
                )
                run_id = f"{side}-{round_}"
                results[side] += run(path, run_id, env, trainer_cpus)[args.warmup :]
                sizes[side] = checkpoint_bytes(folder, run_id)
    load_after = os.getloadavg()

    print()
    print(
        f"checkpoint every {args.every} step(s), {args.model}, {args.ranks} rank(s), "
        f"{args.rounds} rounds x "
        f"{args.steps} steps ({args.warmup} dropped per run), {os.cpu_count()} CPUs"
    )
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    if trainer_cpus is None:
        print("the S3 server shares the trainer's cores")
    else:
        print(
            f"trainer on CPUs {sorted(trainer_cpus)}, the S3 server on CPU {cpus[-1]} "
            "(both sides train on the same CPUs)"
        )
    size = sizes.get("disk")
    print(f"checkpoint size: {size / 2**20:.1f} MiB" if size else "checkpoint size: unknown")
    print()
    print(f"{'where':<8} {'s/step mean':>12} {'median':>8} {'p90':>8} {'steps':>6}")
    for side in ("disk", "s3"):
        values = results[side]
        print(
            f"{side:<8} {statistics.mean(values):>12.3f} {statistics.median(values):>8.3f} "
            f"{p90(values):>8.3f} {len(values):>6}"
        )
    ratio = statistics.mean(results["s3"]) / statistics.mean(results["disk"])
    print()
    print(f"S3 / disk (mean seconds per step): {ratio:.2f}x (target <= 1.2x)")
    if direct:
        print()
        print(f"one DCP save of {args.direct_mib} MiB into S3, 3 times (seconds, median):")
        for way, values in direct.items():
            print(f"  {way:<9} {statistics.median(values):.2f}")


if __name__ == "__main__":
    main()
