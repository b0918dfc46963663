"""Reward-model scoring of a step's completions: packed, token-budgeted passes
(rlx.trainer.model.reward_model) against one padded forward of them all.

    python bench/reward_model.py [--completions N] [--budget TOKENS] [--hidden H]
                                 [--layers L] [--rounds R] [--cap-mb MB]

What runs: a random one-label Qwen2 reward model (hidden 256, 4 layers by default, the
byte-level tokenizer; float32 on CPU, 2 torch threads) scoring N = 256 completions whose
lengths are skewed as a step's are: prompts uniform in 16..64 tokens, responses geometric
of mean 128 tokens cut at 1024 (most short, a few at the limit). Two paths over the same
sequences:
  - packed: RewardModelScorer.score_token_ids, passes of at most --budget tokens;
  - padded: transformers' AutoModelForSequenceClassification called once on all N, right
    padded to the longest, with their attention mask (what scoring a step in one call does).
Throughput: real tokens per second, rounds interleaving the two paths after a warm-up of
each, medians; the padded scores are checked against the packed ones (they must agree).
Memory: each path again in a fresh process of its own, the model loaded and warmed up
first; its peak resident memory over what it held before scoring (VmHWM after resetting it
through /proc/self/clear_refs, against VmRSS then). Then each path once more in a fresh
process whose address space is capped (RLIMIT_AS) at what it had mapped before scoring
plus --cap-mb: a path that needs more fails to allocate, the other scores. The load
average is printed: a figure taken under load is not a result.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

THREADS = 2
SEED = 0
MEAN_RESPONSE = 128
MAX_RESPONSE = 1024
PROMPT_RANGE = (16, 64)
PATHS = ("packed", "padded")


def completions(count: int, seed: int) -> list[list[int]]:
    """Token ids (bytes) of `count` prompt + completion sequences of skewed lengths."""
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(PROMPT_RANGE[0], PROMPT_RANGE[1] + 1, (count,), generator=generator)
    uniform = torch.rand(count, generator=generator)
    p = 1.0 / MEAN_RESPONSE
    responses = (torch.log1p(-uniform) / torch.log1p(torch.tensor(-p))).ceil().clamp(1, None)
    lengths = (prompts + responses.clamp(max=MAX_RESPONSE).long()).tolist()
    return [torch.randint(0, 256, (n,), generator=generator).tolist() for n in lengths]


class Padded:
    """One forward of every sequence, right padded, through transformers' own classifier."""

    def __init__(self, folder: Path):
        from transformers import AutoModelForSequenceClassification

        self.model = AutoModelForSequenceClassification.from_pretrained(
            folder, dtype=torch.float32, attn_implementation="sdpa"
        ).eval()
        self.pad = self.model.config.pad_token_id

    @torch.inference_mode()
    def score(self, sequences: list[list[int]]) -> list[float]:
        width = max(len(ids) for ids in sequences)
        ids = torch.full((len(sequences), width), self.pad, dtype=torch.long)  # (N, L)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)  # (N, L)
        for row, seq in enumerate(sequences):
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
        return self.model(input_ids=ids, attention_mask=mask).logits[:, 0].tolist()


def scorer(path: str, folder: Path, budget: int):
    from rlx.trainer.model.reward_model import RewardModelScorer

    if path == "packed":
        model = RewardModelScorer(str(folder), token_budget=budget)
        return model.score_token_ids
    return Padded(folder).score


def status_kib(name: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1])
    raise KeyError(name)


