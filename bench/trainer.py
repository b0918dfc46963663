"""Seconds per GRPO step and peak memory: rlx's trainer next to TRL's GRPOTrainer.

    python bench/trainer.py [--model tiny|qwen2.5-0.5b] [--lengths fixed|skewed]
                            [--rounds R] [--steps S] [--warmup W]

Both sides train the same saved model, on the synthetic letters_or_digits prompts in file
order. --model tiny (the default): a tiny Qwen2 (hidden 256, 4 layers, built once with
rlx.trainer.model.tiny.build_tiny_model; 3 rounds x 14 steps, 4 dropped). --model qwen2.5-0.5b:
random weights with Qwen2.5-0.5B's full config (hidden 896, 24 layers, 14 heads, 2 key/value
heads, vocabulary 151936, tied embeddings; bench/shapes.py), 494M parameters in float32,
and the tiny byte-level tokenizer (sampled ids above its 260 decode to nothing; both sides
see the same ids); 2 rounds x 5 steps, 2 dropped. The same settings on both sides:
2 prompts x 8 completions of exactly 32 tokens per step (min_new_tokens = max_new_tokens
= 32), temperature 1, GRPO advantages (group mean and std), clipped ratio (eps 0.2), a k3
KL-to-reference term in the loss (beta 0.04), token-mean aggregation over all the step's
completion tokens (TRL's loss_type "dapo"), AdamW at a constant 1e-4, grad-norm clip 1.0,
one optimiser update per step, 2 torch threads
(RLX_NUM_THREADS=2 for rlx's actors, torch.set_num_threads(2) for TRL).

Each run is a fresh subprocess; runs alternate rlx, TRL, rlx, TRL, ... for --rounds rounds.
Measured per run:
  - seconds per step: the wall time between the ends of consecutive steps (the whole
    training loop: generation, reward, forwards, update, logging), after --warmup steps;
  - peak memory of the run's whole process tree, the subprocess and all its descendants:
    rlx starts a private Ray, so its driver, gcs_server, raylet, agents and the training
    worker are all descendants and all counted. "peak RSS": the largest summed resident set
    seen (sampled every 0.2 s from /proc/PID/status, cheap enough not to slow the run);
    "sum VmHWM": each process's own peak resident set, summed, an upper bound sampling
    cannot miss; "peak PSS": the proportional set (every 2 s), which counts pages shared
    between processes (the torch libraries) once in all instead of once per process.
The table pools the post-warm-up steps of all runs of a side (median and p90) and takes the
largest peak over its runs. It is a measurement, not a test: nothing passes or fails.

--lengths skewed: responses of unequal length, as in real RL, instead of exactly 32 tokens:
the saved model's end-of-sequence row (the output embedding's, shared with the input
embedding) is set along the mean direction of its final hidden states, scaled so that the
model ends a response with probability 1/48 at each token on average; generation stops at
EOS or at 192 tokens. Response lengths then follow a geometric-like distribution (a rate
that varies a little by token): most responses short, a tail reaching the limit; the run
prints the lengths both sides saw. Both sides sample the same model at temperature 1, so
the mix is the same on both; each runs its defaults otherwise (rlx packs its passes, TRL pads).

--lora: rlx against itself instead of TRL: full fine-tuning ("rlx"), rank-8 LoRA on every
linear layer ("lora", learning rate 10x: 1e-3), and the same LoRA run without the KL term
("lora-nokl"). With LoRA the reference is the policy with its adapters off, so the KL term
should cost no memory: lora's peak over lora-nokl's is that cost.

Figures measured on 2 CPU cores (3 rounds x 14 steps, first 4 dropped): README, Benchmarks.
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
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

PROMPTS_PER_STEP = 2
GENERATIONS = 8  # completions per prompt: 16 per step
COMPLETION_TOKENS = 32
BETA = 0.04  # KL coefficient on both sides
CLIP_EPS = 0.2
LEARNING_RATE = 1e-4
THREADS = 2
SKEWED_MEAN = 48  # mean response tokens of the skewed mix (the EOS rate's inverse)
SKEWED_MAX = 192  # max_new_tokens of the skewed mix
LENGTH_MIXES = ("fixed", "skewed")
SEED = 0
DATA_ROWS = 256
SAMPLE_EVERY_S = 0.2
SIDES = ("rlx", "trl")
LORA_SIDES = ("rlx", "lora", "lora-nokl")
LORA_RANK = 8
LORA_LEARNING_RATE = 10 * LEARNING_RATE
PSS_EVERY = 10  # samples between two PSS readings (2 s)


# --------------------------------------------------------------------------- shared inputs


@dataclass(frozen=True)
class ModelChoice:
    rounds: int
    steps: int
    warmup: int


MODELS: dict[str, ModelChoice] = {
    "tiny": ModelChoice(rounds=3, steps=14, warmup=4),
    "qwen2.5-0.5b": ModelChoice(rounds=2, steps=5, warmup=2),
}


def end_at_rate(model_dir: Path, data: Path, rate: float, seed: int = SEED) -> None:
    """Rewrite the saved model so that its responses end (EOS) about as often as if EOS came
    with probability `rate` at every token: EOS's output row is set along the mean final
    hidden state, scaled (bisection) so that the expected length of the model's own samples
    (EOS kept out of them: 128 tokens after each of the first 32 prompts of `data`, in the
    chat template both sides apply) matches a geometric one of that rate. The lengths the
    runs then see differ from prompt to prompt; the bench prints them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos = tokenizer.eos_token_id
    chats = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], add_generation_prompt=True, tokenize=False
        )
        for row in read_rows(data)[:32]
    ]
    tokenizer.padding_side = "left"
    encoded = tokenizer(chats, return_tensors="pt", padding=True, add_special_tokens=False)
    prompts, tokens = encoded["input_ids"], 128
    torch.manual_seed(seed)
    with torch.no_grad():
        sampled = model.generate(
            prompts,
            attention_mask=encoded["attention_mask"],
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            pad_token_id=eos,
        )
        mask = torch.cat([encoded["attention_mask"], torch.ones_like(sampled[:, 1:])], dim=1)
        width = prompts.shape[1]
        hidden = model.get_decoder()(input_ids=sampled, attention_mask=mask[:, : sampled.shape[1]])
        hidden = hidden.last_hidden_state[:, width - 1 : -1]  # (S, T, H): predicting each
        head = model.get_output_embeddings().weight  # (V, H)
        logits = hidden @ head.T  # (S, T, V)
        logits[..., eos] = -torch.inf
        others = torch.logsumexp(logits, dim=-1)  # (S, T)
        mean = hidden.flatten(0, 1).mean(dim=0)  # (H,)
        along = hidden @ mean / mean.dot(mean)  # (S, T), about 1
        target = (1 - (1 - rate) ** tokens) / rate  # E[min(length, T)], geometric

        def expected_length(scale: float) -> float:
            ends = torch.sigmoid(scale * along - others)  # (S, T) EOS's probability
            alive = torch.cumprod(1 - ends, dim=1)  # (S, T) P(length > t + 1)
            return float((1 + alive[:, :-1].sum(dim=1)).mean())

        low, high = -50.0, 50.0
        for _ in range(60):
            middle = (low + high) / 2
            low, high = (middle, high) if expected_length(middle) > target else (low, middle)
        head[eos] = high * mean / mean.dot(mean)
    model.save_pretrained(model_dir)


def build_inputs(folder: Path, choice: str, lengths: str = "fixed") -> tuple[Path, Path]:
    """The saved model and the prompt file both sides read."""
    from rlx.trainer.model.tiny import build_tiny_model
    from rlx.trainer.tasks.synthetic import write_synthetic_dataset

    if choice == "tiny":
        model = build_tiny_model(
            folder / "model", arch="qwen2", hidden_size=256, num_layers=4, num_heads=4, seed=SEED
        )
    else:
        from shapes import QWEN25_05B_LAYERS, write_qwen25_05b

        model = write_qwen25_05b(folder / "model", QWEN25_05B_LAYERS, seed=SEED)
    data = write_synthetic_dataset(folder / "prompts.jsonl", DATA_ROWS, seed=SEED)
    if lengths == "skewed":
        end_at_rate(model, data, 1.0 / SKEWED_MEAN)
    return model, data


def completion_tokens(lengths: str) -> tuple[int, int]:
    """(max_new_tokens, min_new_tokens) of a length mix."""
    return (COMPLETION_TOKENS, COMPLETION_TOKENS) if lengths == "fixed" else (SKEWED_MAX, 0)


def read_rows(data: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in data.read_text().splitlines() if line.strip()]


# --------------------------------------------------------------------------- rlx (child)


