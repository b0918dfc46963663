"""Per-rank memory and seconds per update of the trainer's Learner, DDP and FSDP, 1/2/4 ranks.

    python bench/scale.py [--layers 1] [--ranks 1 2 4] [--strategies ddp fsdp] [--updates 3]

The model: Qwen2.5-0.5B's shape (hidden 896, 14 heads, 2 key/value heads, MLP 4864,
vocabulary 151936, tied embeddings) with --layers decoder layers, random init, float32
(bench/shapes.py). The default, 1 layer, is 151M parameters, most of them the embedding, and
keeps DDP at 4 ranks near 16 GiB of RSS in all; each layer adds 14.9M. Every row is fresh
processes, one per rank, joined by a real gloo process group; each builds the Learner from
a GRPO recipe with `trainer.parallel.strategy` set and runs Learner.update on its share of
one fixed synthetic global batch (--prompts prompts x --n samples, --prompt-tokens +
--response-tokens each, random advantages): the same global batch at every rank count, one
optimiser step per update, no reference model (KL off) so the state is the policy's alone.

Per rank:
  - state: bytes of the tensors the rank holds for weights, gradients and optimiser state,
    read from the policy's parameters, their .grad and optimizer.state right after the
    first optimiser step (a step hook, before the Learner frees the gradients); for a
    sharded parameter (DTensor) its local shard. DDP's gradient buckets are not in it.
  - peak RSS: the process's VmHWM at the end; "load peak": the same once the Learner is
    built, before any update (loading the weights has its own transient).
  - seconds per update: wall time of Learner.update, ranks started together by a barrier;
    per update the slowest rank; the median over --updates after --warmup.
One rank is a plain module whichever strategy is asked for ("runs as": single). The table
shows, per row, the largest rank's state and peak RSS, the sum of peak RSS over
ranks, FSDP's state against DDP's divided by the rank count, and rlx.plan's figure for the
same shape (n/a when the installed rlx has no planner). A measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
ROW_TIMEOUT_S = 1800
MIB = 2**20


# --------------------------------------------------------------------------- one rank (child)


def recipe_settings(model: Path, strategy: str, args: argparse.Namespace, out: Path) -> Any:
    from rlx.recipe import parse_recipe

    recipe = {
        "name": "bench-scale",
        "trainer": {
            "algorithm": "grpo",
            "model": {"path": str(model), "dtype": "float32"},
            "data": {"train": "synthetic:letters_or_digits", "max_prompt_length": 64},
            "reward": {"function": "letters_or_digits"},
            "rollout": {"engine": "hf", "n": args.n, "max_new_tokens": args.response_tokens},
            "algo": {"kl": {"coef": 0.0}},
            "optim": {"lr": 1e-5, "grad_clip": 1.0},
            "batch": {
                "prompts_per_step": args.prompts,
                "micro_batch_size": args.prompts * args.n,
            },
            "parallel": {"strategy": strategy},
            "steps": 1000,
            "seed": 0,
            "logging": {"dir": str(out / "runs"), "tensorboard": False},
        },
    }
    return parse_recipe(json.dumps(recipe), "bench-scale.yaml").recipe.trainer


def local_bytes(tensor: Any) -> int:
    """Bytes this rank holds for a tensor: a DTensor's local shard, else the tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def state_bytes(policy: Any, optimizer: Any) -> dict[str, int]:
    import torch

    params = list(policy.parameters())  # tied weights once
    optim = 0
    for state in optimizer.state.values():
        optim += sum(local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return {
        "weights": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": optim,
        "params": sum(p.numel() for p in params),
    }


def status_bytes(field: str) -> int:
    """A `Field:  N kB` line of /proc/self/status (VmHWM: peak resident set), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def child(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from rlx.trainer.learn.learner import Learner

    torch.set_num_threads(args.threads)
    rank, world = args.rank, args.world
    dist.init_process_group(
        "gloo", init_method=f"file://{args.out / 'rendezvous'}", rank=rank, world_size=world
    )
    settings = recipe_settings(args.model, args.strategy, args, args.out)
    start = time.perf_counter()
    learner = Learner(
        settings, str(args.model), None, torch.device("cpu"), rank=rank, world_size=world
    )
    load_s = time.perf_counter() - start
    result: dict[str, Any] = {
        "rank": rank,
        "load_s": load_s,
        "load_peak": status_bytes("VmHWM"),
        "runs_as": getattr(learner, "strategy", "ddp" if world > 1 else "single"),
    }
    sharded = any(isinstance(p, DTensor) for p in learner.policy.parameters())
    if args.strategy == "fsdp" and world > 1 and not sharded:
        result["skipped"] = "this rlx's Learner does not shard (no DTensor parameters)"
        (args.out / f"rank{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()
        return

    measured: dict[str, int] = {}

    def after_step(optimizer: Any, *_: Any) -> None:
        if not measured:  # gradients and optimiser state both exist only here
            measured.update(state_bytes(learner.policy, optimizer))

    learner.optimizer.register_step_post_hook(after_step)
    batch = torch.load(args.batch, weights_only=False)
    share = len(batch) // world
    mine = batch.select(range(rank * share, (rank + 1) * share))
    seconds = []
    for update in range(args.warmup + args.updates):
        dist.barrier()
        start = time.perf_counter()
        learner.update(mine, step=update)
        seconds.append(time.perf_counter() - start)
    result.update(measured, seconds=seconds[args.warmup :], peak_rss=status_bytes("VmHWM"))
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


# --------------------------------------------------------------------------- the parent


def write_batch(path: Path, args: argparse.Namespace) -> None:
    """One global batch: --prompts groups of --n rows sharing a prompt (as GRPO's samples
    do), every token real, advantages random."""
    import torch

    from rlx.trainer.batch import ADVANTAGES, SequenceBatch

    generator = torch.Generator().manual_seed(0)
    rows = args.prompts * args.n
    prompts = torch.randint(0, 256, (args.prompts, args.prompt_tokens), generator=generator)
    responses = torch.randint(0, 256, (rows, args.response_tokens), generator=generator)
    ids = torch.cat([prompts.repeat_interleave(args.n, dim=0), responses], dim=1)  # (B, P + R)
    mask = torch.ones(rows, args.response_tokens, dtype=torch.bool)  # (B, R)
    batch = SequenceBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        response_mask=mask,
        prompt_width=args.prompt_tokens,
    )
    advantages = torch.randn(mask.shape, generator=generator)  # (B, R)
    torch.save(batch.with_fields(**{ADVANTAGES: advantages}), path)


def plan_bytes(model: Path, ranks: int, strategy: str) -> int | None:
    """rlx.plan's figure for one rank's weights + gradients + optimiser state (what the
    bench measures; its DDP bucket item is left out), or None without a planner."""
    try:
        from rlx.plan import ModelShape, training_state_bytes
    except ImportError:
        return None
    config = json.loads((model / "config.json").read_text())
    plan = training_state_bytes(ModelShape.from_config(config), ranks=ranks, strategy=strategy)
    return int(plan["weights"] + plan["grads"] + plan["optimizer"])


@dataclass
class Row:
    strategy: str
    ranks: int
    ranks_out: list[dict[str, Any]]
    plan: int | None

    @property
    def skipped(self) -> str | None:
        return self.ranks_out[0].get("skipped")

    def most(self, key: str) -> int:
        return max(r[key] for r in self.ranks_out)

    @property
    def state(self) -> int:
        return max(r["weights"] + r["grads"] + r["optimizer"] for r in self.ranks_out)

    @property
    def seconds(self) -> float:
        per_update = zip(*(r["seconds"] for r in self.ranks_out), strict=True)
        return statistics.median(max(times) for times in per_update)


def run_row(strategy: str, ranks: int, model: Path, batch: Path, args: argparse.Namespace) -> Row:
    threads = args.threads or max(1, (os.cpu_count() or 1) // ranks)
    with tempfile.TemporaryDirectory(prefix=f"bench-scale-{strategy}{ranks}-") as scratch:
        out = Path(scratch)
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        env["OMP_NUM_THREADS"] = str(threads)
        processes = []
        for rank in range(ranks):
            argv = [sys.executable, __file__, "--child", "--strategy", strategy]
            argv += ["--rank", str(rank), "--world", str(ranks), "--threads", str(threads)]
            argv += ["--model", str(model), "--batch", str(batch), "--out", str(out)]
            argv += forwarded(args)
            log = (out / f"rank{rank}.log").open("w")
            processes.append(
                (subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env), log)
            )
        deadline = time.monotonic() + ROW_TIMEOUT_S
        failed = False
        for process, log in processes:
            try:
                code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = -1
            log.close()
            failed = failed or code != 0
        if failed:
            for process, _ in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
            for rank in range(ranks):
                sys.stderr.write(
                    f"--- rank {rank}\n{(out / f'rank{rank}.log').read_text()[-3000:]}"
                )
            raise SystemExit(f"{strategy} at {ranks} ranks failed")
        results = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(ranks)]
    return Row(strategy, ranks, results, plan_bytes(model, ranks, strategy))


def forwarded(args: argparse.Namespace) -> list[str]:
    """The batch and loop options every rank needs."""
    out = []
    for name in ("prompts", "n", "prompt_tokens", "response_tokens", "updates", "warmup"):
        out += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return out


def environment(args: argparse.Namespace) -> str:
    import torch

    cpu = "unknown CPU"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    threads = args.threads or "cores // ranks"
    return (
        f"torch {torch.__version__}, Python {platform.python_version()}, {cpu}, "
        f"{os.cpu_count()} cores, {memory:.0f} GiB RAM, torch threads per rank: {threads}, "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )


def fmt_mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / MIB:,.0f}"


COLUMNS: tuple[tuple[str, str], ...] = (
    ("strategy", ""),
    ("ranks", ""),
    ("runs as", ""),
    ("weights", "MiB/rank"),
    ("grads", "MiB/rank"),
    ("optim", "MiB/rank"),
    ("state", "MiB/rank"),
    ("vs DDP/r", "target 1"),
    ("plan", "MiB/rank"),
    ("meas/plan", "target 1"),
    ("load pk", "MiB/rank"),
    ("peak RSS", "MiB/rank"),
    ("sum RSS", "MiB"),
    ("s/update", "median"),
)


def table_line(cells: list[str]) -> str:
    return " ".join(f"{cell:<8}" if i == 0 else f"{cell:>9}" for i, cell in enumerate(cells))


def print_table(rows: list[Row]) -> None:
    """One line per row; "vs DDP/r": FSDP's state / (DDP's state / ranks), from the DDP row
    at the same rank count."""
    ddp = {row.ranks: row for row in rows if row.strategy == "ddp" and not row.skipped}
    print(table_line([name for name, _ in COLUMNS]))
    print(table_line([unit for _, unit in COLUMNS]))
    for row in rows:
        if row.skipped:
            print(f"{row.strategy:<8} {row.ranks:>9}  n/a: {row.skipped}")
            continue
        base = ddp.get(row.ranks) or ddp.get(1)
        versus = "-"
        if row.strategy == "fsdp" and base is not None:
            versus = f"{row.state / (base.state / row.ranks):.3f}"
        ratio = "n/a" if row.plan is None else f"{row.state / row.plan:.3f}"
        cells = [
            row.strategy,
            str(row.ranks),
            row.ranks_out[0]["runs_as"],
            fmt_mib(row.most("weights")),
            fmt_mib(row.most("grads")),
            fmt_mib(row.most("optimizer")),
            fmt_mib(row.state),
            versus,
            fmt_mib(row.plan),
            ratio,
            fmt_mib(row.most("load_peak")),
            fmt_mib(row.most("peak_rss")),
            fmt_mib(sum(r["peak_rss"] for r in row.ranks_out)),
            f"{row.seconds:.2f}",
        ]
        print(table_line(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=1, help="decoder layers (default 1)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--strategies", nargs="+", choices=("ddp", "fsdp"), default=["ddp", "fsdp"])
    parser.add_argument("--prompts", type=int, default=2, help="prompts in the global batch")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--response-tokens", type=int, default=32)
    parser.add_argument("--updates", type=int, default=3, help="measured updates per row")
    parser.add_argument("--warmup", type=int, default=1, help="updates before measuring")
    parser.add_argument("--threads", type=int, default=0, help="per rank (default cores // ranks)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))  # this checkout's rlx, here and in the ranks
    if args.child:
        child(args)
        return
    samples = args.prompts * args.n
    for ranks in args.ranks:
        if ranks < 1 or samples % ranks:
            parser.error(f"{samples} samples do not split evenly over {ranks} ranks")
    if args.warmup < 1 or args.updates < 1:
        parser.error("--warmup and --updates must be at least 1 (the state is read in warm-up)")

    from shapes import parameter_count, write_qwen25_05b

    print(environment(args))
    print(
        f"model: Qwen2.5-0.5B shape, {args.layers} layers, "
        f"{parameter_count(args.layers) / 1e6:.1f}M parameters, float32, random init; "
        f"global batch {args.prompts} prompts x {args.n} samples x "
        f"({args.prompt_tokens} + {args.response_tokens}) tokens; "
        f"{args.warmup} warm-up + {args.updates} measured updates",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as scratch:
        model = write_qwen25_05b(Path(scratch) / "model", args.layers)
        batch = Path(scratch) / "batch.pt"
        write_batch(batch, args)
        for strategy in args.strategies:
            for ranks in args.ranks:
                started = time.perf_counter()
                row = run_row(strategy, ranks, model, batch, args)
                rows.append(row)
                note = row.skipped or (
                    f"state {fmt_mib(row.state)} MiB/rank, {row.seconds:.2f} s/update"
                )
                print(
                    f"{strategy} x {ranks}: {note} "
                    f"({time.perf_counter() - started:.0f} s, load {os.getloadavg()[0]:.2f})",
                    flush=True,
                )
    print()
    print_table(rows)


if __name__ == "__main__":
    main()
