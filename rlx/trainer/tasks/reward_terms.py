"""A run's rewards as weighted terms (trainer.rewards, or trainer.reward as one term).

Each term scores every sample: a function (rlx.trainer.tasks.rewards) or an HTTP reward
server (rlx.trainer.tasks.reward_server). A term that fails on a sample (it raised, timed
out, gave null or a number that is not finite) gives that sample NaN, never 0. A sample
with NaN in any weighted term (weight != 0) is failed: it trains nothing and its group's
baseline is made of the others. Weight-0 terms are monitors: scored and logged only.

combine() makes the two totals the trainer reads: the outcome (the weighted sum of the raw
terms, what reward/mean reports) and what the advantages read (the same sum, or with
normalize_then_sum the weighted sum of each term normalised over its group).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from rlx.errors import RlxError
from rlx.trainer.tasks.rewards import RewardFn, resolve_reward, reward_name


@dataclass(frozen=True)
class RewardInputs:
    """What a sample is beside its text, for the terms that read more (a reward model):
    the prompt's and the response's token ids as the policy read and wrote them, and the
    prompt's messages (the chat the prompt was rendered from; a text prompt is one user
    message). Each list has one entry per sample; None where the caller has none."""

    prompt_ids: Sequence[Sequence[int]] | None = None
    response_ids: Sequence[Sequence[int]] | None = None
    messages: Sequence[Sequence[Mapping[str, str]]] | None = None

    @classmethod
    def of_rows(
        cls, data: Any, rows: Sequence[int], n: int, response_ids: Sequence[Sequence[int]]
    ) -> RewardInputs:
        """n samples of each of the dataset's `rows` (a PromptDataset), in order, and the
        responses' token ids."""
        messages = data.messages
        return cls(
            prompt_ids=[data.prompt_token_ids[i] for i in rows for _ in range(n)],
            response_ids=response_ids,
            messages=[messages[i] for i in rows for _ in range(n)] if messages else None,
        )


class TermScorer(Protocol):
    def __call__(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        answers: Sequence[str | None],
        inputs: RewardInputs | None = None,
    ) -> tuple[list[float], str | None]: ...


@dataclass
class Term:
    """One term, ready to score: (values with NaN where failed, the first failure)."""

    name: str
    weight: float
    scorer: TermScorer
    source: str  # what it is, for the stop line: "function gsm8k", "url http://..."


@dataclass(frozen=True)
class TermScores:
    """The samples scored by every term."""

    names: list[str]
    weights: list[float]
    values: torch.Tensor  # (K, B) each term's value per sample, NaN where it failed
    first_errors: list[str | None]  # per term: its first failure in words
    sources: list[str]

    @classmethod
    def of(
        cls,
        terms: RewardTerms,
        rows: Sequence[Sequence[float]],
        errors: Sequence[str | None],
        size: int,
    ) -> TermScores:
        """The terms' values (one row per term, `size` samples each) as scored."""
        for term, row in zip(terms.terms, rows, strict=True):
            if len(row) != size:
                raise RlxError(
                    f"reward term {term.name!r} ({term.source}) gave {len(row)} values for "
                    f"{size} samples"
                )
        values = torch.tensor([list(row) for row in rows], dtype=torch.float64)
        return cls(
            [t.name for t in terms.terms],
            [t.weight for t in terms.terms],
            values.reshape(len(terms.terms), size),
            list(errors),
            [t.source for t in terms.terms],
        )

    @property
    def failed(self) -> torch.Tensor:
        """(B,) bool: a weighted term failed on the sample."""
        weighted = torch.tensor([w != 0 for w in self.weights], dtype=torch.bool)
        if self.values.shape[1] == 0:
            return torch.zeros(0, dtype=torch.bool)
        return (~torch.isfinite(self.values[weighted])).any(dim=0)

    def outcome(self) -> torch.Tensor:
        """(B,) the weighted sum of the raw weighted terms; NaN on failed samples."""
        return combine(self.values, self.weights, "sum_then_normalize", 1)[0]

    def metrics(self) -> dict[str, float]:
        """reward/<name>/mean over the term's finite values and reward/<name>/failed (how
        many samples it failed on); reward/failed: the share of samples that failed."""
        out: dict[str, float] = {}
        for name, row in zip(self.names, self.values, strict=True):
            finite = row[torch.isfinite(row)]
            out[f"reward/{name}/mean"] = float(finite.mean()) if len(finite) else math.nan
            out[f"reward/{name}/failed"] = float((~torch.isfinite(row)).sum())
        failed = self.failed
        out["reward/failed"] = float(failed.float().mean()) if len(failed) else 0.0
        return out

    def failure_line(self) -> str:
        """Which terms failed on how many samples, and the first failure of each."""
        parts = []
        for name, source, row, error in zip(
            self.names, self.sources, self.values, self.first_errors, strict=True
        ):
            count = int((~torch.isfinite(row)).sum())
            if count:
                parts.append(f"{name} ({source}) failed on {count}: {error}")
        return "; ".join(parts)


