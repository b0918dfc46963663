"""Multi-turn episodes on the rollout engines, driven from the controller.

A step's episodes: every prompt row gets n episodes, each with an environment of its own.
Turn 0 is one generate call of n samples per prompt (the single-turn rollout's call, same
seed stream); each later turn is one call with one sample per episode still running, its
prompt the episode's ids so far (the engine's prefix cache keeps the shared part). Between
turns every running environment steps at once (asyncio; synchronous ones in threads), each
within step_timeout_s. The engines only ever see ids: what they sample is appended as is,
and so are the environment's ids (trajectory.py).

An episode ends when its environment says done, after max_turns turns, or when the next
observation or turn would pass the episode's token budget (truncated). One whose environment
raises, hangs or answers with something unusable fails: one line, and it trains nothing; a
step with more failures than max_failed_fraction allows stops the run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from rlx.errors import RlxError
from rlx.recipe.model import TrainerSettings, episode_token_budget
from rlx.runs import EPISODE_LENGTH, EPISODE_TOOL_CALLS, EPISODE_TOOL_ERRORS, EPISODE_TURNS
from rlx.trainer.batch import RolloutBatch
from rlx.trainer.episodes.env import (
    EpisodeFailure,
    Row,
    Turn,
    as_step,
    call_environment,
    run_all,
)
from rlx.trainer.episodes.trajectory import Episode, TurnTemplate, as_tensors
from rlx.trainer.rollout.base import SamplingArgs
from rlx.trainer.tasks.data import PromptDataset

# generate(prompt ids, sampling, stream) -> a handle with collect() -> RolloutBatch
Submit = Callable[[list[list[int]], SamplingArgs, str], Any]
TURN_STREAM = "generate"  # turn 0 samples like a single-turn rollout; turn t: "generate/t"
SHOWN_FAILURES = 3  # failure lines per step; the rest are counted


class EnvironmentFailures(RlxError):
    """More of a step's episodes failed than trainer.environment.max_failed_fraction allows."""


