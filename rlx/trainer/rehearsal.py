"""`rlx rehearse RECIPE`: the recipe's job, on this machine, before any GPU is paid for.

A dress rehearsal runs the job exactly as written except for two things it cannot have here:
the model's size and the accelerators.

- The model: a small random model of the same architecture (model type, tied or untied
  head, grouped-query attention, position range; a byte-level tokenizer) is put under the
  recipe's own hub id in a hub cache of the rehearsal's own, served offline
  (HF_HUB_OFFLINE=1), so every path that resolves, shards, loads, serves, pushes,
  checkpoints and exports the model runs as it will on the cluster.
- The accelerators: every node becomes a Ray node on this machine (a raylet) that declares
  stand-in GPUs, at most two per node (RLX_STAND_IN_GPUS: the job is placed on them exactly
  as on GPUs, placement groups, whole-node training ranks, tensor-parallel engine groups,
  node-group labels, and computes on CPU in float32). The counts shrink with them: at most
  two nodes per group, two training ranks, one engine (tensor parallel at most 2), at most
  4 samples per prompt of at most 16 tokens, and a batch that keeps the recipe's shape
  (several minibatches stay several, every rank gets work).

Everything else is the recipe's: algorithm, layout, the strategy its GPU run would choose
(rlx.plan.strategy, pinned), engines (vLLM's CPU build stands in for vLLM), node groups,
staleness, environments, rewards, data, storage (the real buckets or folders, under a run
id of its own), checkpoint keep, the weight push and its probe. It trains steps 1-2, saves a
checkpoint, then resumes as a retried job would and trains step 3. What it cannot show: GPU
memory, kernels, NCCL and speed (`rlx plan` plans the memory).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from rlx.errors import RlxError
from rlx.lint import refuse_at_startup
from rlx.node.env import environment
from rlx.plan.actors import plan_actors
from rlx.plan.shapes import ModelShape, PlanError, find_shape
from rlx.plan.strategy import StrategyChoice, choose_strategy
from rlx.recipe.model import Recipe, episode_token_budget
from rlx.trainer.job import STAND_IN_GPUS_ENV, TrainJob

STEPS = 3  # steps 1-2, a checkpoint at 2, then a resume that trains step 3
CHECKPOINT_STEP = 2
STAND_IN_GPUS = 2  # per node at most
MOST_NODES = 2  # per group
MOST_TRAIN_RANKS = 2
MOST_TENSOR_PARALLEL = 2
MOST_SAMPLES = 4  # rollout.n
MOST_NEW_TOKENS = 16
MOST_SAMPLING_ROUNDS = 2  # batch.filter_groups.max_rounds
MOST_MINIBATCHES = 2
MOST_VALIDATION_PROMPTS = 4
# The stand-in model: vLLM's CPU attention takes heads of 64.
STAND_IN_HIDDEN = 128
STAND_IN_LAYERS = 2
STAND_IN_HEADS = 2
STAND_IN_ARCHS = ("qwen2", "llama")
ACCELERATOR = re.compile(r"(?P<type>[^:]+)(:(?P<count>\d+))?")


@dataclass(frozen=True)
class RayNode:
    """A Ray node the rehearsal starts here: its stand-in GPUs and its group label."""

    gpus: int
    group: str | None = None


@dataclass
class RehearsalPlan:
    """What a rehearsal runs: the recipe it trains, the Ray nodes it needs, what differs
    from the recipe as written, and the stand-in models it builds (hub id -> real shape)."""

    recipe: Recipe
    nodes: list[RayNode]
    changes: list[tuple[str, str, str]] = field(default_factory=list)
    models: dict[str, ModelShape] = field(default_factory=dict)
    strategy: StrategyChoice | None = None


def plan_rehearsal(recipe: Recipe, env: Mapping[str, str] | None = None) -> RehearsalPlan:
    """The rehearsal of a recipe (pure: nothing is built or started). RlxError for a recipe
    that cannot be rehearsed here."""
    trainer = recipe.trainer
    if trainer is None or recipe.command is not None:
        raise RlxError(
            f"recipe {recipe.name!r} runs no rlx trainer (no 'trainer:' section, or a "
            "'command:'): there is nothing to rehearse; `rlx launch --keep` brings a cluster up"
        )
    try:
        recipe = _as_gpus_run_it(recipe, env)
        refuse_at_startup(recipe)  # what start-up refuses is no job to scale down
        strategy = choose_strategy(recipe, env)
    except PlanError as exc:
        raise RlxError(f"{recipe.name}: {exc}") from None
    trainer = recipe.trainer
    assert trainer is not None
    data = recipe.model_dump(mode="json")
    changes: list[tuple[str, str, str]] = []

    def change(path: str, value: Any) -> None:
        *parents, key = path.split(".")
        node = data
        for part in parents:
            node = node[part]
        if node.get(key) != value:
            changes.append((path, _shown(node.get(key)), _shown(value)))
            node[key] = value

    tensor_parallel = min(trainer.rollout.tensor_parallel_size, MOST_TENSOR_PARALLEL)
    nodes = _scale_resources(recipe, change, tensor_parallel)
    change("trainer.rollout.tensor_parallel_size", tensor_parallel)
    models = _stand_in_models(recipe, env, change)
    _scale_work(recipe, change)
    if strategy.strategy != "single":
        change("trainer.parallel.strategy", strategy.strategy)  # what the GPU run chooses
    rehearsal = Recipe.model_validate(data)
    _scale_batch(recipe, rehearsal, change)
    rehearsal = Recipe.model_validate(data)
    TrainJob.of(rehearsal, stand_in_gpus=True)  # lint's start-up checks: one line if refused
    return RehearsalPlan(rehearsal, nodes, changes, models, strategy)


def _shown(value: Any) -> str:
    return "-" if value is None else str(value)


def _scaled(accelerators: str | None, count: int) -> str | None:
    if accelerators is None:
        return None
    match = ACCELERATOR.fullmatch(accelerators)
    assert match is not None  # the recipe model checked it
    return f"{match['type']}:{count}"


def _scale_resources(recipe: Recipe, change: Any, tp: int) -> list[RayNode]:
    """Nodes and stand-in GPUs: at most MOST_NODES per group, enough GPUs per node for at
    most MOST_TRAIN_RANKS training ranks and one engine."""
    resources, trainer = recipe.resources, recipe.trainer
    assert trainer is not None
    if resources.groups is not None:
        out = []
        for name, group in resources.node_groups():
            count = min(group.nodes, MOST_NODES)
            gpus = group.gpus_per_node
            if gpus:
                gpus = min(gpus, STAND_IN_GPUS) if name == "train" else tp
                change(f"resources.groups.{name}.accelerators", _scaled(group.accelerators, gpus))
            change(f"resources.groups.{name}.nodes", count)
            out += [RayNode(gpus, name)] * count
        return out
    count = min(resources.nodes, MOST_NODES)
    change("resources.nodes", count)
    gpus = resources.gpus_per_node
    if not gpus:
        if trainer.layout == "split":
            change("trainer.rollout_gpus", 1)  # CPU: one engine
        return [RayNode(0)] * count
    train = min(
        resources.total_gpus - (trainer.rollout_gpus if trainer.layout == "split" else 0),
        MOST_TRAIN_RANKS,
    )
    engines = tp if trainer.layout == "split" else 0
    per_node = max(math.ceil((train + engines) / count), tp if engines else 1)
    change("resources.accelerators", _scaled(resources.accelerators, per_node))
    if trainer.layout == "split":
        change("trainer.rollout_gpus", engines)
    return [RayNode(per_node)] * count


def _stand_in_models(
    recipe: Recipe, env: Mapping[str, str] | None, change: Any
) -> dict[str, ModelShape]:
    """The hub ids the recipe names, with the real shape each stand-in copies; CPU dtype."""
    from rlx.hub import is_hub_id

    trainer = recipe.trainer
    assert trainer is not None
    models: dict[str, ModelShape] = {}
    for key, settings in (("model", trainer.model), ("critic_model", trainer.critic_model)):
        if settings is None:
            continue
        change(f"trainer.{key}.dtype", "float32")  # CPU ranks (bf16 on gloo is unreliable)
        if not is_hub_id(settings.path):
            continue  # a folder, a store copy or a tiny model: rehearsed as it is
        try:
            shape = find_shape(settings.path, env)
        except PlanError as exc:
            raise RlxError(f"trainer.{key}.path: {exc}") from None
        if shape.model_type not in STAND_IN_ARCHS:
            raise RlxError(
                f"trainer.{key}.path: {settings.path} is a {shape.model_type or 'unknown'} "
                f"model; a rehearsal builds stand-ins of {', '.join(STAND_IN_ARCHS)} models only"
            )
        models[settings.path] = shape
    return models


def _scale_work(recipe: Recipe, change: Any) -> None:
    trainer = recipe.trainer
    assert trainer is not None
    rollout = trainer.rollout
    change("trainer.rollout.n", min(rollout.n, MOST_SAMPLES))
    new_tokens = min(rollout.max_new_tokens, MOST_NEW_TOKENS)
    change("trainer.rollout.max_new_tokens", new_tokens)
    buffer = trainer.algo.overlong.buffer
    if buffer:  # the same share of the shorter responses
        change("trainer.algo.overlong.buffer", buffer * new_tokens // rollout.max_new_tokens)
    if trainer.batch.filter_groups is not None:  # a stand-in model varies seldom: 2 calls
        rounds = trainer.batch.filter_groups.max_rounds
        change("trainer.batch.filter_groups.max_rounds", min(rounds, MOST_SAMPLING_ROUNDS))
    environment = trainer.environment
    if environment is not None:
        turns = environment.max_turns * 2 * min(rollout.max_new_tokens, MOST_NEW_TOKENS)
        change("trainer.environment.max_tokens", min(episode_token_budget(trainer), turns))
    if trainer.validation is not None:
        validation = trainer.validation
        change(
            "trainer.validation.max_prompts",
            min(validation.max_prompts or MOST_VALIDATION_PROMPTS, MOST_VALIDATION_PROMPTS),
        )
        if validation.max_new_tokens is not None:
            change(
                "trainer.validation.max_new_tokens", min(validation.max_new_tokens, MOST_NEW_TOKENS)
            )
    change("trainer.steps", STEPS)
    change("trainer.checkpoint.every", CHECKPOINT_STEP)
    change("trainer.checkpoint.resume", "auto")
    change("trainer.logging.wandb_project", None)  # nothing leaves this machine
    change("trainer.logging.every", 1)


def _as_gpus_run_it(recipe: Recipe, env: Mapping[str, str] | None) -> Recipe:
    """The recipe on its preferred accelerator alternative, its `auto` sizes chosen for it:
    what the GPU run would start with there."""
    from rlx.plan.planner import size_recipe
    from rlx.plan.sizing import auto_fields

    recipe = recipe.alternatives()[0][1]
    if not auto_fields(recipe):
        return recipe
    sized, sizes = size_recipe(recipe, env)
    if sizes.problems:
        raise RlxError(sizes.problems[0])
    return sized


def _scale_batch(recipe: Recipe, rehearsal: Recipe, change: Any) -> None:
    """Every rank gets work (a prompt's samples per rank and minibatch), and several
    minibatches stay several."""
    shipped, trainer = recipe.trainer, rehearsal.trainer
    assert shipped is not None and trainer is not None
    ranks = plan_actors(rehearsal).train_workers
    batch, n = shipped.batch, trainer.rollout.n
    samples = batch.prompts_per_step * shipped.rollout.n
    minibatches = min(samples // (batch.minibatch_size or samples), MOST_MINIBATCHES)
    prompts = ranks * minibatches
    change("trainer.batch.prompts_per_step", prompts)
    if batch.minibatch_size is not None:
        change("trainer.batch.minibatch_size", prompts * n // minibatches)
    change("trainer.batch.micro_batch_size", min(batch.micro_batch_size, n))


# --------------------------------------------------------------------------- running


@dataclass
class RunOutcome:
    state: str
    last_step: int | None
    steps_logged: list[int]
    seconds: float
    error: str | None = None


@dataclass
class RehearsalResult:
    plan: RehearsalPlan
    run_id: str
    runs: list[RunOutcome]
    checkpoints: str | None
    resumed: bool = True  # the resume was asked for (`rlx rehearse --no-resume`: not)

    @property
    def passed(self) -> bool:
        first, last = self.runs[0], self.runs[-1]
        steps = STEPS if self.resumed else CHECKPOINT_STEP
        return (
            len(self.runs) == (2 if self.resumed else 1)
            and first.state == "SUCCEEDED"
            and first.last_step == CHECKPOINT_STEP
            and last.state == "SUCCEEDED"
            and last.last_step == steps
            and last.steps_logged == list(range(1, steps + 1))
        )


def build_stand_in(shape: ModelShape, folder: Path, seed: int = 0) -> Path:
    """A small random model of the shape's architecture (tied or untied head, grouped-query
    attention when the real one has it, its position range) with the byte-level tokenizer."""
    from rlx.trainer.model.tiny import build_tiny_model

    kv_heads = STAND_IN_HEADS if shape.kv_heads >= shape.heads else 1
    return build_tiny_model(
        folder,
        arch=shape.model_type,
        hidden_size=STAND_IN_HIDDEN,
        num_layers=STAND_IN_LAYERS,
        num_heads=STAND_IN_HEADS,
        num_kv_heads=kv_heads,
        intermediate_size=2 * STAND_IN_HIDDEN,
        max_position_embeddings=shape.max_positions or 4096,
        tie_word_embeddings=shape.tie_word_embeddings,
        seed=seed,
    )


def fill_cache(plan: RehearsalPlan, cache: Path) -> None:
    """Each stand-in built and put under its hub id in the hub cache at `cache`."""
    from rlx.hub import put_in_cache

    for index, (repo_id, shape) in enumerate(plan.models.items()):
        built = build_stand_in(shape, cache.parent / f"stand-in-{index}", seed=index)
        put_in_cache(built, repo_id, {"HF_HUB_CACHE": str(cache)})


@contextlib.contextmanager
def ray_nodes(nodes: list[RayNode]) -> Iterator[str]:
    """The rehearsal's Ray nodes on this machine (one raylet each, stand-in GPUs, group
    labels, loopback only); yields the address to join."""
    from ray.cluster_utils import Cluster

    from rlx.node.env import NODE_GROUP_LABEL

    def args(node: RayNode) -> dict[str, Any]:
        options: dict[str, Any] = {"num_cpus": max(node.gpus, 1) + 2, "num_gpus": node.gpus}
        if node.group is not None:
            options["labels"] = {NODE_GROUP_LABEL: node.group}
        return options

    def start() -> Any:
        head, *others = nodes
        cluster = Cluster(
            initialize_head=True, head_node_args={**args(head), "include_dashboard": False}
        )
        try:
            for node in others:
                cluster.add_node(**args(node))
        except BaseException:
            cluster.shutdown()
            raise
        return cluster

    from rlx.trainer.main import started_on_a_busy_machine

    cluster = started_on_a_busy_machine(start, "the rehearsal's Ray nodes")
    try:
        yield cluster.address
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()


def rehearse(
    recipe: Recipe,
    *,
    env: Mapping[str, str] | None = None,
    address: str | None = None,
    hub_cache: Path | None = None,
    run_id: str | None = None,
    out: TextIO | None = None,
    resume: bool = True,
) -> RehearsalResult:
    """Plan the rehearsal, build the stand-in models, bring the Ray nodes up here (or join
    `address`, whose nodes a caller brought up with this hub cache in their environment),
    train steps 1-2 and then (`resume`) resume for step 3, each a run of `rlx train` as on a
    cluster's head. The recipe's env is set for the runs, as on its nodes."""
    from rlx.trainer.main import run_training

    env = dict(os.environ if env is None else env)
    plan = plan_rehearsal(recipe, env)
    run_id = run_id or f"{recipe.name}-rehearsal-{time.strftime('%Y%m%d-%H%M%S')}"
    with contextlib.ExitStack() as stack:
        if hub_cache is None:
            scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rlx-rehearse-")))
            hub_cache = scratch / "hub"
        fill_cache(plan, hub_cache)
        values = {
            **recipe.env,
            "HF_HUB_CACHE": str(hub_cache),
            "HF_HUB_OFFLINE": "1",
            STAND_IN_GPUS_ENV: "1",
            "RLX_RUN_ID": run_id,
        }
        stack.enter_context(environment(values))
        if address is None:
            stack.enter_context(environment({"RAY_AUTH_MODE": "disabled"}))
            address = stack.enter_context(ray_nodes(plan.nodes))
        run_env = {**env, **values, "RAY_ADDRESS": address}
        runs = []
        for steps in (CHECKPOINT_STEP, STEPS) if resume else (CHECKPOINT_STEP,):
            runs.append(_run(plan.recipe, steps, run_env, run_training))
            if runs[-1].state != "SUCCEEDED":
                break
    from rlx.trainer.resolve import run_paths

    assert plan.recipe.trainer is not None
    paths = run_paths(plan.recipe.name, plan.recipe.trainer, {"RLX_RUN_ID": run_id})
    checkpoints = None if paths.checkpoints is None else str(paths.checkpoints)
    return RehearsalResult(plan, run_id, runs, checkpoints, resume)


def _run(recipe: Recipe, steps: int, env: dict[str, str], run_training: Any) -> RunOutcome:
    from rlx.runs import read_metrics
    from rlx.trainer.report.console import Stopped
    from rlx.trainer.resolve import run_paths

    assert recipe.trainer is not None
    trainer = recipe.trainer.model_copy(update={"steps": steps})
    run = recipe.model_copy(update={"trainer": trainer})
    started = time.monotonic()
    try:
        result = run_training(run, env, print_summary=False)
        state, last, error = result.state, result.last_step, None
    except (RlxError, Stopped) as exc:
        state, last, error = "FAILED", None, str(exc)
    paths = run_paths(run.name, trainer, env)
    logged = (
        [int(r["step"]) for r in read_metrics(paths.metrics)] if paths.metrics.is_file() else []
    )
    return RunOutcome(state, last, logged, time.monotonic() - started, error)


def report_lines(result: RehearsalResult, source: str) -> list[str]:
    """What `rlx rehearse` prints at the end."""
    plan = result.plan
    lines = [f"rehearsal of {source}: {'passed' if result.passed else 'FAILED'}"]
    if plan.strategy is not None:
        lines.append(f"  strategy: {plan.strategy.strategy} ({plan.strategy.reason})")
    for repo_id, shape in plan.models.items():
        lines.append(
            f"  model: {repo_id} ({shape.describe()}) stood in by a {shape.model_type} of "
            f"{STAND_IN_LAYERS} layers, hidden {STAND_IN_HIDDEN}"
        )
    names = ("steps 1-2 and a checkpoint", "resumed: step 3")
    for name, run in zip(names, result.runs, strict=False):
        what = run.error or f"{run.state.lower()}, steps logged {run.steps_logged}"
        lines.append(f"  {name}: {what} ({run.seconds:.0f} s)")
    lines.append(f"  run id: {result.run_id}; checkpoints: {result.checkpoints or 'off'}")
    return lines


def change_lines(plan: RehearsalPlan) -> list[str]:
    """The table of what the rehearsal changes, printed before it runs."""
    if not plan.changes:
        return ["the rehearsal runs the recipe as written"]
    width = max(len(path) for path, _, _ in plan.changes)
    lines = ["what the rehearsal changes (everything else is the recipe's):"]
    lines += [f"  {path.ljust(width)}  {was} -> {now}" for path, was, now in plan.changes]
    kinds: dict[RayNode, int] = {}
    for node in plan.nodes:
        kinds[node] = kinds.get(node, 0) + 1
    nodes = ", ".join(
        f"{count} x {node.gpus} stand-in GPU(s)" + (f" ({node.group})" if node.group else "")
        for node, count in kinds.items()
    )
    lines.append(f"  Ray nodes on this machine: {nodes}; the ranks and engines compute on CPU")
    return lines