class RewardTerms:
    """The run's terms: score() every sample with each."""

    def __init__(self, terms: Sequence[Term], aggregate: str = "sum_then_normalize") -> None:
        self.terms = list(terms)
        self.aggregate = aggregate

    def use_policy_tokenizer(self, tokenizer: Any) -> None:
        """Tell the reward-model terms the policy's tokenizer: one that shares it reads the
        policy's token ids as they are."""
        for term in self.terms:
            bind = getattr(term.scorer, "use_policy_tokenizer", None)
            if bind is not None:
                bind(tokenizer)

    def score(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        answers: Sequence[str | None] | None = None,
        inputs: RewardInputs | None = None,
    ) -> TermScores:
        if answers is None:
            answers = [None] * len(prompts)
        if not len(prompts) == len(responses) == len(answers):
            raise ValueError(
                f"score: {len(prompts)} prompts, {len(responses)} responses and "
                f"{len(answers)} answers; they must be equally many"
            )
        rows, errors = [], []
        for term in self.terms:
            values, error = term.scorer(prompts, responses, answers, inputs)
            rows.append(values)
            errors.append(error)
        return TermScores.of(self, rows, errors, len(prompts))


def term_metrics(scored: Sequence[TermScores]) -> dict[str, float]:
    """TermScores.metrics() over every scoring call of a step (a filtered step scores
    several rounds); nothing when none was made (episodes)."""
    if not scored:
        return {}
    first = scored[0]
    values = torch.cat([one.values for one in scored], dim=1)
    columns = zip(*(one.first_errors for one in scored), strict=True)
    errors = [next((e for e in column if e), None) for column in columns]
    return TermScores(first.names, first.weights, values, errors, first.sources).metrics()


def function_scorer(fn: RewardFn) -> TermScorer:
    """A reward function as a term: a sample it raises on, or gives anything but a finite
    number for, gets NaN. scorer.started[0]: the samples the call under way has begun (a
    hung call is named by its sample)."""
    started = [0]

    def scorer(
        prompts: Sequence[str],
        responses: Sequence[str],
        answers: Sequence[str | None],
        inputs: RewardInputs | None = None,
    ) -> tuple[list[float], str | None]:
        del inputs  # a function reads the texts
        values: list[float] = []
        first: str | None = None
        started[0] = 0
        for index, (prompt, response, answer) in enumerate(
            zip(prompts, responses, answers, strict=True)
        ):
            started[0] = index + 1
            try:
                value = fn(prompt, response, answer)
            except Exception as exc:
                first = first or f"sample {index}: {type(exc).__name__}: {exc}"
                values.append(math.nan)
                continue
            number = _as_number(value)
            if number is None:
                first = first or f"sample {index}: returned {value!r}, not a finite float"
                values.append(math.nan)
            else:
                values.append(number)
        return values, first

    scorer.started = started  # type: ignore[attr-defined]
    return scorer


def _as_number(value: object) -> float | None:
    if isinstance(value, str | bytes) or value is None:
        return None
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def server_scorer(server: Any) -> TermScorer:
    def scorer(
        prompts: Sequence[str],
        responses: Sequence[str],
        answers: Sequence[str | None],
        inputs: RewardInputs | None = None,
    ) -> tuple[list[float], str | None]:
        del inputs  # the documented request carries the texts
        outcome = server.score(prompts, responses, answers)
        return outcome.values, outcome.first_error

    return scorer


class ModelScorer:
    """A reward model as a term (rlx.trainer.model.reward_model): the policy's token ids as
    they are where it shares the policy's tokenizer, else each prompt's messages and the
    response as a conversation in its own chat template. A forward that fails fails every
    sample of the call (NaN, never 0)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.shares_tokens = False

    def use_policy_tokenizer(self, tokenizer: Any) -> None:
        self.shares_tokens = self.model.shares_tokenizer(tokenizer)

    def sequences(
        self, prompts: Sequence[str], responses: Sequence[str], inputs: RewardInputs | None
    ) -> list[list[int]]:
        """Each sample's token ids as the reward model reads it."""
        if self.shares_tokens and inputs is not None and inputs.prompt_ids is not None:
            assert inputs.response_ids is not None
            return [
                [*prompt, *response]
                for prompt, response in zip(inputs.prompt_ids, inputs.response_ids, strict=True)
            ]
        if inputs is None or inputs.messages is None:
            # No chat to re-render: the texts as the policy read and wrote them.
            tokenizer = self.model.tokenizer
            return [
                list(tokenizer(prompt + response, add_special_tokens=False)["input_ids"])
                for prompt, response in zip(prompts, responses, strict=True)
            ]
        return [
            self.model.render([*messages, {"role": "assistant", "content": response}])
            for messages, response in zip(inputs.messages, responses, strict=True)
        ]

    def __call__(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        answers: Sequence[str | None],
        inputs: RewardInputs | None = None,
    ) -> tuple[list[float], str | None]:
        del answers  # a reward model scores the conversation alone
        try:
            return self.model.score_token_ids(self.sequences(prompts, responses, inputs)), None
        except Exception as exc:  # a failed term is NaN for its samples, never a zero
            return [math.nan] * len(prompts), f"{type(exc).__name__}: {exc}"