def rlx_recipe(
    model: Path, data: Path, steps: int, out: Path, side: str = "rlx", lengths: str = "fixed"
) -> Any:
    """The bench's recipe for an rlx side: rlx (full fine-tuning), lora, lora-nokl."""
    from rlx.recipe import parse_recipe

    most, least = completion_tokens(lengths)
    lora = side.startswith("lora")
    settings: dict[str, Any] = {"path": str(model), "dtype": "float32"}
    if lora:
        settings["lora"] = {"rank": LORA_RANK}
    recipe = {
        "name": "bench-rlx",
        "trainer": {
            "algorithm": "grpo",
            "model": settings,
            "data": {"train": str(data), "shuffle": False, "max_prompt_length": 64},
            "reward": {"function": "letters_or_digits"},
            "rollout": {
                "engine": "hf",
                "n": GENERATIONS,
                "max_new_tokens": most,
                "min_new_tokens": least,
                "temperature": 1.0,
            },
            "algo": {
                "clip_eps": CLIP_EPS,
                "kl": {
                    "coef": 0.0 if side.endswith("nokl") else BETA,
                    "estimator": "k3",
                    "mode": "loss",
                },
                "loss_agg": "token-mean",
            },
            "optim": {
                "lr": LORA_LEARNING_RATE if lora else LEARNING_RATE,
                "schedule": "constant",
                "grad_clip": 1.0,
            },
            "batch": {
                "prompts_per_step": PROMPTS_PER_STEP,
                "micro_batch_size": PROMPTS_PER_STEP * GENERATIONS,
            },
            "steps": steps,
            "seed": SEED,
            "logging": {"dir": str(out / "runs"), "tensorboard": False},
        },
    }
    return parse_recipe(json.dumps(recipe), "bench-rlx.yaml").recipe


def run_rlx(
    model: Path, data: Path, steps: int, out: Path, side: str = "rlx", lengths: str = "fixed"
) -> list[float]:
    """Ends of steps (time.time() at each step's log line), from rlx's metrics file."""
    from rlx.trainer.main import run_training

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a private Ray
    env["RLX_NUM_THREADS"] = str(THREADS)
    env["RLX_RUN_ID"] = "bench"
    os.environ["RLX_NUM_THREADS"] = str(THREADS)
    recipe = rlx_recipe(model, data, steps, out, side, lengths)
    result = run_training(recipe, env, print_summary=False)
    rows = [json.loads(line) for line in Path(result.metrics).read_text().splitlines() if line]
    for row in rows:
        print(
            f"lengths: mean {row['response_length/mean']:.1f} max "
            f"{row['response_length/max']:.0f}, padding "
            f"{row.get('perf/padding_fraction', 0.0):.3f}; seconds: "
            + ", ".join(f"{k[5:]} {v:.2f}" for k, v in row.items() if k.startswith("time/")),
            flush=True,
        )
    return [row["time"] for row in rows]


# --------------------------------------------------------------------------- TRL (child)


def run_trl(model: Path, data: Path, steps: int, out: Path, lengths: str = "fixed") -> list[float]:
    """Ends of steps (time.time() in on_step_end)."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlx.trainer.tasks.synthetic import letters_or_digits_reward

    torch.set_num_threads(THREADS)
    rows = read_rows(data)
    dataset = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
            for r in rows
        ]
    )

    def reward(prompts: list, completions: list, answer: list, **_: Any) -> list[float]:
        return [
            letters_or_digits_reward("", completion[0]["content"], kind)
            for completion, kind in zip(completions, answer, strict=True)
        ]

    ends: list[float] = []

    class StepEnds(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            ends.append(time.time())

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **_: Any) -> None:
            if logs and "completions/mean_length" in logs:
                print(
                    f"lengths: mean {logs['completions/mean_length']:.1f} max "
                    f"{logs.get('completions/max_length', 0):.0f}",
                    flush=True,
                )

    config = GRPOConfig(
        output_dir=str(out / "trl"),
        per_device_train_batch_size=PROMPTS_PER_STEP * GENERATIONS,
        num_generations=GENERATIONS,
        gradient_accumulation_steps=1,
        num_iterations=1,
        max_completion_length=completion_tokens(lengths)[0],
        generation_kwargs={"min_new_tokens": completion_tokens(lengths)[1]},
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=BETA,
        epsilon=CLIP_EPS,
        loss_type="dapo",
        use_bias_correction_kl=False,  # plain k3, as rlx
        scale_rewards="group",
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=steps,
        shuffle_dataset=False,
        seed=SEED,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=str(model),
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        callbacks=[StepEnds()],
    )
    trainer.train()
    return ends


def child(side: str, model: Path, data: Path, steps: int, out: Path, lengths: str) -> None:
    if side == "trl":
        ends = run_trl(model, data, steps, out, lengths)
    else:
        ends = run_rlx(model, data, steps, out, side, lengths)
    (out / "ends.json").write_text(json.dumps(ends))


# --------------------------------------------------------------------------- the parent


def proc_kib(path: str, field_name: str) -> int:
    """A `Name:  N kB` field of a /proc file, in KiB (0 when the process is gone)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return 0


