"""Tokens per second of the learner's update on a skewed length mix: micro-batches cut by a
count (the default when packing is off), sorted token-budget micro-batches, and packed rows.

    python bench/packing.py [--rounds R] [--sequences N] [--group G] [--budget TOKENS]
                            [--hidden H]

What runs: rlx's Learner (one rank, CPU, float32, 2 torch threads) over a tiny Qwen2
(hidden 256, 4 layers by default) doing GRPO updates (policy forward and backward, a k3 KL
term to a reference model in the loss, so the reference's forward runs too) on N = 32
sequences a step. The length mix, like a GRPO step's: prompts uniform in 16..64 tokens,
responses from a geometric distribution of mean 128 tokens cut at 384 (most responses
short, a few at the limit); the same seeded mix for every variant. --group G: G responses
per prompt, as GRPO samples them (N / G prompts): padded micro-batches then run a prompt
once for the rows of it they hold, packed rows once for the responses of a segment.
Variants, each over the same batches:
  - count: micro_batch_size 4 rows, each micro-batch padded to its longest row (prompts to
    the left, responses to the right; columns that are padding in every row trimmed);
  - sorted: max_tokens_per_micro_batch = the budget, rows sorted by length and cut greedily,
    padded as above;
  - packed: trainer.batch.packing, passes of at most the budget, rows of at most
    rlx.trainer.packing.masked_row_tokens(hidden) (512 at hidden 256).
Per variant: real (prompt + response) tokens per second of the update and the share of the
positions computed that were padding (perf/padding_fraction, as the learner logs it).
Rounds interleave the variants (count, sorted, packed, count, ...) after one warm-up update
each; the table shows medians and ratios to `count` and `sorted`, and the load average
(a figure taken under load is not a result).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

THREADS = 2
SEED = 0
MEAN_RESPONSE = 128
MAX_RESPONSE = 384
PROMPT_RANGE = (16, 64)
VARIANTS = ("count", "sorted", "packed")


def length_mix(count: int, seed: int, group: int = 1) -> list[tuple[int, int]]:
    """(prompt, response) lengths: prompts uniform (each for `group` sequences in a row),
    responses geometric cut at the limit."""
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(
        PROMPT_RANGE[0], PROMPT_RANGE[1] + 1, (-(-count // group),), generator=generator
    ).repeat_interleave(group)[:count]
    uniform = torch.rand(count, generator=generator)
    p = 1.0 / MEAN_RESPONSE
    responses = (torch.log1p(-uniform) / torch.log1p(torch.tensor(-p))).ceil().clamp(1, None)
    responses = responses.clamp(max=MAX_RESPONSE).long()
    return list(zip(prompts.tolist(), responses.tolist(), strict=True))


def make_batch(lengths: list[tuple[int, int]], vocab: int, seed: int, group: int = 1) -> Any:
    from rlx.trainer.batch import ADVANTAGES, RolloutBatch, pack_rollout, pad_responses

    generator = torch.Generator().manual_seed(seed)
    prompts: list[list[int]] = []
    for index, (p, _) in enumerate(lengths):  # a group's sequences share their prompt's ids
        fresh = index % group == 0
        prompts.append(
            torch.randint(3, vocab, (p,), generator=generator).tolist() if fresh else prompts[-1]
        )
    responses = [torch.randint(3, vocab, (r,), generator=generator).tolist() for _, r in lengths]
    ids, mask, logprobs = pad_responses(responses, [[0.0] * len(r) for r in responses], 0)
    rollout = RolloutBatch(
        prompt_ids=prompts,
        response_ids=ids,
        response_mask=mask,
        logprobs=logprobs,
        finished=torch.ones(len(lengths), dtype=torch.bool),
        n=1,
        pad_token_id=0,
        weight_version=0,
    )
    batch = pack_rollout(rollout)
    advantages = torch.randn(mask.shape, generator=generator) * mask
    return batch.with_fields(**{ADVANTAGES: advantages})


def settings_for(variant: str, model: Path, sequences: int, budget: int) -> Any:
    from rlx.recipe import parse_recipe

    batch: dict[str, Any] = {
        "prompts_per_step": sequences,
        "micro_batch_size": 4,
        "packing": variant == "packed",
    }
    if variant != "count":
        batch["max_tokens_per_micro_batch"] = budget
    recipe = {
        "name": "bench-packing",
        "trainer": {
            "algorithm": "grpo",
            "model": {"path": str(model), "dtype": "float32"},
            "data": {"train": "synthetic:letters_or_digits", "max_prompt_length": 64},
            "rollout": {"engine": "hf", "n": 1, "max_new_tokens": MAX_RESPONSE},
            "algo": {"kl": {"coef": 0.04, "estimator": "k3", "mode": "loss"}},
            "optim": {"lr": 1e-5},
            "batch": batch,
            "steps": 1000,
            "seed": SEED,
        },
    }
    return parse_recipe(json.dumps(recipe), "bench-packing.yaml").recipe.trainer


def measure(learner: Any, batch: Any, step: int) -> tuple[float, float]:
    """(real tokens per second, padding fraction) of one update with its reference pass."""
    from rlx.trainer.batch import REF_LOGP
    from rlx.trainer.learn.learner import PADDING_FRACTION, merge_update_stats

    started = time.perf_counter()
    with learner.no_grad():
        ref = learner._prepare(batch, old_logprobs=False)[REF_LOGP]
    stats = learner.update(batch.with_fields(**{REF_LOGP: ref}), step)
    seconds = time.perf_counter() - started
    padding = merge_update_stats([stats])[PADDING_FRACTION]
    return batch.num_tokens * 2 / seconds, padding  # the reference's pass and the update's


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--group", type=int, default=1, help="responses per prompt")
    parser.add_argument("--budget", type=int, default=2048, help="tokens per pass")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    torch.manual_seed(SEED)
    from rlx.trainer.learn.learner import Learner
    from rlx.trainer.model.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(
            Path(tmp) / "model",
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=args.hidden // 64,
            seed=SEED,
        )
        learners = {
            v: Learner(
                settings_for(v, model, args.sequences, args.budget),
                str(model),
                None,
                torch.device("cpu"),
            )
            for v in VARIANTS
        }
        vocab = learners["count"].policy.config.vocab_size
        results: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
        mixes = [length_mix(args.sequences, SEED + r, args.group) for r in range(args.rounds + 1)]
        batches = [make_batch(mix, vocab, SEED + r, args.group) for r, mix in enumerate(mixes)]
        for variant in VARIANTS:  # warm-up
            measure(learners[variant], batches[0], 0)
        load_before = os.getloadavg()
        for r in range(1, args.rounds + 1):
            for variant in VARIANTS:
                results[variant].append(measure(learners[variant], batches[r], r))
        load_after = os.getloadavg()
    tokens = [sum(p + s for p, s in mix) for mix in mixes[1:]]
    responses = [s for mix in mixes[1:] for _, s in mix]
    print(
        f"length mix: {args.sequences} sequences a step ({args.group} per prompt), prompts "
        f"{PROMPT_RANGE[0]}-"
        f"{PROMPT_RANGE[1]}, responses geometric (mean {MEAN_RESPONSE}, cut at {MAX_RESPONSE}): "
        f"measured mean {statistics.mean(responses):.0f}, max {max(responses)}, "
        f"{statistics.mean(tokens):.0f} tokens a step; budget {args.budget} tokens a pass; "
        f"model hidden {args.hidden}, {args.layers} layers; {THREADS} threads"
    )
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    median = {v: statistics.median(t for t, _ in results[v]) for v in VARIANTS}
    print(f"{'variant':<8} {'tokens/s':>9} {'padding':>8} {'x count':>8} {'x sorted':>9}")
    for variant in VARIANTS:
        padding = statistics.mean(p for _, p in results[variant])
        print(
            f"{variant:<8} {median[variant]:>9.0f} {padding:>8.1%} "
            f"{median[variant] / median['count']:>8.2f} {median[variant] / median['sorted']:>9.2f}"
        )


if __name__ == "__main__":
    main()
