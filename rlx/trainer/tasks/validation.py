"""Validation: how well the policy does on prompts it does not train on.

At step 0 and every `validation.every` steps (and the last), the engines answer every
held-out prompt twice over: once greedily (pass@1: the mean reward of the greedy answers,
the share solved where the reward is 0 or 1) and n times at the rollout temperature (the
mean reward of those samples). The numbers go into the step's metrics as val/*.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlx.errors import RlxError
from rlx.recipe.model import TrainerSettings
from rlx.runs import VAL_PASS1, VAL_REWARD
from rlx.trainer.tasks.data import PromptDataset
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
    """val/pass@1 and val/reward_mean of the policy the engines hold now. With an
    environment (`episodes`, an EpisodeRunner) each sample is a whole episode, scored by
    the environment; failed episodes are left out. Otherwise the reward terms score them
    (`rewards`, a RewardTerms: the weighted sum of the terms, as training's reward/mean),
    and samples a weighted term failed on are left out. scorer(prompts, responses,
    answers, extra): how the samples are scored (the trainer's, within its stall window)."""
    from rlx.trainer.rollout.base import SamplingArgs

    validation = settings.validation
    assert validation is not None
    rollout = settings.rollout
    max_new = validation.max_new_tokens or rollout.max_new_tokens
    greedy = SamplingArgs(1, max_new, rollout.min_new_tokens, 0.0, 1.0)
    sampled = SamplingArgs(
        validation.n, max_new, rollout.min_new_tokens, rollout.temperature, rollout.top_p
    )
    results = {}
    for name, sampling in ((VAL_PASS1, greedy), (VAL_REWARD, sampled)):
        if episodes is not None:
            results[name] = _episode_mean(cluster, episodes, data, sampling, step)
            continue
        batch = cluster.generate(
            data.prompt_token_ids, step, show_progress=False, sampling=sampling, stream="validate"
        )
        responses = tokenizer.batch_decode(batch.response_lists(), skip_special_tokens=True)
        n = sampling.n
        prompts = [p for p in data.prompts for _ in range(n)]
        answers = [a for a in data.answers for _ in range(n)]
        extra = RewardInputs(
            prompt_ids=[p for p in data.prompt_token_ids for _ in range(n)],
            response_ids=batch.response_lists(),
            messages=[m for m in data.messages for _ in range(n)] if data.messages else None,
        )
        if scorer is not None:
            scores = scorer(prompts, responses, answers, extra)
        else:
            scores = rewards.score(prompts, responses, answers, extra).outcome().tolist()
        finite = [value for value in scores if math.isfinite(value)]
        results[name] = sum(finite) / len(finite) if finite else math.nan
    return results


def _episode_mean(cluster: Any, episodes: Any, data: PromptDataset, sampling: Any, step: int):
    from rlx.trainer.episodes.runner import episode_scores

    def submit(prompt_ids: list[list[int]], args: Any, stream: str) -> Any:
        return cluster.submit_generate(prompt_ids, step, args, f"validate/{stream}")

    rows = list(range(len(data)))
    pending = episodes.start(rows, step, submit, sampling, data)
    scores = episode_scores(pending.collect())
    return sum(scores) / max(len(scores), 1)