class EpisodeRunner:
    """Runs a step's episodes: turns on the engines, steps in the environments."""

    def __init__(
        self,
        settings: TrainerSettings,
        environment: Callable[[], Any],
        tokenizer: Any,
        data: PromptDataset,
        say: Callable[[str], None],
    ):
        assert settings.environment is not None
        self.settings = settings
        self.config = settings.environment
        self.make_env = environment
        self.tokenizer = tokenizer
        self.data = data
        self.say = say
        self.template = TurnTemplate(tokenizer)
        self.budget = episode_token_budget(settings)
        self.loop = asyncio.new_event_loop()

    def close(self) -> None:
        self.loop.close()

    # ------------------------------------------------------------------ one step

    def start(
        self,
        rows: Sequence[int],
        step: int,
        submit: Submit,
        sampling: SamplingArgs,
        data: PromptDataset | None = None,
        ahead: bool = False,
    ) -> PendingEpisodes:
        """Episodes for `rows` of `data` (the training prompts by default), sampling.n each,
        every turn sampled with `sampling`, with their first turn submitted (returns at
        once). ahead: a step queued ahead of the one training (max_staleness > 0): its turns
        are played from now on in a thread of their own, so the engines go on with them
        while the learners update; otherwise they are played when the episodes are
        collected."""
        data = data or self.data
        prompts = [data.prompt_token_ids[r] for r in rows]
        longest = min(sampling.max_new_tokens, self.budget)
        first = submit(prompts, dataclasses.replace(sampling, max_new_tokens=longest), TURN_STREAM)
        pending = PendingEpisodes(self, data, list(rows), step, sampling, submit, first)
        if ahead:
            pending.play_ahead()
        return pending

    def play(
        self,
        loop: asyncio.AbstractEventLoop,
        data: PromptDataset,
        rows: list[int],
        sampling: SamplingArgs,
        submit: Submit,
        first: Any,
        show_progress: bool = False,
    ) -> list[Episode]:
        """Every turn of the episodes, to their end (environments called on `loop`)."""
        max_new_tokens = sampling.max_new_tokens
        episodes = [
            Episode(row=r, prompt_ids=list(data.prompt_token_ids[r]))
            for r in rows
            for _ in range(sampling.n)
        ]
        self._reset(loop, episodes, data)
        batch = first.collect(show_progress)
        self._take_turn(loop, episodes, list(range(len(episodes))), batch, max_new_tokens)
        turn = 1
        while True:
            running = [i for i, e in enumerate(episodes) if not e.done and e.failure is None]
            if not running:
                break
            turn_limit = [min(max_new_tokens, self.budget - len(episodes[i].ids)) for i in running]
            prompts = [episodes[i].prompt_ids + episodes[i].ids for i in running]
            each = dataclasses.replace(sampling, n=1, max_new_tokens=max(turn_limit))
            handle = submit(prompts, each, f"{TURN_STREAM}/{turn}")
            self._take_turn(loop, episodes, running, handle.collect(False), max_new_tokens)
            turn += 1
        return episodes

    def finish(self, episodes: list[Episode], step: int, data: PromptDataset, n: int):
        """The step's failure and tool-error lines (stopping the run past the limit), then
        the episodes as one batch."""
        self._report(episodes, step, data)
        return self._as_batch(episodes, n)

    def _reset(
        self, loop: asyncio.AbstractEventLoop, episodes: list[Episode], data: PromptDataset
    ) -> None:
        timeout = self.config.step_timeout_s

        async def reset(episode: Episode) -> None:
            make = self.make_env
            episode.env = await call_environment(lambda _: make(), None, timeout, "the constructor")
            row = Row(
                prompt=data.prompts[episode.row],
                answer=data.answers[episode.row],
                columns=data.columns[episode.row] if data.columns else {},
                index=data.row_indices[episode.row],
            )
            await call_environment(episode.env.reset, row, timeout, "reset()")

        outcomes = run_all(loop, [reset(e) for e in episodes])
        for episode, outcome in zip(episodes, outcomes, strict=True):
            self._fail_on(episode, outcome, turn=None)

    def _take_turn(
        self,
        loop: asyncio.AbstractEventLoop,
        episodes: list[Episode],
        which: list[int],
        batch: RolloutBatch,
        max_new: int,
    ) -> None:
        """Append each running episode's sampled turn, step its environment on it, append
        the observation or end the episode."""
        responses = batch.response_lists()
        versions = batch.row_versions.tolist()
        finished = batch.finished.tolist()
        turns = []
        for slot, index in enumerate(which):
            episode = episodes[index]
            limit = min(max_new, self.budget - len(episode.ids))
            ids = responses[slot][:limit]
            logprobs = batch.logprobs[slot, : len(ids)].tolist()
            ended = finished[slot] and len(ids) == len(responses[slot])
            episode.add_turn(ids, logprobs, versions[slot], ended)
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            turns.append(Turn(len(episode.turns) - 1, text, tuple(ids), ended))
        stepping = [(episodes[i], turn) for i, turn in zip(which, turns, strict=True)]
        live = [(e, t) for e, t in stepping if e.failure is None]
        timeout = self.config.step_timeout_s
        outcomes = run_all(
            loop, [call_environment(e.env.step, t, timeout, "step()") for e, t in live]
        )
        for (episode, turn), outcome in zip(live, outcomes, strict=True):
            if self._fail_on(episode, outcome, turn.index):
                continue
            try:
                self._apply(episode, as_step(outcome))
            except EpisodeFailure as exc:
                self._fail_on(episode, exc, turn.index)

    def _apply(self, episode: Episode, step: Any) -> None:
        episode.rewards.append(step.reward)
        episode.tool_calls += step.tool_calls
        if step.tool_error is not None:
            episode.tool_errors.append(step.tool_error)
        episode.metrics.extend(step.metrics.items())
        if step.done:
            episode.done = True
            return
        if len(episode.turns) >= self.config.max_turns:
            episode.done = episode.truncated = True
            return
        observation = (
            [] if step.observation is None else self.template.observation_ids(step.observation)
        )
        # A chat message follows a closed turn: a cut one gets its end-of-turn token as
        # context first. Text and ids are appended exactly as given.
        message = isinstance(step.observation, Mapping)
        closing = [self.template.eos_id] if message and not episode.finished else []
        # The observation and at least one token of the next turn must fit the budget.
        if len(episode.ids) + len(closing) + len(observation) + 1 > self.budget:
            episode.done = episode.truncated = True
            return
        episode.add_context(closing + observation)

    def _fail_on(self, episode: Episode, outcome: Any, turn: int | None) -> bool:
        if not isinstance(outcome, BaseException):
            return False
        if not isinstance(outcome, EpisodeFailure):
            raise outcome  # a bug of rlx's own, not of the environment
        if episode.failure is None:
            where = "at reset" if turn is None else f"at turn {turn}"
            episode.failure = f"{where}: {outcome}"
        episode.done = True
        return True

    # ------------------------------------------------------------------ the batch

    def _report(self, episodes: list[Episode], step: int, data: PromptDataset) -> None:
        failed = [(i, e) for i, e in enumerate(episodes) if e.failure is not None]
        spec = self.config.function
        for index, episode in failed[:SHOWN_FAILURES]:
            self.say(
                f"step {step}: episode {index} (prompt row {data.row_indices[episode.row]}) "
                f"failed {episode.failure} in environment {spec}; it trains nothing"
            )
        if len(failed) > SHOWN_FAILURES:
            self.say(f"step {step}: {len(failed) - SHOWN_FAILURES} more episodes failed")
        allowed = self.config.max_failed_fraction * len(episodes)
        if len(failed) > allowed:
            raise EnvironmentFailures(
                f"step {step}: {len(failed)} of {len(episodes)} episodes failed in environment "
                f"{spec}, more than trainer.environment.max_failed_fraction "
                f"{self.config.max_failed_fraction:g} allows; the run stops (the last "
                "checkpoint is kept); fix the environment and resume"
            )
        errors = [(i, e) for i, e in enumerate(episodes) if e.tool_errors and e.failure is None]
        if errors:
            count = sum(len(e.tool_errors) for _, e in errors)
            index, first = errors[0]
            self.say(
                f"step {step}: {count} tool errors in {len(errors)} episodes, e.g. episode "
                f"{index}: {first.tool_errors[0]}"
            )

    def _as_batch(self, episodes: list[Episode], n: int) -> RolloutBatch:
        pad = self.tokenizer.pad_token_id
        pad = self.tokenizer.eos_token_id if pad is None else pad
        ids, real, loss, logprobs, rewards = as_tensors(episodes, pad)
        for episode in episodes:
            if episode.env is not None and callable(getattr(episode.env, "close", None)):
                try:
                    episode.env.close()
                except Exception as exc:  # a close that fails loses nothing
                    self.say(f"note: an environment's close() raised {type(exc).__name__}: {exc}")
            episode.env = None
        versions = [e.version if e.version is not None else 0 for e in episodes]
        return RolloutBatch(
            prompt_ids=[e.prompt_ids for e in episodes],
            response_ids=ids,
            response_mask=real,
            logprobs=logprobs,
            finished=torch.tensor([e.done and not e.truncated for e in episodes]),
            n=n,
            pad_token_id=pad,
            weight_version=min(versions, default=0),
            versions=torch.tensor(versions, dtype=torch.long),
            loss_mask=loss,
            token_rewards=rewards,
            episodes=episodes,
        )


