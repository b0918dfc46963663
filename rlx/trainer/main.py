"""`rlx train`: resolve the recipe, join (or start) Ray, start the actors, train, report.

With RAY_ADDRESS set (the bootstrap sets the head's explicit address) the trainer joins that
cluster; without it, it starts a private Ray on this machine (never "auto": a stray cluster
on the machine, such as a backend's own Ray, must not be picked up). The console is copied
to <run folder>/train.log; the run folder also gets metrics.jsonl, reward.png and
result.json, the record `rlx status` reads.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from rlx.errors import RlxError
from rlx.recipe.model import Recipe
from rlx.trainer.resolve import RunPaths, run_paths, trainer_settings

# Steps averaged for the start and end reward of the summary (one step alone is noisy).
SUMMARY_WINDOW = 10
# The fixed probe response every engine and the policy score after each weight push.
PROBE_TEXT = "0123456789 abcdefghij"


@dataclass
class RunResult:
    """What a finished (or failed) run leaves behind; also written as result.json."""

    state: str  # RUNNING | SUCCEEDED | FAILED | CANCELLED
    run_id: str
    run_dir: str
    steps: int
    last_step: int | None = None
    exit_code: int | None = None
    pid: int | None = None
    started: float | None = None
    finished: float | None = None
    wall_time_s: float | None = None
    first_reward: float | None = None  # reward/mean of the first step logged
    last_reward: float | None = None  # ... and of the last
    first_reward_window: float | None = None  # mean over the first SUMMARY_WINDOW steps
    last_reward_window: float | None = None  # ... and over the last ones: less noisy
    reward_window: int | None = None  # how many steps each of those means covers
    metrics: str | None = None
    plot: str | None = None
    log: str | None = None
    checkpoints: str | None = None
    error: str | None = None


def write_result(paths: RunPaths, result: RunResult) -> None:
    paths.run_dir.mkdir(parents=True, exist_ok=True)
    temporary = paths.result.with_name(f".{paths.result.name}.tmp")
    temporary.write_text(json.dumps(asdict(result), indent=1))
    temporary.replace(paths.result)


def read_result(run_dir: Path) -> RunResult | None:
    from rlx.trainer.resolve import RESULT_FILE

    try:
        return RunResult(**json.loads((run_dir / RESULT_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return None


class Stopped(Exception):
    """SIGTERM or SIGINT arrived: stop, release the actors, exit 128 + signal."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.code = 128 + signum


# --------------------------------------------------------------------------- console


class _Tee(io.TextIOBase):
    """Writes to the console stream and to the run's log file."""

    def __init__(self, stream: TextIO, log: TextIO):
        self._stream = stream
        self._log = log

    def write(self, text: str) -> int:
        self._stream.write(text)
        # Libraries imported during the run (Ray's colorama) keep this object as their
        # stdout and write to it at exit, after the log is closed: the console only, then.
        if not self._log.closed:
            self._log.write(text)
        return len(text)

    def flush(self) -> None:
        self._stream.flush()
        if not self._log.closed:
            self._log.flush()

    def isatty(self) -> bool:
        return self._stream.isatty()


class _AboveBars(io.TextIOBase):
    """Lines printed while a progress bar is on the terminal go above it, not through it."""

    def __init__(self, stream: TextIO, bar_stream: TextIO):
        self._stream = stream
        self._bar_stream = bar_stream

    def write(self, text: str) -> int:
        from tqdm import tqdm

        with tqdm.external_write_mode(file=self._bar_stream):
            self._stream.write(text)
            self._stream.flush()
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return self._stream.isatty()


