"""Weight-push seconds and peak extra memory: streamed buckets against the whole state as
one object, for a Qwen2.5-0.5B-shaped policy (bench/shapes.py, float32, 494M parameters).

    python bench/weight_sync.py [--engine vllm|hf] [--layers 24] [--repeats 3]
                                [--buckets 64 256 whole]

layout: split on this machine, in a private Ray: one training worker holding the policy and
one rollout worker holding the engine (vLLM's CPU build by default). Every push is the
trainer's own Cluster.sync_weights (gather, object store, engine load, version and probe
check). A bucket of N MiB is trainer.rollout.weight_sync_bucket_mb = N; "whole" sets it
above the model's size, so the push is one object holding every parameter, which is how
pushes worked before streaming. Each setting runs in a fresh private Ray (run_setting says how it
is warmed up), then --repeats pushes:
  - objects / in flight: buckets per push, and the two largest consecutive ones (at most
    two are under way at once);
  - push s: seconds of one push, the median;
  - sender: the training worker's peak resident memory during a push above its resident
    memory before it (/proc VmHWM, reset per push; counts the object-store pages it
    writes), the largest;
  - machine 1st / later: the largest drop of the machine's MemAvailable during the first
    measured push, and the median over the later ones (sampled every 10 ms): every process
    and the object store. Its shared memory stays taken once touched, so the first push
    shows what the setting needs beyond the warm-up, later ones the transient copies.
A measurement on whatever else the machine is doing, not a test.
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

MIB = 2**20


def mem_available() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


class LowWater:
    """The lowest MemAvailable seen while the block runs (a sampling thread)."""

    def __enter__(self) -> LowWater:
        self.start = self.low = mem_available()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.low = min(self.low, mem_available())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.low = min(self.low, mem_available())

    @property
    def drop(self) -> int:
        return max(self.start - self.low, 0)


def recipe_for(model: Path, data: Path, engine: str, out: Path, bucket_mb: int) -> Any:
    from rlx.recipe import parse_recipe

    recipe = {
        "name": "bench-weight-sync",
        "trainer": {
            "algorithm": "grpo",
            "layout": "split",
            "rollout_gpus": 1,  # on CPU: one rollout actor
            "model": {"path": str(model), "dtype": "float32"},
            "data": {"train": str(data), "max_prompt_length": 32},
            "reward": {"function": "letters_or_digits"},
            "rollout": {
                "engine": engine,
                "n": 2,
                "max_new_tokens": 8,
                "weight_sync_bucket_mb": bucket_mb,
            },
            "algo": {"kl": {"coef": 0.0}},
            "batch": {"prompts_per_step": 1, "micro_batch_size": 2},
            "steps": 1,
            "seed": 0,
            "logging": {"dir": str(out / "runs"), "tensorboard": False},
        },
    }
    return parse_recipe(json.dumps(recipe), "bench-weight-sync.yaml").recipe


def push(trainer: Any, version: int) -> dict[str, float]:
    import ray

    cluster = trainer.cluster
    sender = cluster.train.handles[0]
    before = ray.get(sender.memory_peak.remote(True))
    with LowWater() as machine:
        started = time.perf_counter()
        diff = cluster.sync_weights(version, trainer.inputs.probe)
        seconds = time.perf_counter() - started
    peak = ray.get(sender.memory_peak.remote())
    return {
        "seconds": seconds,
        "sender": (peak - before) / MIB,
        "machine": machine.drop / MIB,
        "probe_diff": diff,
    }


def run_setting(model: Path, data: Path, args: Any, choice: str, folder: Path) -> dict:
    """One bucket size in a fresh private Ray, from the same starting state: the probe's
    forwards done and one push in 1 MiB buckets made, so every page of the policy and the
    engine has been touched and the object store has touched what 1 MiB buckets need
    (about the embedding). What the measured pushes add is then theirs."""
    from rlx.trainer.main import trainer_for

    bucket_mb = 2**40 if choice == "whole" else int(choice)
    recipe = recipe_for(model, data, args.engine, folder, bucket_mb)
    env = {"RLX_RUN_ID": f"bench-{choice}"}
    log = io.StringIO()
    with trainer_for(recipe, env, log) as trainer:
        import ray

        cluster = trainer.cluster
        sender = cluster.train.handles[0]
        plan = ray.get(sender.open_weight_stream.remote(None, bucket_mb * MIB))
        sizes = ray.get(sender.open_weight_stream.remote(None, 1))  # one tensor per bucket
        _, _, resident = ray.get(sender.host_memory.remote())
        cluster.sync_weights(0, trainer.inputs.probe, push=False)
        cluster.bucket_bytes = MIB
        cluster.sync_weights(1, trainer.inputs.probe)
        cluster.bucket_bytes = bucket_mb * MIB
        runs = [push(trainer, version) for version in range(2, args.repeats + 2)]
        nbytes = dict(
            zip(
                [names[0] for names in sizes],
                ray.get(sender.tensor_bytes.remote([names[0] for names in sizes])),
                strict=True,
            )
        )
    bucket_bytes = [sum(nbytes[name] for name in names) for names in plan]
    pairs = [a + b for a, b in itertools.pairwise(bucket_bytes)]
    return {
        "objects": len(plan),
        "in_flight": max(pairs or bucket_bytes) / MIB,
        "resident": resident / MIB,
        "seconds": statistics.median(r["seconds"] for r in runs),
        "sender": max(r["sender"] for r in runs),
        "first": runs[0]["machine"],
        "later": statistics.median(r["machine"] for r in runs[1:]) if len(runs) > 1 else 0.0,
        "probe_diff": max(r["probe_diff"] for r in runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("vllm", "hf"), default="vllm")
    parser.add_argument("--layers", type=int, default=24, help="decoder layers (24: the real)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--buckets", nargs="+", default=["64", "256", "whole"], help="MiB per bucket, or whole"
    )
    args = parser.parse_args()

    from shapes import write_qwen25_05b

    from rlx.trainer.tasks.synthetic import write_synthetic_dataset

    with tempfile.TemporaryDirectory(prefix="rlx-bench-sync-") as tmp:
        folder = Path(tmp)
        model = write_qwen25_05b(folder / "model", args.layers)
        data = write_synthetic_dataset(folder / "prompts.jsonl", 8, seed=0)
        model_mib = (model / "model.safetensors").stat().st_size / MIB
        rows = []
        for choice in args.buckets:
            try:
                row = run_setting(model, data, args, choice, folder)
            except Exception as exc:  # e.g. a worker killed for memory: say so, go on
                reason = str(exc).strip().splitlines()[0][:160]
                print(f"bucket {choice}: failed: {type(exc).__name__}: {reason}", flush=True)
                continue
            print(f"bucket {choice}: {row}", flush=True)
            rows.append((choice, row))
        if not rows:
            raise SystemExit("no setting completed")
    print(
        f"policy: Qwen2.5-0.5B shape, {args.layers} layers, {model_mib:.0f} MiB float32 "
        f"(the largest tensor, the embedding, {151936 * 896 * 4 / MIB:.0f} MiB); engine "
        f"{args.engine}; training worker resident {rows[0][1]['resident']:.0f} MiB"
    )
    print()
    print(
        f"{'bucket':>8} {'objects':>8} {'in flight':>10} {'push s':>7} {'sender':>7} "
        f"{'machine 1st':>12} {'machine later':>14} {'probe diff':>11}"
    )
    for choice, row in rows:
        name = "whole" if choice == "whole" else f"{choice} MiB"
        print(
            f"{name:>8} {row['objects']:>8} {row['in_flight']:>10.0f} {row['seconds']:>7.2f} "
            f"{row['sender']:>7.0f} {row['first']:>12.0f} {row['later']:>14.0f} "
            f"{row['probe_diff']:>11.2g}"
        )
    print("(memory in MiB; in flight: the two largest consecutive buckets, the most the push")
    print(" holds in the object store at once by its plan)")
    whole = dict(rows).get("whole")
    if whole:
        print()
        print("ratios to whole (lower is better):")
        for choice, row in rows:
            if choice != "whole":
                parts = [
                    f"{key} {row[key] / whole[key]:.2f}x"
                    for key in ("in_flight", "seconds", "sender", "first", "later")
                    if whole[key] > 0
                ]
                print(f"  {choice} MiB: " + ", ".join(parts))


if __name__ == "__main__":
    main()
