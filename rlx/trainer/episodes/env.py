"""The environment interface: what a user writes for multi-turn episodes, and how rlx
finds it, calls it and survives it.

An environment is a class named in the recipe (`trainer.environment.function`), made once
per episode with no arguments:

    class Calculator:
        def reset(self, row: Row) -> None: ...           # or async def
        def step(self, turn: Turn) -> Step: ...           # or async def
        def close(self) -> None: ...                      # optional

`reset` gets the prompt row (its text, reference answer and every column of the file);
`step` gets the model's turn (its text and the exact ids sampled) and returns a Step: the
observation to append (a chat message {"role": ..., "content": ...} wrapped by the chat
template, plain text, or token ids; None for nothing), a reward (summed over the turns),
whether the episode is done, and, for the metrics, how many tool calls the turn made, the
error of a malformed or failing one and any numbers of its own (`metrics`, logged per step as
`env/<name>`, the mean over the turns that gave one). A dict with Step's field names works too.

Each call has `trainer.environment.step_timeout_s`; an environment that raises, hangs or
returns something unusable fails its episode (one line, the run goes on); failed episodes
train nothing. Synchronous methods run in threads of their own, so one that hangs is left
behind, not waited for; an asyncio one must not block its event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlx.errors import RlxError
from rlx.trainer.tasks.userspec import import_target, missing_name, spec_problem


class EnvironmentSpecError(RlxError, ValueError):
    """An environment spec that names nothing usable."""


class EpisodeFailure(Exception):
    """One episode's environment failed (raised, hung, returned something unusable)."""


@dataclass(frozen=True)
class Row:
    """The prompt row an episode starts from."""

    prompt: str  # the text the policy saw (after any chat template)
    answer: str | None  # the reference answer (trainer.data.answer_key), None without one
    columns: Mapping[str, Any] = field(default_factory=dict)  # every field of the file's row
    index: int = 0  # the row's position in the prompt file


@dataclass(frozen=True)
class Turn:
    """One model turn, as sampled."""

    index: int  # 0 for the first turn
    text: str  # the sampled ids decoded, special tokens removed
    ids: tuple[int, ...]  # exactly the ids the engine sampled (the end-of-turn token included)
    finished: bool  # ended with the end-of-turn token (False: cut at its token limit)


Observation = str | Mapping[str, Any] | Sequence[int] | None


@dataclass(frozen=True)
class Step:
    """What the environment answers a turn with."""

    observation: Observation = None
    reward: float = 0.0
    done: bool = False
    tool_calls: int = 0
    tool_error: str | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)  # logged as env/<name>


# ------------------------------------------------------------------------------- specs


def builtin_environments() -> dict[str, str]:
    """Built-in environments by name -> 'module:Class' (imported only when chosen)."""
    return {
        "tool_lookup": "rlx.trainer.tasks.tools:LookupTool",
        "calculator": "rlx.trainer.tasks.tools:Calculator",
    }


def environment_spec_problem(spec: str) -> str | None:
    """What is wrong with a spec's form, before anything is imported (None if it names a
    built-in or looks like a class). Lint asks this too."""
    return spec_problem(spec, "environment", builtin_environments(), "a class", "Class")


def resolve_environment(spec: str) -> Callable[[], Any]:
    """The environment class `spec` names, checked to have reset and step; user modules are
    imported only now. Raises EnvironmentSpecError naming the spec and what would do."""
    problem = environment_spec_problem(spec)
    if problem is not None:
        raise EnvironmentSpecError(problem)
    module, name = import_target(
        builtin_environments().get(spec, spec), "environment", EnvironmentSpecError
    )
    factory = getattr(module, name, None)
    if factory is None:
        raise EnvironmentSpecError(
            missing_name(module, spec, "environment", "classes", inspect.isclass)
        )
    missing = [m for m in ("reset", "step") if not callable(getattr(factory, m, None))]
    if not callable(factory) or missing:
        raise EnvironmentSpecError(
            f"environment {spec!r}: {name!r} must be a class with reset(row) and step(turn) "
            f"methods; it lacks {', '.join(missing) or 'a constructor'}"
        )
    return factory


# ------------------------------------------------------------------------------- calls


def as_step(value: Any) -> Step:
    """A Step from what step() returned (a Step or a dict of its fields), or EpisodeFailure
    saying what is wrong with it."""
    if isinstance(value, Mapping):
        unknown = set(value) - set(Step.__dataclass_fields__)
        if unknown:
            raise EpisodeFailure(
                f"step() returned a dict with unknown keys {sorted(unknown)}; valid: "
                f"{', '.join(Step.__dataclass_fields__)}"
            )
        value = Step(**value)
    if not isinstance(value, Step):
        raise EpisodeFailure(f"step() returned {type(value).__name__}, not a Step (or dict)")
    try:
        reward = float(value.reward)
    except (TypeError, ValueError):
        reward = math.nan
    if not math.isfinite(reward):
        raise EpisodeFailure(f"step() returned reward {value.reward!r}; it must be a finite float")
    observation = value.observation
    if observation is not None and not isinstance(observation, str):
        if isinstance(observation, Mapping):
            if not isinstance(observation.get("role"), str) or "content" not in observation:
                raise EpisodeFailure(
                    "step() returned an observation dict without 'role' and 'content'"
                )
        elif not all(isinstance(t, int) and t >= 0 for t in observation):
            raise EpisodeFailure("step() returned observation ids that are not token ids")
    try:
        metrics = {str(k): float(v) for k, v in dict(value.metrics).items()}
    except (TypeError, ValueError):
        raise EpisodeFailure("step() returned metrics that are not names -> numbers") from None
    return Step(
        observation=observation,
        reward=reward,
        done=bool(value.done),
        tool_calls=int(value.tool_calls),
        tool_error=None if value.tool_error is None else str(value.tool_error),
        metrics=metrics,
    )


def _in_daemon_thread(fn: Callable[..., Any], *args: Any) -> asyncio.Future:
    """Run fn in a thread of its own and return a future of its result on this loop: a
    call that never returns is abandoned with its thread (a daemon, so the process can still
    exit), not waited for."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # timed out and abandoned
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def target() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the awaiting episode
            outcome: tuple[Any, BaseException | None] = (None, exc)
        else:
            outcome = (result, None)
        # The loop may be closed if this call hung past the run: nobody waits for it then.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=target, name="rlx-environment", daemon=True).start()
    return future


async def call_environment(
    method: Callable[..., Any], arg: Any, timeout_s: float, what: str
) -> Any:
    """method(arg), synchronous or a coroutine function, within timeout_s; EpisodeFailure
    with one line if it raises or takes longer."""
    try:
        if inspect.iscoroutinefunction(method):
            result: Any = method(arg)
        else:
            result = _in_daemon_thread(method, arg)
        result = await asyncio.wait_for(result, timeout_s)
        if inspect.isawaitable(result):  # a sync method that returned a coroutine
            result = await asyncio.wait_for(result, timeout_s)
        return result
    except TimeoutError:
        raise EpisodeFailure(f"{what} took longer than {timeout_s:g} s (step_timeout_s)") from None
    except EpisodeFailure:
        raise
    except Exception as exc:
        raise EpisodeFailure(f"{what} raised {type(exc).__name__}: {exc}") from exc


def run_all(loop: asyncio.AbstractEventLoop, calls: Sequence[Awaitable[Any]]) -> list[Any]:
    """Every call to its end on `loop`, concurrently; each result or its exception."""

    async def gather() -> list[Any]:
        return await asyncio.gather(*calls, return_exceptions=True)

    return loop.run_until_complete(gather())