@contextlib.contextmanager
def console_to_log(log_path: Path) -> Iterator[tuple[TextIO, TextIO]]:
    """(out, err) for the run: both copied to log_path. Progress bars (err on a terminal)
    stay on the terminal only."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    real_out, real_err = sys.stdout, sys.stderr
    with open(log_path, "a", encoding="utf-8", buffering=1) as log:
        out: TextIO = _Tee(real_out, log)  # type: ignore[assignment]
        tee_err: TextIO = _Tee(real_err, log)  # type: ignore[assignment]
        sys.stdout, sys.stderr = out, tee_err
        try:
            if real_err.isatty():
                yield _AboveBars(out, real_err), real_err  # type: ignore[misc]
            else:
                yield out, tee_err
        finally:
            sys.stdout, sys.stderr = real_out, real_err


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    def handler(signum: int, _frame: object) -> None:
        raise Stopped(signum)

    if _in_main_thread():
        previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)
    else:
        yield


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


# --------------------------------------------------------------------------- Ray


def connect_ray(recipe: Recipe, env: Mapping[str, str]) -> tuple[bool, str]:
    """Join RAY_ADDRESS, or start a private Ray here. (we started it?, where, for messages)."""
    import ray

    if ray.is_initialized():  # a caller (a test, a notebook) brought its own
        return False, "this process is connected to"
    address = env.get("RAY_ADDRESS", "").strip()
    if address:
        if address in ("auto", "local"):
            raise RlxError(
                f"RAY_ADDRESS={address!r}: give the head's explicit address (host:port), as "
                "`rlx node` does; 'auto' could join another Ray on the machine, such as a "
                "backend's own"
            )
        try:
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RlxError(f"cannot join the Ray cluster at {address}: {first}") from None
        return False, f"at {address}"
    from rlx.trainer.placement import plan_actors

    cpus = max(os.cpu_count() or 1, plan_actors(recipe).bundles + 1)
    ray.init(
        address="local",
        num_cpus=cpus,
        include_dashboard=False,
        logging_level=logging.ERROR,
        log_to_driver=True,
    )
    return True, "on this machine"


# --------------------------------------------------------------------------- the session


def resolve_inputs(recipe: Recipe, env: Mapping[str, str], paths: RunPaths) -> Any:
    """Model folders, tokenizer, prompts, reward and probe: everything checked on the head
    before any actor starts. Returns (RunInputs, policy path, critic path)."""
    from rlx.trainer.data import load_prompt_dataset
    from rlx.trainer.engines import Probe
    from rlx.trainer.loop import RunInputs
    from rlx.trainer.models import quiet_transformers
    from rlx.trainer.resolve import (
        load_tokenizer,
        model_cache_dir,
        resolve_data_path,
        resolve_model_path,
        resolve_reward_fn,
    )

    settings = trainer_settings(recipe)
    quiet_transformers()
    reward_fn = resolve_reward_fn(settings)
    cache = model_cache_dir(paths)
    policy_path = resolve_model_path(settings.model.path, cache, settings.seed)
    critic_path = None
    if settings.algorithm == "ppo":
        critic = settings.critic_model or settings.model
        critic_path = resolve_model_path(critic.path, cache, settings.seed, "critic_model")
    tokenizer = load_tokenizer(policy_path, settings.model.trust_remote_code)
    data_file = resolve_data_path(settings.data.train, paths.run_dir, settings.seed)
    overlong = {"left": "truncate"}.get(settings.data.truncate, settings.data.truncate)
    data = load_prompt_dataset(
        data_file,
        tokenizer,
        prompt_key=settings.data.prompt_key,
        answer_key=settings.data.answer_key,
        max_prompt_length=settings.data.max_prompt_length,
        overlong=overlong,
        chat_template_for_strings=settings.data.chat_template,
        data_format=None if settings.data.format == "auto" else settings.data.format,
    )
    if len(data) < settings.batch.prompts_per_step:
        raise RlxError(
            f"trainer.data.train: {data.source} has {len(data)} usable prompts, fewer than "
            f"batch.prompts_per_step {settings.batch.prompts_per_step}"
        )
    response = list(tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"])
    probe = Probe(list(data.prompt_token_ids[0]), response)
    inputs = RunInputs(recipe, paths, tokenizer, data, reward_fn, probe, dict(env))
    return inputs, policy_path, critic_path


def engine_choice(recipe: Recipe) -> tuple[str, str]:
    """(engine kind, engine dtype name) for this recipe's machines."""
    import importlib.util

    from rlx.trainer.models import compute_dtype

    settings = trainer_settings(recipe)
    gpu = recipe.resources.gpus_per_node > 0
    kind = settings.rollout.engine
    if kind == "auto":
        kind = "vllm" if gpu and importlib.util.find_spec("vllm") is not None else "hf"
    if kind == "vllm":
        if not gpu:
            raise RlxError(
                "trainer.rollout.engine: vllm needs GPUs but resources.accelerators is unset; "
                "use engine: hf (or auto) on CPU"
            )
        if importlib.util.find_spec("vllm") is None:
            raise RlxError('trainer.rollout.engine: vllm is not installed; pip install "rlx[vllm]"')
        if settings.layout == "colocated" and settings.rollout.tensor_parallel_size > 1:
            raise RlxError(
                "trainer.rollout.tensor_parallel_size > 1 needs layout: split (colocated "
                "engines run one per training GPU)"
            )
    import torch

    device = torch.device("cuda" if gpu else "cpu")
    dtype = str(compute_dtype(settings.model.dtype, device)).removeprefix("torch.")
    return kind, dtype


@contextlib.contextmanager
def training_session(
    recipe: Recipe, env: Mapping[str, str], paths: RunPaths, out: TextIO, err: TextIO
) -> Iterator[Any]:
    """A Trainer whose actors are up (and torn down again on exit)."""
    import ray

    from rlx.trainer.cluster import Cluster
    from rlx.trainer.loop import Trainer
    from rlx.trainer.metrics import host_memory_bytes
    from rlx.trainer.placement import alive_nodes, check_batch_split, check_resources, plan_actors

    inputs, policy_path, critic_path = resolve_inputs(recipe, env, paths)
    kind, engine_dtype = engine_choice(recipe)
    check_batch_split(recipe, plan_actors(recipe))
    with contextlib.ExitStack() as stack:
        started_ray, where = connect_ray(recipe, env)
        if started_ray:
            stack.callback(ray.shutdown)
        # ray.init put in a SIGTERM handler that exits at once; ours releases the actors.
        stack.enter_context(stop_on_signals())
        nodes = alive_nodes()
        check_resources(recipe, nodes, where)
        cluster = Cluster.start(recipe, nodes, policy_path, critic_path, kind, engine_dtype)
        stack.callback(cluster.shutdown)
        # A private Ray's processes are this process's children; a joined cluster's workers
        # belong to the raylets `ray start` began, so they are asked for their own figure.
        memory = host_memory_bytes if started_ray else _cluster_memory(cluster, host_memory_bytes)
        yield Trainer(inputs, cluster, out=out, err=err, memory_of=memory)