@dataclass
class TreePeak:
    """Peak memory of a process and its descendants, sampled in a thread from /proc.

    Sampling must not slow the run it measures (two cores, and rlx's tree has ten
    processes to TRL's one): the resident set comes from /proc/PID/status, which is cheap,
    every SAMPLE_EVERY_S; the proportional set needs the page tables walked
    (/proc/PID/smaps_rollup), so it is read only every PSS_EVERY samples.
    rss: the largest sum over the tree at one moment; hwm: the sum of each process's own
    peak (VmHWM), an upper bound that sampling cannot miss; pss: as rss, for PSS."""

    pid: int
    rss: int = 0  # bytes
    hwm: int = 0
    pss: int = 0
    processes: int = 0  # the most processes in the tree at one time
    samples: int = 0
    peaks: dict[int, int] = field(default_factory=dict)  # pid -> VmHWM (KiB)

    def sample(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
            pids = [self.pid, *(child.pid for child in root.children(recursive=True))]
        except psutil.NoSuchProcess:
            return
        rss = 0
        for pid in pids:
            rss += proc_kib(f"/proc/{pid}/status", "VmRSS")
            hwm = proc_kib(f"/proc/{pid}/status", "VmHWM")
            self.peaks[pid] = max(self.peaks.get(pid, 0), hwm)
        self.rss = max(self.rss, rss * 1024)
        self.hwm = sum(self.peaks.values()) * 1024
        if self.samples % PSS_EVERY == 0:
            pss = sum(proc_kib(f"/proc/{pid}/smaps_rollup", "Pss") for pid in pids)
            self.pss = max(self.pss, pss * 1024)
        self.samples += 1
        self.processes = max(self.processes, len(pids))


def watch(process: subprocess.Popen, peak: TreePeak) -> None:
    while process.poll() is None:
        peak.sample()
        time.sleep(SAMPLE_EVERY_S)


@dataclass
class RunResult:
    side: str
    step_seconds: list[float]
    peak: TreePeak
    wall: float


def one_run(
    side: str, model: Path, data: Path, steps: int, warmup: int, lengths: str = "fixed"
) -> RunResult:
    with tempfile.TemporaryDirectory(prefix=f"bench-{side}-") as scratch:
        out = Path(scratch)
        argv = [sys.executable, __file__, "--child", side, "--model-dir", str(model)]
        argv += ["--data", str(data), "--steps", str(steps), "--out", str(out)]
        argv += ["--lengths", lengths]
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env["TOKENIZERS_PARALLELISM"] = "false"
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        start = time.perf_counter()
        log = out / "child.log"
        with log.open("w") as sink:
            process = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=env)
            peak = TreePeak(process.pid)
            watcher = threading.Thread(target=watch, args=(process, peak), daemon=True)
            watcher.start()
            code = process.wait()
            watcher.join()
        wall = time.perf_counter() - start
        if code != 0:
            sys.stderr.write(log.read_text()[-4000:])
            raise SystemExit(f"the {side} run failed (exit {code})")
        ends = json.loads((out / "ends.json").read_text())
        seen = [line for line in log.read_text().splitlines() if line.startswith("lengths: ")]
    if seen:
        print(f"  {side} {seen[len(seen) // 2]} (a step midway)", flush=True)
    if len(ends) != steps:
        raise SystemExit(f"the {side} run logged {len(ends)} steps, expected {steps}")
    seconds = [b - a for a, b in itertools.pairwise(ends)][warmup - 1 :]
    return RunResult(side, seconds, peak, wall)