def child(args: argparse.Namespace) -> None:
    """One path in this fresh process: load, warm up, reset the peak, score; a JSON line."""
    torch.set_num_threads(THREADS)
    score = scorer(args.child, Path(args.folder), args.budget)
    sequences = completions(args.completions, SEED + 1)
    score(completions(8, SEED + 99))  # warm-up: thread pools, kernels
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    held = status_kib("VmRSS")
    if args.cap_mb:
        cap = status_kib("VmSize") * 1024 + args.cap_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    start = time.perf_counter()
    try:
        score(sequences)
        outcome = "scored"
    except (RuntimeError, MemoryError) as exc:
        asked = re.search(r"allocate (\d+) bytes", str(exc))
        outcome = "failed to allocate" + (f" {int(asked[1]) / 2**20:.0f} MiB" if asked else "")
    seconds = time.perf_counter() - start
    peak = status_kib("VmHWM")
    print(json.dumps({"outcome": outcome, "peak_mib": (peak - held) / 1024, "s": seconds}))


def in_process(path: str, folder: Path, args: argparse.Namespace, cap_mb: int = 0) -> dict:
    command = [sys.executable, __file__, "--child", path, "--folder", str(folder)]
    command += ["--completions", str(args.completions), "--budget", str(args.budget)]
    command += ["--cap-mb", str(cap_mb)]
    env = {**os.environ, "MALLOC_ARENA_MAX": "2", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:  # killed outright (the cap met outside torch's allocator)
        return {"outcome": f"failed: exit {done.returncode}", "peak_mib": float("nan"), "s": 0}
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--completions", type=int, default=256)
    parser.add_argument("--budget", type=int, default=4096, help="tokens per packed pass")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cap-mb", type=int, default=512, help="address space over the loaded")
    parser.add_argument("--child", choices=PATHS, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    torch.set_num_threads(THREADS)
    from rlx.trainer.model.tiny import build_tiny_reward_model

    sequences = completions(args.completions, SEED + 1)
    tokens = sum(len(ids) for ids in sequences)
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_tiny_reward_model(
            Path(tmp) / "rm",
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=max(args.hidden // 64, 1),
            seed=SEED,
        )
        score = {path: scorer(path, folder, args.budget) for path in PATHS}
        load_before = os.getloadavg()
        scores = {path: score[path](completions(8, SEED + 99)) for path in PATHS}  # warm-up
        seconds: dict[str, list[float]] = {path: [] for path in PATHS}
        for _ in range(args.rounds):
            for path in PATHS:
                start = time.perf_counter()
                scores[path] = score[path](sequences)
                seconds[path].append(time.perf_counter() - start)
        load_after = os.getloadavg()
        gap = max(abs(a - b) for a, b in zip(scores["packed"], scores["padded"], strict=True))
        del score
        free = {path: in_process(path, folder, args) for path in PATHS}
        capped = {path: in_process(path, folder, args, args.cap_mb) for path in PATHS}
        load_end = os.getloadavg()
    lengths = [len(ids) for ids in sequences]
    print(
        f"{args.completions} completions: prompts {PROMPT_RANGE[0]}-{PROMPT_RANGE[1]} tokens, "
        f"responses geometric (mean {MEAN_RESPONSE}, cut at {MAX_RESPONSE}): sequences mean "
        f"{statistics.mean(lengths):.0f}, max {max(lengths)}, {tokens} tokens "
        f"({tokens / (len(lengths) * max(lengths)):.0%} of the padded batch); reward model "
        f"hidden {args.hidden}, {args.layers} layers, float32, {THREADS} threads; packed "
        f"budget {args.budget} tokens a pass"
    )
    print(
        f"load average before {load_before[0]:.2f}, after timing {load_after[0]:.2f}, after "
        f"the memory runs {load_end[0]:.2f}; largest packed - padded score gap {gap:.1e}"
    )
    median = {path: statistics.median(seconds[path]) for path in PATHS}
    print(
        f"{'path':<7} {'tokens/s':>9} {'x padded':>9} {'peak MiB':>9} "
        f"  under a cap of {args.cap_mb} MiB over the loaded model"
    )
    for path in PATHS:
        print(
            f"{path:<7} {tokens / median[path]:>9.0f} {median['padded'] / median[path]:>9.2f} "
            f"{free[path]['peak_mib']:>9.0f}   {capped[path]['outcome']}"
        )


if __name__ == "__main__":
    main()