def _cluster_memory(cluster: Any, own: Any) -> Any:
    """This process tree plus the workers, which belong to the raylets `ray start` began."""

    def total() -> int:
        here = own()
        return here + sum(rss for _, _, rss in cluster.worker_memory())

    return total


# --------------------------------------------------------------------------- entry points


def run_training(
    recipe: Recipe, env: Mapping[str, str] | None = None, *, print_summary: bool = True
) -> RunResult:
    """Train the recipe to its last step (resuming when a checkpoint says so) and return
    the record of the run. Raises RlxError (or Stopped) on failure, after writing
    result.json with the state."""
    env = dict(os.environ if env is None else env)
    settings = trainer_settings(recipe)
    paths = run_paths(recipe, env)
    paths.run_dir.mkdir(parents=True, exist_ok=True)
    result = RunResult(
        state="RUNNING",
        run_id=paths.run_id,
        run_dir=str(paths.run_dir),
        steps=settings.steps,
        pid=os.getpid(),
        started=time.time(),
        metrics=str(paths.metrics),
        plot=str(paths.plot),
        log=str(paths.log),
        checkpoints=None if paths.checkpoints is None else str(paths.checkpoints),
    )
    write_result(paths, result)
    with console_to_log(paths.log) as (out, err), stop_on_signals():
        print(f"rlx train: run {paths.run_id}, outputs in {paths.run_dir}", file=out, flush=True)
        try:
            with training_session(recipe, env, paths, out, err) as trainer:
                result.last_step = trainer.run()
            finish(result, paths)
            result.state, result.exit_code = "SUCCEEDED", 0
        except Stopped as stop:
            result.state, result.exit_code, result.error = "CANCELLED", stop.code, str(stop)
            print(f"stopped by {stop}", file=out, flush=True)
            raise
        except BaseException as exc:
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            result.state, result.exit_code, result.error = "FAILED", 1, message
            with paths.log.open("a", encoding="utf-8") as log:  # the CLI prints it on screen
                print(f"error: {message}", file=log)
            raise
        finally:
            result.finished = time.time()
            write_result(paths, result)
        if print_summary:
            for line in summary_lines(result):
                print(line, file=out, flush=True)
    return result


def finish(result: RunResult, paths: RunPaths) -> None:
    """The plot and the summary figures, from the metrics file."""
    from rlx.trainer.metrics import REWARD_MEAN, read_metrics
    from rlx.trainer.plots import summary, write_plot

    if paths.metrics.is_file():
        write_plot(paths.metrics, paths.plot)
    figures = summary(paths.metrics)
    result.first_reward = figures["first_reward_mean"]
    result.last_reward = figures["last_reward_mean"]
    result.wall_time_s = figures["wall_time_s"]
    rewards = [
        r[REWARD_MEAN] for r in read_metrics(paths.metrics) if r.get(REWARD_MEAN) is not None
    ]
    if rewards:
        # Windows that never overlap: a short run compares its two halves.
        window = max(1, min(SUMMARY_WINDOW, len(rewards) // 2))
        result.reward_window = window
        result.first_reward_window = sum(rewards[:window]) / window
        result.last_reward_window = sum(rewards[-window:]) / window


def reward_summary(result: RunResult) -> str:
    """'0.080 -> 0.470 (mean of the first and last 10 steps)', or 'n/a'."""
    if result.first_reward_window is None or result.last_reward_window is None:
        return "n/a"
    window = result.reward_window or 1
    what = "first and last step" if window == 1 else f"mean of the first and last {window} steps"
    return f"{result.first_reward_window:.3f} -> {result.last_reward_window:.3f} ({what})"


def summary_lines(result: RunResult) -> list[str]:
    wall = "n/a" if result.wall_time_s is None else f"{result.wall_time_s:.1f} s"
    lines = [
        f"done: {result.last_step} of {result.steps} steps in {wall}",
        f"reward: {reward_summary(result)}",
        f"metrics: {result.metrics}",
        f"reward plot: {result.plot}",
        f"log: {result.log}",
    ]
    if result.checkpoints:
        lines.append(f"checkpoints: {result.checkpoints}")
    return lines


def main(recipe: Recipe, env: Mapping[str, str] | None = None) -> int:
    """`rlx train`: the exit code (0 on success; failures raise RlxError for the CLI)."""
    try:
        run_training(recipe, env)
    except Stopped as stop:
        return stop.code
    return 0