def build_terms(
    settings: Any,
    env: Mapping[str, str] | None = None,
    functions: Mapping[str, RewardFn] | None = None,
) -> RewardTerms:
    """The terms of trainer.rewards (or trainer.reward), functions imported, reward models
    loaded and servers' secrets read now. functions: specs already resolved (the start-up's
    signature check)."""
    from rlx.recipe.load import dotted
    from rlx.storage import is_store_url
    from rlx.trainer.tasks.reward_server import RewardServer

    terms = []
    for index, term in enumerate(settings.reward_terms()):
        scorer: TermScorer
        if term.function is not None:
            fn = (functions or {}).get(term.function) or resolve_reward(term.function)
            scorer = function_scorer(fn)
            source = f"function {reward_name(fn)}"
        elif term.model is not None:
            from rlx.trainer.model.reward_model import RewardModelScorer

            where = dotted((*settings.reward_term_fields()[index], "model"))
            spec = term.model
            if is_store_url(spec):  # a copy on this node, as the policy's
                from rlx.trainer.resolve import fetch_model

                spec = str(fetch_model(spec, where=where))
            model = RewardModelScorer(
                spec,
                token_budget=term.token_budget,
                field=where,
                trust_remote_code=settings.model.trust_remote_code,
            )
            scorer = ModelScorer(model)
            source = f"model {term.model}"
        else:
            server = RewardServer.of_term(term, None if env is None else dict(env))
            scorer = server_scorer(server)
            source = f"url {term.url}"
        terms.append(Term(term.label, term.weight, scorer, source))
    return RewardTerms(terms, settings.reward_aggregate)


def combine(
    values: torch.Tensor, weights: Sequence[float], aggregate: str, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(outcome, trained, valid), each (B,), from the terms' values (K, B).

    valid: every weighted term finite. outcome: sum of weight x value over the weighted
    terms, NaN where not valid. trained: what the advantages read; with sum_then_normalize
    the outcome, with normalize_then_sum the sum of weight x the term normalised over its
    group (group_size consecutive samples; the whole batch when group_size is 1) to mean 0
    and unbiased std 1 among the group's valid samples; 0 where not valid."""
    if aggregate not in ("sum_then_normalize", "normalize_then_sum"):
        raise ValueError(f"unknown reward aggregate {aggregate!r}")
    values = values.double()
    size = values.shape[1]
    weighted = [i for i, w in enumerate(weights) if w != 0]
    if not weighted:
        raise RlxError("rewards: every term has weight 0, so nothing trains")
    valid = torch.isfinite(values[weighted]).all(dim=0)  # (B,)
    outcome = torch.zeros(size, dtype=torch.float64)
    for i in weighted:
        outcome = outcome + weights[i] * torch.where(valid, values[i], 0.0)
    outcome = torch.where(valid, outcome, math.nan)
    if aggregate == "sum_then_normalize":
        return outcome, torch.where(valid, outcome, 0.0), valid
    group = group_size if group_size > 1 else max(size, 1)
    if size % group:
        raise ValueError(f"{size} samples are not groups of {group}")
    trained = torch.zeros(size, dtype=torch.float64)
    for i in weighted:
        trained = trained + weights[i] * normalize_in_groups(values[i], valid, group)
    return outcome, torch.where(valid, trained, 0.0), valid


def normalize_in_groups(
    values: torch.Tensor, valid: torch.Tensor, group: int, eps: float = 1e-6
) -> torch.Tensor:
    """(B,) each value minus its group's mean, over its group's std (unbiased; 0 with one
    member), both over the valid members only; 0 where not valid."""
    grouped = torch.where(valid, values, 0.0).reshape(-1, group)  # (P, G)
    ok = valid.reshape(-1, group)  # (P, G)
    count = ok.sum(dim=1, keepdim=True)  # (P, 1)
    mean = grouped.sum(dim=1, keepdim=True) / count.clamp(min=1)
    deviation = torch.where(ok, grouped - mean, 0.0)
    var = (deviation**2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)
    return torch.where(ok, deviation / (var.sqrt() + eps), 0.0).reshape(-1)