@dataclasses.dataclass
class PendingEpisodes:
    """A step's episodes with their first turn under way (what the rollout queue holds)."""

    runner: EpisodeRunner
    data: PromptDataset
    rows: list[int]
    step: int
    sampling: SamplingArgs
    submit: Submit
    first: Any
    _thread: threading.Thread | None = None
    _played: list[Episode] | None = None
    _error: BaseException | None = None

    def play_ahead(self) -> None:
        """Play the episodes in a thread from now on, with an event loop of its own; collect
        waits for it. A daemon: a run that stops leaves it behind."""

        def play() -> None:
            loop = asyncio.new_event_loop()
            try:
                self._played = self._play(loop, False)
            except BaseException as exc:  # handed to collect, on the controller's thread
                self._error = exc
            finally:
                loop.close()

        self._thread = threading.Thread(target=play, name=f"episodes-{self.step}", daemon=True)
        self._thread.start()

    def _play(self, loop: asyncio.AbstractEventLoop, show_progress: bool) -> list[Episode]:
        return self.runner.play(
            loop,
            self.data,
            self.rows,
            self.sampling,
            self.submit,
            self.first,
            show_progress,
        )

    def collect(self, show_progress: bool = False) -> RolloutBatch:
        if self._thread is None:
            episodes = self._play(self.runner.loop, show_progress)
        else:
            self._thread.join()
            if self._error is not None:
                raise self._error
            assert self._played is not None
            episodes = self._played
        return self.runner.finish(episodes, self.step, self.data, self.sampling.n)


def episode_scores(batch: RolloutBatch) -> list[float]:
    """Each episode's reward (the sum of its turns'), in the batch's order; NaN for a
    failed episode (never 0: it scored nothing)."""
    assert batch.episodes is not None and batch.token_rewards is not None
    totals = batch.token_rewards.sum(dim=1).tolist()
    return [
        t if e.failure is None else math.nan for t, e in zip(totals, batch.episodes, strict=True)
    ]


def episode_metrics(batch: RolloutBatch) -> dict[str, float]:
    """Turns, tool calls and errors per episode, episode length (tokens after the prompt,
    the model's and the environment's), how many failed or were truncated, and the
    environment's own metrics (env/<name>: the mean over the turns that gave one)."""
    episodes = batch.episodes or []
    count = max(len(episodes), 1)
    own: dict[str, list[float]] = {}
    for episode in episodes:
        if episode.failure is None:
            for name, value in episode.metrics:
                own.setdefault(f"env/{name}", []).append(value)
    return {
        **{name: sum(values) / len(values) for name, values in own.items()},
        EPISODE_TURNS: sum(len(e.turns) for e in episodes) / count,
        EPISODE_TOOL_CALLS: sum(e.tool_calls for e in episodes) / count,
        EPISODE_TOOL_ERRORS: sum(len(e.tool_errors) for e in episodes) / count,
        EPISODE_LENGTH: sum(len(e.ids) for e in episodes) / count,
        "episode/length_max": float(max((len(e.ids) for e in episodes), default=0)),
        "episode/failed": float(sum(e.failure is not None for e in episodes)),
        "episode/truncated": sum(e.truncated for e in episodes) / count,
    }