def p90(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[int(0.9 * (len(ordered) - 1))]


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


TABLE_ROWS: tuple[tuple[str, str, str], ...] = (
    ("median", "median s/step", ".3f"),
    ("p90", "p90 s/step", ".3f"),
    ("rss", "peak RSS GiB", ".2f"),
    ("hwm", "sum VmHWM GiB", ".2f"),
    ("pss", "peak PSS GiB", ".2f"),
)


def side_figures(runs: Sequence[RunResult]) -> dict[str, float]:
    steps = [seconds for run in runs for seconds in run.step_seconds]
    return {
        "median": statistics.median(steps),
        "p90": p90(steps),
        "rss": max(run.peak.rss for run in runs) / 2**30,
        "hwm": max(run.peak.hwm for run in runs) / 2**30,
        "pss": max(run.peak.pss for run in runs) / 2**30,
    }


def print_lora_table(results: Sequence[RunResult]) -> None:
    """Full fine-tuning, LoRA and LoRA without KL, with LoRA's ratios to each."""
    figures = {
        side: side_figures(runs) if (runs := [r for r in results if r.side == side]) else None
        for side in LORA_SIDES
    }
    full, lora, nokl = (figures[side] for side in LORA_SIDES)
    head = f"{'':<15} {'full':>8} {'lora':>8} {'lora-nokl':>10} {'lora/full':>10} {'KL/noKL':>8}"
    print(head)
    for key, label, fmt in TABLE_ROWS:
        cells = [f"{f[key]:{fmt}}" if f else "n/a" for f in (full, lora, nokl)]
        to_full = f"{lora[key] / full[key]:.2f}x" if lora and full else "n/a"
        to_nokl = f"{lora[key] / nokl[key]:.2f}x" if lora and nokl else "n/a"
        row = f"{label:<15} {cells[0]:>8} {cells[1]:>8} {cells[2]:>10} {to_full:>10} {to_nokl:>8}"
        print(row)


def print_table(results: Sequence[RunResult]) -> None:
    """The two sides' figures and their ratio (a side that did not run shows n/a)."""
    figures = {
        side: side_figures(runs) if (runs := [r for r in results if r.side == side]) else None
        for side in SIDES
    }
    rlx, trl = figures["rlx"], figures["trl"]
    print(f"{'':<15} {'rlx':>8} {'TRL':>8} {'rlx/TRL':>8}")
    for key, label, fmt in TABLE_ROWS:
        cells = [f"{f[key]:>8{fmt}}" if f else f"{'n/a':>8}" for f in (rlx, trl)]
        ratio = f"{rlx[key] / trl[key]:.2f}x" if rlx and trl else "n/a"
        print(f"{label:<15} {cells[0]} {cells[1]} {ratio:>8}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny", dest="shape")
    parser.add_argument("--rounds", type=int, help="runs per side (default: per model)")
    parser.add_argument("--steps", type=int, help="steps per run (default: per model)")
    parser.add_argument("--warmup", type=int, help="steps dropped per run (default: per model)")
    parser.add_argument("--sides", nargs="+", choices=SIDES + LORA_SIDES)
    parser.add_argument("--lora", action="store_true", help="full vs LoRA vs LoRA without KL")
    parser.add_argument("--lengths", choices=LENGTH_MIXES, default="fixed")
    parser.add_argument("--child", choices=SIDES + LORA_SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))  # this checkout's rlx, here and in the children
    if args.child:
        child(args.child, args.model_dir, args.data, args.steps, args.out, args.lengths)
        return
    args.sides = args.sides or list(LORA_SIDES if args.lora else SIDES)
    defaults = MODELS[args.shape]
    args.rounds = args.rounds or defaults.rounds
    args.steps = args.steps or defaults.steps
    args.warmup = args.warmup or defaults.warmup
    if not 1 <= args.warmup < args.steps:
        parser.error("--warmup must be at least 1 and below --steps")
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as scratch:
        model, data = build_inputs(Path(scratch), args.shape, args.lengths)
        print(
            f"model {args.shape}, {args.lengths} lengths, {args.rounds} rounds x "
            f"{args.steps} steps ({args.warmup} dropped), torch threads {THREADS}, "
            f"load {load_average()}" + (f", LoRA rank {LORA_RANK} all-linear" if args.lora else ""),
            flush=True,
        )
        results = []
        for round_index in range(args.rounds):
            for side in args.sides:
                before = load_average()
                result = one_run(side, model, data, args.steps, args.warmup, args.lengths)
                results.append(result)
                print(
                    f"round {round_index + 1} {side:<3}: median "
                    f"{statistics.median(result.step_seconds):.3f} s/step, peak RSS "
                    f"{result.peak.rss / 2**30:.2f} GiB over {result.peak.processes} processes, "
                    f"run {result.wall:.0f} s, load "
                    f"before {before} after {load_average()}",
                    flush=True,
                )
    print()
    (print_lora_table if args.lora else print_table)(results)


if __name__ == "__main__":
    main()
