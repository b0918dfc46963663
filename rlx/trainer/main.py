"""`rlx train`: resolve the recipe, join (or start) Ray, start the actors, train, report.

With RAY_ADDRESS set (the bootstrap sets the head's explicit address) the trainer joins that
cluster; without it, it starts a private Ray on this machine (never "auto": a stray cluster
on the machine, such as a backend's own Ray, must not be picked up). The console is copied
to <run folder>/train.log; the run folder also gets metrics.jsonl, reward.png and
result.json, the record `rlx status` reads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, TypeVar

from rlx import sigterm
from rlx.errors import RlxError, first_line
from rlx.owner import owned_run
from rlx.recipe.model import Recipe
from rlx.runs import (
    RunPaths,
    RunResult,
    mirror_run,
    pull_run,
    run_cost,
    run_line,
    write_result,
)
from rlx.trainer.checkpoint.probe import probe_locations
from rlx.trainer.job import STAND_IN_GPUS_ENV, TrainJob
from rlx.trainer.report.console import Stopped, StopRequest, console_to_log, handle_signals
from rlx.trainer.report.record import finish, summary_lines
from rlx.trainer.resolve import run_paths
from rlx.trainer.startup import StartPlan

T = TypeVar("T")

if TYPE_CHECKING:
    from rlx.trainer.device import StartSizes

STAND_IN_LINE = (
    "GPUs are stand-ins (a dress rehearsal): the job is placed on them as on GPUs and computes "
    "on CPU"
)

# --------------------------------------------------------------------------- Ray


def read_ray_auth_mode_afresh() -> None:
    """Make this process's Ray read RAY_AUTH_MODE from the environment again.

    Ray reads the mode once per process and keeps it; a local `ray.init()` with the mode
    unset then sets RAY_AUTH_MODE=token in the environment. A process that meets a second
    cluster (a rehearsal after a local run, a notebook, a test session) would start that
    cluster's GCS with the environment's mode while its own client kept the old one, and a
    client without a token is refused by its own GCS. Called before every ray.init here."""
    with contextlib.suppress(ImportError, AttributeError):
        from ray._raylet import Config

        Config.initialize("")


def connect_ray(job: TrainJob, env: Mapping[str, str]) -> tuple[bool, str]:
    """Join RAY_ADDRESS, or start a private Ray here. (we started it?, where, for messages)."""
    import ray

    if ray.is_initialized():  # a caller (a test, a notebook) brought its own
        return False, "this process is connected to"
    read_ray_auth_mode_afresh()
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
            first = first_line(exc)
            raise RlxError(f"cannot join the Ray cluster at {address}: {first}") from None
        return False, f"at {address}"
    cpus = max(os.cpu_count() or 1, job.actors.bundles + 1)

    from rlx.node.raynode import NO_PRESTART_ENV

    for key, value in NO_PRESTART_ENV.items():
        os.environ.setdefault(key, value)  # read by the raylet ray.init starts here

    # Ray's daemons and workers outlive a SIGTERM to every process here (rlx.sigterm): this
    # process saves the step done and stops them itself (stop_private_ray).
    def start() -> None:
        try:
            ray.init(
                address="local",
                num_cpus=cpus,
                include_dashboard=False,
                logging_level=logging.ERROR,
                log_to_driver=True,
            )
        except BaseException:
            ray.shutdown()  # whatever the late try set up in this process
            raise

    with sigterm.held_by_children():
        started_on_a_busy_machine(start, "the private Ray on this machine")
    return True, "on this machine"


# Ray gives a node's raylet a fixed 30 s to register with the GCS; on a loaded machine a node
# can miss it, and starts in time on another try.
NODE_START_TRIES = 3
RAYLET_LATE = "timed out during startup"


def started_on_a_busy_machine(start: Callable[[], T], what: str) -> T:
    """start(), again after a raylet that missed Ray's 30 s (what the late try started killed
    first); RlxError naming `what` after NODE_START_TRIES such misses."""
    import psutil

    for _ in range(NODE_START_TRIES):
        before = {proc.pid for proc in psutil.Process().children(recursive=True)}
        try:
            return start()
        except Exception as exc:
            if RAYLET_LATE not in str(exc):
                raise
            for proc in psutil.Process().children(recursive=True):
                if proc.pid not in before:
                    with contextlib.suppress(psutil.Error):
                        proc.kill()
    raise RlxError(
        f"{what} did not start here: a raylet missed Ray's 30 s to register "
        f"{NODE_START_TRIES} times; this machine is too busy, try again when it is quieter"
    )


def stop_private_ray() -> None:
    """ray.shutdown() for the Ray connect_ray started. Its daemons hold SIGTERM blocked, so
    Ray's own way (SIGTERM, a second's wait, then SIGKILL, one daemon after another) would
    add seconds: they get SIGKILL at once, still after the driver has left, as Ray orders
    it (killed before, the driver's goodbye waits 15 s for them)."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    for infos in getattr(node, "all_processes", {}).values():
        for info in infos:
            info.process.terminate = info.process.kill
    ray.shutdown()


# --------------------------------------------------------------------------- the session


def resolve_inputs(job: TrainJob, env: Mapping[str, str], paths: RunPaths) -> Any:
    """Model folders, tokenizer, prompts, reward and probe: everything checked on the head
    before any actor starts. Returns (RunInputs, policy path, critic path)."""
    from rlx.trainer.learn.models import quiet_transformers
    from rlx.trainer.loop import RunInputs
    from rlx.trainer.resolve import (
        load_tokenizer,
        model_cache_dir,
        resolve_data_path,
        resolve_model_path,
    )
    from rlx.trainer.rollout.probe import PROBE_TEXT, Probe
    from rlx.trainer.tasks.data import load_recipe_prompts, mix_datasets
    from rlx.trainer.tasks.validation import load_validation_set

    settings = job.settings
    quiet_transformers()
    check_sources_at_start(settings)
    rewards = resolve_reward_terms(settings, env)
    environment = None
    if settings.environment is not None:
        from rlx.trainer.episodes.env import resolve_environment

        environment = resolve_environment(settings.environment.function)
    cache = model_cache_dir(paths)
    policy_path = resolve_model_path(settings.model.path, cache, settings.seed)
    critic_path = None
    if settings.algorithm == "ppo":
        critic = settings.critic_model or settings.model
        critic_path = resolve_model_path(critic.path, cache, settings.seed, "critic_model")
    tokenizer = load_tokenizer(policy_path, settings.model.trust_remote_code)
    if rewards is not None:
        rewards.use_policy_tokenizer(tokenizer)
    check_context_at_start(settings, policy_path)
    data_file = resolve_data_path(
        settings.data.train,
        paths.run_dir,
        settings.seed,
        config=settings.data.config,
        split=settings.data.split,
    )
    data = load_recipe_prompts(data_file, tokenizer, settings.data, Path.cwd())
    if settings.data.mix:
        parts = [(data, settings.data.weight)]
        for i, source in enumerate(settings.data.mix):
            found = resolve_data_path(
                source.train,
                paths.run_dir,
                settings.seed,
                field=f"data.mix[{i}].train",
                config=source.config,
                split=source.split,
            )
            parts.append(
                (load_recipe_prompts(found, tokenizer, settings.data, Path.cwd()), source.weight)
            )
        data = mix_datasets(parts, settings.seed)
    if len(data) < settings.batch.prompts_per_step:
        raise RlxError(
            f"trainer.data.train: {data.source} has {len(data)} usable prompts, fewer than "
            f"batch.prompts_per_step {settings.batch.prompts_per_step}"
        )
    # Within what the engines accept: a prompt of the data and at most a response's length.
    response = list(tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"])
    response = response[: settings.rollout.max_new_tokens]
    probe = Probe(list(data.prompt_token_ids[0]), response)
    held_out = load_validation_set(settings, tokenizer, data, paths.run_dir)
    inputs = RunInputs(
        job,
        paths,
        tokenizer,
        data,
        rewards,
        probe,
        dict(env),
        validation=None if held_out is None else held_out[0],
        validation_overlap=0 if held_out is None else held_out[1],
        environment=environment,
    )
    return inputs, policy_path, critic_path


def check_sources_at_start(settings: Any) -> None:
    """Lint's rule for the prompt files and the reward file, in the folder the job runs in
    (a file gone since lint, a relative one lint left to be made): the first problem as one
    line."""
    from rlx.lint.sources import source_problems
    from rlx.recipe.load import dotted

    for problem in source_problems(settings, Path.cwd()):
        raise RlxError(f"{dotted(problem.field)}: {problem.message}")


def resolve_reward_terms(settings: Any, env: Mapping[str, str]) -> Any:
    """The reward terms, each function imported and checked to take the call rlx makes
    (lint reads a file's; a module's is known only once imported here), each server's
    secret read from the environment; None with an environment (its reward replaces
    them)."""
    from rlx.trainer.tasks.reward_terms import build_terms
    from rlx.trainer.tasks.rewards import resolve_reward

    if settings.environment is not None:
        return None
    functions = {}
    for index, term in enumerate(settings.reward_terms()):
        if term.function is not None:
            fn = resolve_reward(term.function)
            check_reward_signature(settings, fn, index)
            functions[term.function] = fn
    return build_terms(settings, {**os.environ, **env}, functions)


def check_reward_signature(settings: Any, reward_fn: Any, index: int = 0) -> None:
    """The imported reward of term `index` (trainer.reward's with one) takes the call rlx
    makes (lint reads a file's; a module's is known only once imported here)."""
    from rlx.lint.sources import signature_problem
    from rlx.recipe.load import dotted

    if settings.environment is not None:
        return
    term = settings.reward_terms()[index]
    spec = term.function if settings.rewards else settings.reward.function
    problem = signature_problem(spec, reward_fn)
    if problem is not None:
        where = settings.reward_term_fields()[index]
        raise RlxError(f"{dotted((*where, 'function'))}: {problem}")


def check_context_at_start(settings: Any, policy_path: Any) -> None:
    """Lint's rules for the context window (trainer.environment's episode, or a prompt and
    its response), against the model as loaded: the first problem as one line."""
    import json

    from rlx.lint.environment import environment_problems
    from rlx.lint.sources import context_problems
    from rlx.recipe.load import dotted

    config = Path(policy_path) / "config.json"
    positions = None
    if config.is_file():
        positions = json.loads(config.read_text()).get("max_position_embeddings")
    problems = environment_problems(settings, Path.cwd(), positions)
    if positions is not None:
        problems += context_problems(settings, positions)
    for problem in problems:
        raise RlxError(f"{dotted(problem.field)}: {problem.message}")


def check_engine_installed(job: TrainJob) -> None:
    """RlxError unless this machine has the engine the job chose (what lint cannot see: the
    packages installed here)."""
    from rlx.trainer.rollout import engine_class

    engine_class(job.engine).check_installed(job.settings, job.on_gpus)


@contextlib.contextmanager
def training_session(
    job: TrainJob,
    env: Mapping[str, str],
    paths: RunPaths,
    out: TextIO,
    err: TextIO,
    stop: StopRequest | None = None,
) -> Iterator[Any]:
    """A Trainer whose actors are up (and torn down again on exit)."""
    from rlx.trainer.actors.cluster import Cluster
    from rlx.trainer.actors.placement import alive_nodes, check_resources
    from rlx.trainer.actors.probes import probe_nodes
    from rlx.trainer.checkpoint.probe import locations
    from rlx.trainer.loop import Trainer
    from rlx.trainer.report.metrics import host_memory_bytes

    inputs, policy_path, critic_path = resolve_inputs(job, env, paths)
    check_engine_installed(job)
    # Once the model is in this node's cache, its config plans DDP against FSDP.
    strategy = job.plan.strategy()
    stop = stop or StopRequest()
    with contextlib.ExitStack() as stack:
        stack.callback(stop.stay)  # last: Ray's teardown is over
        # Everything the run starts from here (a private Ray's daemons, its workers, engines)
        # ends with it, a kill -9 of this process included; after Ray's own teardown.
        stack.enter_context(owned_run())
        started_ray, where = connect_ray(job, env)
        if started_ray:
            stack.callback(stop_private_ray)
        # ray.init put in a SIGTERM handler that exits at once; ours releases the actors.
        stop = stack.enter_context(handle_signals(stop))
        nodes = alive_nodes()
        check_resources(job.recipe, nodes, where)
        probe_nodes(locations(job.recipe, job.plan.checkpoint_sizes()), nodes)  # before loads
        cluster = Cluster.start(job, nodes, policy_path, critic_path, strategy)
        stack.callback(cluster.shutdown)
        # A private Ray's processes are this process's children; a joined cluster's workers
        # belong to the raylets `ray start` began, so they are asked for their own figure.
        memory = host_memory_bytes if started_ray else _cluster_memory(cluster, host_memory_bytes)
        yield Trainer(inputs, cluster, out=out, err=err, memory_of=memory, stop=stop)


def start_sizes(recipe: Recipe, env: Mapping[str, str]) -> StartSizes:
    """The recipe narrowed to the accelerator alternative this node's GPUs are, with its
    `auto` sizes chosen (decided here, on the head, once: the actors get the result)."""
    from rlx.trainer.device import host_memory, read_devices, size_at_start

    stand_in = env.get(STAND_IN_GPUS_ENV) == "1"
    devices = read_devices() if recipe.resources.total_gpus and not stand_in else None
    return size_at_start(recipe, env, devices, host_bytes=host_memory())


def trainer_for(
    recipe: Recipe, env: Mapping[str, str], out: TextIO, err: TextIO | None = None
) -> contextlib.AbstractContextManager[Any]:
    """A Trainer for the recipe with its actors up, for code that drives it step by step
    (tests, benchmarks): the job narrowed and the run's folders found as `rlx train` does."""
    started = start_sizes(recipe, env)
    env = {**env, **started.env}
    job = TrainJob.of(started.recipe, stand_in_gpus=env.get(STAND_IN_GPUS_ENV) == "1", env=env)
    paths = run_paths(job.name, job.settings, env)
    return training_session(job, env, paths, out, out if err is None else err)


def planned_gpu_gib(job: TrainJob) -> float | None:
    """What `rlx plan` gives one training GPU at its peak, for the run's summary beside what
    the GPUs measured (None on CPU, or where the plan cannot say)."""
    return job.plan.gpu_peak_gib() if job.on_gpus else None


def sized_start(recipe: Recipe, env: Mapping[str, str]) -> tuple[StartSizes | Exception, StartPlan]:
    """start_sizes (or its error, raised where the run records it), and the start-up plan of
    the recipe it gives (of the recipe as it is where it fails)."""
    try:
        started = start_sizes(recipe, env)
    except Exception as exc:
        return exc, StartPlan(recipe, env)
    return started, StartPlan(started.recipe, {**env, **started.env})


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
    settings = recipe.trainer
    if settings is None:
        TrainJob.of(recipe)  # refuses it: nothing to train, so no run folder
    assert settings is not None
    paths = run_paths(recipe.name, settings, env)
    # The alternative this job got, its sizes and their plan, made once (a failure: below).
    started, plan = sized_start(recipe, env)
    # Every place the run writes, tried before anything loads: a fault costs seconds here.
    probe_locations(recipe, plan.checkpoint_sizes())
    paths.run_dir.mkdir(parents=True, exist_ok=True)
    pull_run(paths)  # logging.dir in a store: continue what an earlier attempt left there
    result = _running(paths, settings.steps)
    write_result(paths, result)
    stop = StopRequest()
    with console_to_log(paths.log) as (out, err), handle_signals(stop):
        print(run_line(paths), file=out, flush=True)
        if paths.run_url is not None:
            print(f"run folder mirrored to {paths.run_url}", file=out, flush=True)
        try:
            if isinstance(started, Exception):
                raise started
            env.update(started.env)
            print(started.line(), file=out, flush=True)
            result.accelerator = started.to_json()
            # The recipe narrowed once, by the checks lint runs too; a refusal is recorded.
            stand_in = env.get(STAND_IN_GPUS_ENV) == "1"
            job = TrainJob.of(started.recipe, stand_in_gpus=stand_in, plan=plan)
            if job.recipe.resources.total_gpus and not job.on_gpus:
                print(STAND_IN_LINE, file=out, flush=True)
            with training_session(job, env, paths, out, err, stop) as trainer:
                result.plan_gpu_gib = planned_gpu_gib(job)  # the model is cached now
                result.last_step = trainer.run()
                result.checkpoint_bytes = trainer.checkpoint_bytes
                result.best = trainer.best_record()
                result.model = None if trainer.exported is None else str(trainer.exported)
            finish(result, paths)
            result.state, result.exit_code = "SUCCEEDED", 0
        except Stopped as stop:
            result.state, result.exit_code, result.error = "CANCELLED", stop.code, str(stop)
            print(f"stopped by {stop}", file=out, flush=True)
            raise
        except BaseException as exc:
            _record_failure(result, exc, paths)
            raise
        finally:
            result.finished = time.time()
            result.cost = run_cost(env, result.started, result.finished)
            write_result(paths, result)
            mirror_run(paths, err)
        if print_summary:
            for line in summary_lines(result):
                print(line, file=out, flush=True)
    return result


def _running(paths: RunPaths, steps: int) -> RunResult:
    """The record of a run that starts now, in this process."""
    return RunResult(
        state="RUNNING",
        run_id=paths.run_id,
        run_dir=str(paths.run_dir),
        steps=steps,
        pid=os.getpid(),
        started=time.time(),
        metrics=str(paths.metrics),
        plot=str(paths.plot),
        log=str(paths.log),
        checkpoints=None if paths.checkpoints is None else str(paths.checkpoints),
    )


def _record_failure(result: RunResult, exc: BaseException, paths: RunPaths) -> None:
    """The run failed with `exc`: its record says so, and its log has the error's line."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
    code = exc.exit_code if isinstance(exc, RlxError) else 1
    result.state, result.exit_code, result.error = "FAILED", code, message
    with paths.log.open("a", encoding="utf-8") as log:  # the CLI prints it on screen
        print(f"error: {message}", file=log)


def main(recipe: Recipe, env: Mapping[str, str] | None = None) -> int:
    """`rlx train`: the exit code (0 on success; failures raise RlxError for the CLI)."""
    try:
        run_training(recipe, env)
    except Stopped as stop:
        return stop.code
    return 0
