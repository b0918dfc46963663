"""Episodes on a real engine, for the token-exactness test and benchmark.

`Tools` answers every turn in turn with a chat message (through the template), plain text
glued to the turn (where a merge can cross the boundary) and raw ids; `run_episodes` drives an
EpisodeRunner over an engine in this process; `learner_gaps` scores the trained positions
with the policy, teacher-forced as the learner does, against the engine's log-probs.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlx.recipe.model import TrainerSettings
from rlx.trainer.batch import RolloutBatch, SequenceBatch
from rlx.trainer.episodes.env import Row, Step, Turn
from rlx.trainer.rollout.base import SamplingArgs


class Tools:
    """Three kinds of observation in turn; done after three turns."""

    def reset(self, row: Row) -> None:
        self.rng = random.Random(row.index)
        self.turns = 0

    def step(self, turn: Turn) -> Step:
        self.turns += 1
        number = self.rng.randint(0, 999)
        kind = self.turns % 3
        if kind == 1:
            observation: Any = {"role": "tool", "content": f"{number} is the code"}
        elif kind == 2:
            observation = f"{number}?calc"  # text right after the turn, no separator
        else:
            observation = [self.rng.randint(0, 255) for _ in range(3)]
        return Step(observation=observation, reward=len(turn.ids) / 100, done=self.turns >= 3)


@dataclass
class Ready:
    """A generate call that already ran (the engine is in this process)."""

    batch: RolloutBatch

    def collect(self, show_progress: bool = False) -> RolloutBatch:
        return self.batch


def settings_for(model_dir: Path, data: Path, max_new_tokens: int, n: int) -> TrainerSettings:
    return TrainerSettings.model_validate(
        {
            "model": {"path": str(model_dir), "dtype": "float32"},
            "data": {"train": str(data), "max_prompt_length": 64},
            "rollout": {"n": n, "max_new_tokens": max_new_tokens},
            "environment": {"function": "tests.support.episodes:Tools", "max_turns": 4},
        }
    )


def write_prompts(path: Path, count: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    rows = [
        {
            "prompt": f"call the tool for box {rng.randint(0, 999)} and sum {rng.randint(0, 99)}",
            "answer": "",
        }
        for _ in range(count)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def run_episodes(engine: Any, settings: TrainerSettings, tokenizer: Any, prompts: int):
    """Episodes of the first `prompts` rows, n each: (the batch, the dataset, the lines said)."""
    from rlx.trainer.episodes.runner import EpisodeRunner
    from rlx.trainer.tasks.data import load_recipe_prompts

    data = load_recipe_prompts(Path(settings.data.train), tokenizer, settings.data)
    said: list[str] = []
    runner = EpisodeRunner(settings, Tools, tokenizer, data, said.append)
    calls = iter(range(1_000_000))

    def submit(prompt_ids: list[list[int]], sampling: SamplingArgs, stream: str) -> Ready:
        return Ready(engine.generate(prompt_ids, sampling, seed=next(calls)))

    rows = list(range(prompts))
    sampling = SamplingArgs(settings.rollout.n, settings.rollout.max_new_tokens)
    try:
        batch = runner.start(rows, 1, submit, sampling).collect()
    finally:
        runner.close()
    return batch, data, said


def learner_gaps(model: Any, packed: SequenceBatch, rollout: RolloutBatch) -> torch.Tensor:
    """Per episode: |sum of the policy's log-probs - sum of the engine's| over the trained
    positions, teacher-forced on exactly the packed ids (B,)."""
    with torch.no_grad():
        logits = model(
            input_ids=packed.input_ids,
            attention_mask=packed.attention_mask,
            position_ids=packed.position_ids,
        ).logits.float()  # (B, P + R, V)
    width = packed.prompt_width
    predicting = logits[:, width - 1 : -1]  # (B, R, V) the logit before each response token
    logprobs = torch.log_softmax(predicting, dim=-1)
    taken = logprobs.gather(2, packed.response_ids.unsqueeze(-1)).squeeze(-1)  # (B, R)
    mask = packed.response_mask
    ours = torch.where(mask, taken, 0.0).sum(dim=1)
    theirs = torch.where(mask, rollout.logprobs, 0.0).sum(dim=1)
    return (ours - theirs).abs()
