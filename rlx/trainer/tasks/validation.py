"""Validation: how well the policy does on prompts it does not train on.

At step 0 and every `validation.every` steps (and the last), the engines answer every
held-out prompt twice over: once greedily (pass@1: the mean reward of the greedy answers,
the share solved where the reward is 0 or 1) and n times at the rollout temperature: the
mean reward of those samples, and from them what `rlx eval` reports (tasks/passk.py):
pass@k for k = 1, 2, 4, ... <= n, avg@n, maj@n where the reward compares answers, and the
mean response length. The numbers go into the step's metrics as val/* (rlx/runs.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlx.errors import RlxError
from rlx.recipe.model import TrainerSettings
from rlx.runs import VAL_PASS1, VAL_REWARD, val_metric
from rlx.trainer.tasks.data import PromptDataset
from rlx.trainer.tasks.passk import PromptSamples, summarize
from rlx.trainer.tasks.reward_terms import RewardInputs


def due(settings: TrainerSettings, step: int) -> bool:
    """Whether validation runs after `step` (0: before the first update)."""
    validation = settings.validation
    if validation is None:
        return False
    return step % validation.every == 0 or step == settings.steps


def load_validation_set(
    settings: TrainerSettings, tokenizer: Any, train: PromptDataset, run_dir: Path
) -> tuple[PromptDataset, int] | None:
    """The held-out prompts, less any the training data also holds: (the set, how many
    were dropped as also in training). None without a validation section."""
    from rlx.trainer.resolve import resolve_data_path
    from rlx.trainer.tasks.data import load_recipe_prompts

    validation = settings.validation
    if validation is None:
        return None
    path = resolve_data_path(
        validation.data,
        run_dir,
        settings.seed,
        field="validation.data",
        held_out=True,
        config=validation.config or settings.data.config,
        split=validation.split,
    )
    data = load_recipe_prompts(path, tokenizer, settings.data, Path.cwd())
    seen = {tuple(ids) for ids in train.prompt_token_ids}
    keep = [i for i, ids in enumerate(data.prompt_token_ids) if tuple(ids) not in seen]
    overlap = len(data) - len(keep)
    if validation.max_prompts is not None:
        keep = keep[: validation.max_prompts]
    if not keep:
        raise RlxError(
            f"trainer.validation.data: every prompt of {data.source} also appears in the "
            "training data; give held-out prompts the policy does not train on"
        )
    held_out = dataclasses.replace(
        data,
        prompts=[data.prompts[i] for i in keep],
        prompt_token_ids=[data.prompt_token_ids[i] for i in keep],
        answers=[data.answers[i] for i in keep],
        row_indices=[data.row_indices[i] for i in keep],
        columns=[data.columns[i] for i in keep] if data.columns else [],
    )
    return held_out, overlap


def validate(
    cluster: Any,
    data: PromptDataset,
    rewards: Any,
    tokenizer: Any,
    settings: TrainerSettings,
    step: int,
    episodes: Any = None,
    scorer: Any = None,
) -> Mapping[str, float]:
    """The val/* metrics of the policy the engines hold now: val/pass@1 (greedy) and, from
    validation.n samples per prompt, val/reward_mean and sampled_metrics' figures. With an
    environment (`episodes`, an EpisodeRunner) each sample is a whole episode, scored by
    the environment; failed episodes are left out. Otherwise the reward terms score them
    (`rewards`, a RewardTerms: the weighted sum of the terms, as training's reward/mean),
    and samples a weighted term failed on are left out. scorer(prompts, responses,
    answers, extra): how the samples are scored (the trainer's, within its stall window)."""
    from rlx.trainer.rollout.base import SamplingArgs
    from rlx.trainer.tasks.rewards import answer_extractor

    validation = settings.validation
    assert validation is not None
    rollout = settings.rollout
    max_new = validation.max_new_tokens or rollout.max_new_tokens
    greedy = SamplingArgs(1, max_new, rollout.min_new_tokens, 0.0, 1.0)
    sampled = SamplingArgs(
        validation.n, max_new, rollout.min_new_tokens, rollout.temperature, rollout.top_p
    )
    extract = answer_extractor(settings)
    results = {}
    for name, sampling in ((VAL_PASS1, greedy), (VAL_REWARD, sampled)):
        if episodes is not None:
            scores, responses, lengths = _episode_samples(cluster, episodes, data, sampling, step)
        else:
            scores, responses, lengths = _samples(
                cluster, data, rewards, tokenizer, sampling, step, scorer
            )
        results[name] = finite_mean(scores)
        if sampling is sampled:
            answers = [extract(r) if extract and r is not None else None for r in responses]
            results.update(
                sampled_metrics(
                    scores,
                    answers,
                    lengths,
                    validation.n,
                    validation.pass_threshold,
                    compares_answers=extract is not None,
                )
            )
    return results


def sampled_metrics(
    scores: Sequence[float],
    answers: Sequence[str | None],
    lengths: Sequence[int],
    n: int,
    pass_threshold: float,
    compares_answers: bool,
) -> dict[str, float]:
    """val/pass@k (k = 1, 2, 4, ... <= n; pass@1 as val/pass@1_sampled), val/avg@n, val/maj@n
    (where answers compare) and val/response_length, from n samples per prompt in prompt
    order, as `rlx eval` computes them (tasks/passk.py). A sample is correct when its score
    reaches pass_threshold; a failed one (NaN) is not, and avg@n leaves it out."""
    groups = range(0, len(scores), n)
    prompts = [
        PromptSamples(
            scores[i : i + n],
            [score >= pass_threshold for score in scores[i : i + n]],
            answers[i : i + n],
            lengths[i : i + n],
        )
        for i in groups
    ]
    return {val_metric(key): value for key, value in summarize(prompts, compares_answers).items()}


def finite_mean(scores: Sequence[float]) -> float:
    finite = [value for value in scores if math.isfinite(value)]
    return sum(finite) / len(finite) if finite else math.nan


def _samples(
    cluster: Any,
    data: PromptDataset,
    rewards: Any,
    tokenizer: Any,
    sampling: Any,
    step: int,
    scorer: Any,
) -> tuple[list[float], list[str | None], list[int]]:
    """Each sample's score, response text and length in tokens, prompt by prompt."""
    batch = cluster.generate(
        data.prompt_token_ids, step, show_progress=False, sampling=sampling, stream="validate"
    )
    responses = tokenizer.batch_decode(batch.response_lists(), skip_special_tokens=True)
    n = sampling.n
    prompts = [p for p in data.prompts for _ in range(n)]
    answers = [a for a in data.answers for _ in range(n)]
    extra = RewardInputs.of_rows(data, range(len(data.prompt_token_ids)), n, batch.response_lists())
    if scorer is not None:
        scores = scorer(prompts, responses, answers, extra)
    else:
        scores = rewards.score(prompts, responses, answers, extra).outcome().tolist()
    return list(scores), list(responses), batch.response_lengths.tolist()


def _episode_samples(
    cluster: Any, episodes: Any, data: PromptDataset, sampling: Any, step: int
) -> tuple[list[float], list[str | None], list[int]]:
    """Each episode's reward (NaN where it failed), no answer text, and its length."""
    from rlx.trainer.episodes.runner import episode_scores

    def submit(prompt_ids: list[list[int]], args: Any, stream: str) -> Any:
        return cluster.submit_generate(prompt_ids, step, args, f"validate/{stream}")

    rows = list(range(len(data)))
    pending = episodes.start(rows, step, submit, sampling, data)
    batch = pending.collect()
    scores = episode_scores(batch)
    return scores, [None] * len(scores), batch.response_lengths.tolist()
