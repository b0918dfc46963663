"""Token-exact trajectories: an episode is the prompt's ids, then each turn's sampled ids
and the environment's ids, concatenated as they came and never re-encoded from text.

The chat template's wrapper around an observation (the end of the model's turn, the
message's header, the next generation prompt) is rendered once per boundary and tokenized on
its own: `TurnTemplate.message_ids`. Decoding the trajectory and encoding it again would give
other ids wherever a merge crosses a boundary, a template strips whitespace or is not
append-only; `check_trajectories` proves, every step, that the ids trained at every sampled
position are the ids the engine sampled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlx.errors import RlxError
from rlx.trainer.batch import SequenceBatch
from rlx.trainer.episodes.env import EpisodeFailure

# A stand-in for an assistant turn's text: private-use characters no template rewrites.
_MARKER = "\ue000rlx-turn\ue001"


class TemplateError(RlxError):
    """The chat template cannot wrap an observation message token-exactly."""


class TokenDriftError(RlxError):
    """The ids about to be trained differ from the ids the engine sampled."""


@dataclass
class Episode:
    """One episode as it is built: the ids after the prompt and what each one is."""

    row: int  # the prompt's index in the dataset
    prompt_ids: list[int]
    env: Any = None
    ids: list[int] = field(default_factory=list)  # everything after the prompt
    sampled: list[bool] = field(default_factory=list)  # True: the model sampled this id
    logprobs: list[float] = field(default_factory=list)  # the engine's, 0 on others' ids
    turns: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each turn
    turn_ids: list[tuple[int, ...]] = field(default_factory=list)  # as the engine returned them
    rewards: list[float] = field(default_factory=list)  # one per turn
    version: int | None = None  # the oldest weights version of its turns
    finished: bool = False  # the last turn ended with the end-of-turn token
    done: bool = False  # the environment said so (or the episode ended for good)
    truncated: bool = False  # ended by max_turns or the token budget, not by the environment
    tool_calls: int = 0
    tool_errors: list[str] = field(default_factory=list)
    metrics: list[tuple[str, float]] = field(default_factory=list)  # the environment's own
    failure: str | None = None  # why the episode failed (it then trains nothing)

    def add_turn(
        self, ids: Sequence[int], logprobs: Sequence[float], version: int, finished: bool
    ) -> None:
        start = len(self.ids)
        self.ids.extend(ids)
        self.sampled.extend([True] * len(ids))
        self.logprobs.extend(logprobs)
        self.turns.append((start, len(self.ids)))
        self.turn_ids.append(tuple(ids))
        self.version = version if self.version is None else min(self.version, version)
        self.finished = finished

    def add_context(self, ids: Sequence[int]) -> None:
        """Ids the model did not sample (the environment's, a template's): context only."""
        self.ids.extend(ids)
        self.sampled.extend([False] * len(ids))
        self.logprobs.extend([0.0] * len(ids))


class TurnTemplate:
    """The tokens that wrap an observation between two model turns, from the tokenizer's
    chat template: what follows the model's end-of-turn token up to the next generation
    prompt, rendered for this one message and tokenized once."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.eos_id: int = tokenizer.eos_token_id
        self.eos_text: str = tokenizer.eos_token

    def message_ids(self, message: Mapping[str, Any]) -> list[int]:
        tokenizer = self.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError(
                "an environment returned a chat message but the tokenizer has no chat "
                "template; return the observation as text or token ids instead"
            )
        turns = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARKER}]
        text = tokenizer.apply_chat_template(
            [*turns, dict(message)], tokenize=False, add_generation_prompt=True
        )
        end = _MARKER + self.eos_text
        at = text.find(end)
        if at < 0:
            raise TemplateError(
                "the chat template does not end an assistant turn with the tokenizer's EOS "
                f"{self.eos_text!r}, so an observation cannot follow a sampled turn "
                "token-exactly; return observations as text or token ids"
            )
        return list(tokenizer(text[at + len(end) :], add_special_tokens=False)["input_ids"])

    def observation_ids(self, observation: Any) -> list[int]:
        """The ids an observation adds: a chat message through the template, text tokenized
        as is, ids as given."""
        if isinstance(observation, str):
            return list(self.tokenizer(observation, add_special_tokens=False)["input_ids"])
        if isinstance(observation, Mapping):
            return self.message_ids(observation)
        ids = [int(t) for t in observation]
        if any(t >= len(self.tokenizer) for t in ids):
            raise EpisodeFailure(
                f"step() returned observation ids past the vocabulary ({len(self.tokenizer)})"
            )
        return ids


def check_trajectories(batch: SequenceBatch, episodes: Sequence[Episode], step: int) -> int:
    """Every sampled id of every episode is the id the batch trains at its position, and
    is trained (loss mask on); raises TokenDriftError with one line if not. Returns the
    number of positions checked."""
    width = batch.prompt_width
    checked = 0
    for row, episode in enumerate(episodes):
        if episode.failure is not None:
            continue
        for turn, ((start, end), ids) in enumerate(
            zip(episode.turns, episode.turn_ids, strict=True)
        ):
            trained = batch.input_ids[row, width + start : width + end].tolist()
            masked = batch.response_mask[row, start:end]
            if trained != list(ids) or not bool(masked.all()):
                wrong = sum(a != b for a, b in zip(trained, ids, strict=False))
                wrong += abs(len(trained) - len(ids)) + int((~masked).sum())
                raise TokenDriftError(
                    f"step {step}: episode {row} turn {turn}: {wrong} of {len(ids)} trained "
                    "ids differ from the ids the engine sampled (or are not trained); the "
                    "trajectory was changed after sampling, and the run stops"
                )
            checked += len(ids)
    return checked


def rebuild_from_text(episode: Episode, prompt_text: str, tokenizer: Any) -> list[int]:
    """The trajectory the way token drift happens: each turn decoded to text, the
    environment's ids decoded too, the whole re-encoded from the text. For tests and the
    benchmark that show check_trajectories can fail; rlx never trains on this."""
    text = prompt_text + tokenizer.decode(episode.ids, skip_special_tokens=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def count_mismatches(episode: Episode, rebuilt: Sequence[int]) -> int:
    """Sampled positions of `episode` where `rebuilt` (prompt included) holds another id."""
    offset = len(episode.prompt_ids)
    wrong = 0
    for position, (token, sampled) in enumerate(zip(episode.ids, episode.sampled, strict=True)):
        if sampled:
            at = offset + position
            wrong += at >= len(rebuilt) or rebuilt[at] != token
    return wrong


def as_tensors(
    episodes: Sequence[Episode], pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (ids, real mask, loss mask, engine log-probs, turn rewards), each (N, R):
    a failed episode keeps its ids as context but trains nothing."""
    width = max((len(e.ids) for e in episodes), default=0)
    rows = len(episodes)
    ids = torch.full((rows, width), pad_token_id, dtype=torch.long)
    real = torch.zeros((rows, width), dtype=torch.bool)
    loss = torch.zeros((rows, width), dtype=torch.bool)
    logprobs = torch.zeros((rows, width), dtype=torch.float32)
    rewards = torch.zeros((rows, width), dtype=torch.float32)
    for row, episode in enumerate(episodes):
        length = len(episode.ids)
        ids[row, :length] = torch.tensor(episode.ids, dtype=torch.long)
        real[row, :length] = True
        if episode.failure is not None:
            continue
        loss[row, :length] = torch.tensor(episode.sampled, dtype=torch.bool)
        logprobs[row, :length] = torch.tensor(episode.logprobs, dtype=torch.float32)
        for (start, end), reward in zip(episode.turns, episode.rewards, strict=False):
            if end > start:
                rewards[row, end - 1] += reward
    return ids, real, loss, logprobs, rewards
