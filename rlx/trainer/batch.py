"""One step's samples: as the engines return them (RolloutBatch) and as the trainer's
forward passes take them (SequenceBatch), and how they are cut up. A leaf: torch only.

A RolloutBatch holds len(prompts) * n responses, right-padded, with their sampling
log-probs. A SequenceBatch holds B rows of prompt + response: prompts left-padded to width
P, responses right-padded to width R, so every response starts at column P and the logit at
column P - 1 predicts its first token. Per-token tensors computed along the step (old and reference
log-probs, values, advantages, returns) ride along in `fields`, each (B, R).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

# The names of SequenceBatch.fields: per-token tensors computed along the step, each (B, R).
# OLD_LOGP: pi_old's log-probs (when the update cannot take its own, detached); REF_LOGP: the
# reference's (KL on); VALUES: the critic's; ADVANTAGES and RETURNS: what the update trains
# towards; BEHAV_LOGP: the engines' sampling log-probs, sent only where engine and learner
# can disagree (learn.learner.sends_engine_logprobs).
OLD_LOGP = "old_logp"
REF_LOGP = "ref_logp"
VALUES = "values"
ADVANTAGES = "advantages"
RETURNS = "returns"
BEHAV_LOGP = "behav_logp"


@dataclass
class RolloutBatch:
    """Samples of one generate call: len(prompts) * n rows, grouped by prompt
    (rows i*n .. i*n+n-1 answer prompt i).

    response_ids are right-padded with pad_token_id; response_mask is True on real tokens,
    the terminating EOS included; logprobs are float32 sampling log-probs, 0 where masked.
    finished is True where the response ended with EOS (False: cut at max_new_tokens).
    weight_version is the engine's weights version when it sampled them; versions holds it
    per row once batches of several engines are joined (None: every row is weight_version).

    Multi-turn episodes (episodes/runner.py) fill three more: the response is the whole
    trajectory after the prompt, the model's turns and the environment's tokens in order;
    loss_mask is True on the model's own (sampled) tokens only, the environment's being
    context; token_rewards holds each turn's reward on its last sampled token; episodes the
    per-row records (turn boundaries, counts, failures).
    """

    prompt_ids: list[list[int]]
    response_ids: torch.Tensor  # (N, R) long
    response_mask: torch.Tensor  # (N, R) bool
    logprobs: torch.Tensor  # (N, R) float32
    finished: torch.Tensor  # (N,) bool
    n: int
    pad_token_id: int
    weight_version: int
    versions: torch.Tensor | None = None  # (N,) long
    loss_mask: torch.Tensor | None = None  # (N, R) bool, None: response_mask
    token_rewards: torch.Tensor | None = None  # (N, R) float32
    episodes: Sequence[Any] | None = None

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def row_versions(self) -> torch.Tensor:
        """The weights version each row was sampled with: (N,) long."""
        if self.versions is not None:
            return self.versions
        return torch.full((self.response_ids.shape[0],), self.weight_version, dtype=torch.long)

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.sum(dim=1)  # (N,)

    def response_lists(self) -> list[list[int]]:
        """Each response's tokens without padding (EOS kept where it was generated)."""
        lengths = self.response_lengths.tolist()
        return [
            row[:length] for row, length in zip(self.response_ids.tolist(), lengths, strict=True)
        ]


def pad_responses(
    responses: Sequence[Sequence[int]],
    logprobs: Sequence[Sequence[float]],
    pad_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad ragged responses: (ids, mask, logprobs), each (N, max length)."""
    width = max((len(r) for r in responses), default=0)
    ids = torch.full((len(responses), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(responses), width), dtype=torch.bool)
    values = torch.zeros((len(responses), width), dtype=torch.float32)
    for row, (tokens, lps) in enumerate(zip(responses, logprobs, strict=True)):
        if len(tokens) != len(lps):
            raise ValueError(f"response {row}: {len(tokens)} tokens but {len(lps)} log-probs")
        ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        mask[row, : len(tokens)] = True
        values[row, : len(tokens)] = torch.tensor(lps, dtype=torch.float32)
    return ids, mask, values


@dataclass(frozen=True)
class SequenceBatch:
    input_ids: Tensor  # (B, P + R) long
    attention_mask: Tensor  # (B, P + R) long, 0 on padding
    response_mask: Tensor  # (B, R) bool, True on real response tokens
    prompt_width: int  # P
    fields: Mapping[str, Tensor] = field(default_factory=dict)  # name -> (B, R)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_ids(self) -> Tensor:
        return self.input_ids[:, self.prompt_width :]  # (B, R)

    @property
    def position_ids(self) -> Tensor:
        # What generate used: positions count real tokens only, so left padding is invisible.
        return (self.attention_mask.cumsum(dim=-1) - 1).clamp(min=0)  # (B, P + R)

    @property
    def num_tokens(self) -> int:
        """Prompt and response tokens actually processed (padding excluded)."""
        return int(self.attention_mask.sum())

    def with_fields(self, **tensors: Tensor) -> SequenceBatch:
        for name, tensor in tensors.items():
            if tensor.shape != self.response_mask.shape:
                raise ValueError(
                    f"field {name!r} has shape {tuple(tensor.shape)}, the responses are "
                    f"{tuple(self.response_mask.shape)}"
                )
        return replace(self, fields={**self.fields, **tensors})

    def select(self, rows: Tensor | Sequence[int]) -> SequenceBatch:
        index = torch.as_tensor(rows, dtype=torch.long)
        return SequenceBatch(
            input_ids=self.input_ids[index],
            attention_mask=self.attention_mask[index],
            response_mask=self.response_mask[index],
            prompt_width=self.prompt_width,
            fields={name: tensor[index] for name, tensor in self.fields.items()},
        )

    def chunks(self, size: int) -> list[SequenceBatch]:
        """Consecutive pieces of at most `size` rows."""
        return [self.select(range(s, min(s + size, len(self)))) for s in range(0, len(self), size)]

    def trimmed(self) -> SequenceBatch:
        """The same rows without columns that are padding in every row: a micro-batch of
        short prompts or responses then costs only what it holds."""
        prompt_real = self.attention_mask[:, : self.prompt_width].any(dim=0)  # (P,)
        response_real = self.response_mask.any(dim=0)  # (R,)
        first = int(prompt_real.long().argmax()) if bool(prompt_real.any()) else self.prompt_width
        # A micro-batch that trains no token (every response cut and masked, every episode
        # failed) keeps one column: its pass still runs the model, so the loss stays in the
        # graph (zero gradients) and the ranks' collectives stay in step.
        width = int(response_real.nonzero().max()) + 1 if bool(response_real.any()) else 1
        width = min(width, self.response_mask.shape[1])
        if first == 0 and width == self.response_mask.shape[1]:
            return self
        end = self.prompt_width + width
        return SequenceBatch(
            input_ids=self.input_ids[:, first:end],
            attention_mask=self.attention_mask[:, first:end],
            response_mask=self.response_mask[:, :width],
            prompt_width=self.prompt_width - first,
            fields={name: tensor[:, :width] for name, tensor in self.fields.items()},
        )

    def to(self, device: torch.device | str) -> SequenceBatch:
        return SequenceBatch(
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            response_mask=self.response_mask.to(device),
            prompt_width=self.prompt_width,
            fields={name: tensor.to(device) for name, tensor in self.fields.items()},
        )


def micro_batch_rows(
    batch: SequenceBatch, size: int, max_tokens: int | None = None
) -> list[list[int]]:
    """The rows of each forward/backward pass: consecutive pieces of `size` rows, or, with
    `max_tokens`, rows sorted longest first and packed greedily so that each piece holds at
    most max_tokens real (prompt + response) tokens; a longer row goes alone. Which rows
    share a pass never changes the update: losses are divided by the minibatch's counts."""
    if max_tokens is None:
        return [list(range(s, min(s + size, len(batch)))) for s in range(0, len(batch), size)]
    tokens = batch.attention_mask.sum(dim=1).tolist()  # (B,) real tokens per row
    order = sorted(range(len(batch)), key=lambda row: -tokens[row])
    pieces: list[list[int]] = []
    held = 0
    for row in order:
        if not pieces or held + tokens[row] > max_tokens:
            pieces.append([])
            held = 0
        pieces[-1].append(row)
        held += tokens[row]
    return pieces


def concat_rollouts(batches: Sequence[RolloutBatch]) -> RolloutBatch:
    """Join the batches of several engines, in the order given (each keeps its prompt groups)."""
    if not batches:
        raise ValueError("concat_rollouts needs at least one batch")
    if len(batches) == 1:
        return batches[0]
    return join_groups([(batch, g) for batch in batches for g in range(len(batch) // batch.n)])


def _padded(tensor: torch.Tensor, width: int, value: float | bool) -> torch.Tensor:
    return F.pad(tensor, (0, width - tensor.shape[1]), value=value)


def join_groups(picks: Sequence[tuple[RolloutBatch, int]]) -> RolloutBatch:
    """One rollout of the groups picked, in the order given: (batch, group index) each, the
    batches alike in n and pad token. Every per-row field travels, episodes' included;
    responses are right-padded to the longest."""
    if not picks:
        raise ValueError("join_groups needs at least one group")
    first = picks[0][0]
    n, pad = first.n, first.pad_token_id
    width = max(batch.response_ids.shape[1] for batch, _ in picks)
    with_loss_mask = any(batch.loss_mask is not None for batch, _ in picks)
    with_token_rewards = any(batch.token_rewards is not None for batch, _ in picks)
    with_episodes = any(batch.episodes is not None for batch, _ in picks)
    parts: dict[str, list] = {k: [] for k in ("ids", "mask", "logp", "done", "ver", "lm", "tr")}
    prompts: list[list[int]] = []
    episodes: list = []
    for batch, group in picks:
        if batch.n != n or batch.pad_token_id != pad:
            raise ValueError("rollout batches disagree on n or on the pad token")
        rows = slice(group * n, (group + 1) * n)
        parts["ids"].append(_padded(batch.response_ids[rows], width, pad))
        parts["mask"].append(_padded(batch.response_mask[rows], width, False))
        parts["logp"].append(_padded(batch.logprobs[rows], width, 0.0))
        parts["done"].append(batch.finished[rows])
        parts["ver"].append(batch.row_versions[rows])
        if with_loss_mask:
            loss_mask = batch.response_mask if batch.loss_mask is None else batch.loss_mask
            parts["lm"].append(_padded(loss_mask[rows], width, False))
        if with_token_rewards:
            assert batch.token_rewards is not None, "a round without its episodes' rewards"
            parts["tr"].append(_padded(batch.token_rewards[rows], width, 0.0))
        if with_episodes:
            assert batch.episodes is not None, "a round without its episodes"
            episodes.extend(batch.episodes[rows])
        prompts.extend(batch.prompt_ids[rows])
    return RolloutBatch(
        prompt_ids=prompts,
        response_ids=torch.cat(parts["ids"]),
        response_mask=torch.cat(parts["mask"]),
        logprobs=torch.cat(parts["logp"]),
        finished=torch.cat(parts["done"]),
        n=n,
        pad_token_id=pad,
        weight_version=min(batch.weight_version for batch, _ in picks),
        versions=torch.cat(parts["ver"]),
        loss_mask=torch.cat(parts["lm"]) if with_loss_mask else None,
        token_rewards=torch.cat(parts["tr"]) if with_token_rewards else None,
        episodes=episodes if with_episodes else None,
    )


def pack_rollout(batch: RolloutBatch) -> SequenceBatch:
    """Prompt and response rows side by side: prompts left-padded, responses as generated.
    Every real token is attended to; the loss counts the model's own tokens only (for an
    episode the environment's tokens are context)."""
    rows = len(batch)
    width = max(len(ids) for ids in batch.prompt_ids)
    prompt_ids = torch.full((rows, width), batch.pad_token_id, dtype=torch.long)  # (B, P)
    prompt_mask = torch.zeros((rows, width), dtype=torch.long)  # (B, P)
    for row, ids in enumerate(batch.prompt_ids):
        prompt_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        prompt_mask[row, width - len(ids) :] = 1
    return SequenceBatch(
        input_ids=torch.cat([prompt_ids, batch.response_ids], dim=1),  # (B, P + R)
        attention_mask=torch.cat([prompt_mask, batch.response_mask.long()], dim=1),
        response_mask=batch.response_mask if batch.loss_mask is None else batch.loss_mask,
        prompt_width=width,
    )


def outcome_token_rewards(scores: Tensor, response_mask: Tensor) -> Tensor:
    """Each response's score on its last real token, 0 elsewhere: (B,), (B, R) -> (B, R).

    A response with no tokens at all has nowhere to put its score; it carries none (and,
    with no tokens, contributes nothing to any loss either)."""
    lengths = response_mask.long().sum(dim=1)  # (B,)
    last = (lengths - 1).clamp(min=0)  # (B,)
    rewards = torch.zeros(response_mask.shape, dtype=torch.float32)  # (B, R)
    if rewards.shape[1] == 0:
        return rewards
    rewards.scatter_(1, last.unsqueeze(1), scores.float().unsqueeze(1))
    return torch.where(response_mask, rewards, 0.0)


def split_evenly(count: int, parts: int) -> list[range]:
    """Consecutive ranges covering 0..count-1 in `parts` pieces whose sizes differ by at most 1
    (the first ones get the extra items)."""
    base, extra = divmod(count, parts)
    ranges, start = [], 0
    for part in range(parts):
        size = base + (1 if part < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges
