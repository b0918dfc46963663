"""Sizes that follow the GPU: `auto` for trainer.batch.micro_batch_size,
trainer.rollout.gpu_memory_utilization and trainer.rollout.tensor_parallel_size, chosen from
the memory plan of one accelerator alternative.

One function (choose_sizes, as rlx.plan.planner.size_recipe) decides them for `rlx plan`,
for lint (every alternative must have a valid choice) and for the trainer at start-up (the
alternative the job got, read from the device), so the three always agree. The rule, in
the order the choices depend on each other:
- tensor_parallel_size: 1 where engines share the training GPUs or run on CPU; on rollout
  GPUs of their own, the fewest GPUs per engine (1, 2, 4, 8 dividing the engines' GPUs per
  node) whose weights leave a KV cache for MIN_ENGINE_SEQUENCES full-length sequences (or
  for the engine's share of a step, when that is fewer);
- gpu_memory_utilization: ENGINE_ALONE on rollout GPUs of their own; colocated, what the
  rollout phase leaves the engine once the training rank's resident state is counted and
  HEADROOM kept spare, in steps of UTILIZATION_STEP, at most ENGINE_ALONE;
- micro_batch_size: the largest power of two, at most a rank's share of a minibatch, whose
  update keeps HEADROOM spare on the training GPU (host memory on CPU).
A fixed value stays as written.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rlx.errors import RlxError
from rlx.recipe.model import AUTO, Recipe, TrainerSettings

# A plan of a recipe whose sizes are fixed (rlx.plan.planner.plan_recipe, without advice).
PlanOf = Callable[[Recipe, Mapping[str, str] | None], Any]
# What `auto` may size, by field path.
AUTO_FIELDS = {
    "micro_batch_size": ("trainer", "batch", "micro_batch_size"),
    "gpu_memory_utilization": ("trainer", "rollout", "gpu_memory_utilization"),
    "tensor_parallel_size": ("trainer", "rollout", "tensor_parallel_size"),
}
ENGINE_ALONE = 0.9  # vLLM's own default share, for an engine on GPUs of its own
UTILIZATION_STEP = 0.05
MIN_UTILIZATION = 0.1  # below this a colocated engine is not worth having: split instead
MIN_ENGINE_SEQUENCES = 8
TENSOR_PARALLEL = (1, 2, 4, 8)
DEFAULT_UTILIZATION = 0.5  # where it is unused (CPU, the hf engine): the field's default


@dataclass(frozen=True)
class Sizes:
    """The three sizes a recipe runs with, which of them `auto` chose, and, when no value
    works, why (one line each, naming the field and what to change)."""

    micro_batch_size: int
    gpu_memory_utilization: float
    tensor_parallel_size: int
    auto: tuple[str, ...] = ()
    problems: tuple[str, ...] = field(default=())

    def line(self) -> str:
        """'micro_batch_size 8, gpu_memory_utilization 0.55, tensor_parallel_size 1' with
        the ones auto chose marked."""
        parts = []
        for name in AUTO_FIELDS:
            mark = " (auto)" if name in self.auto else ""
            parts.append(f"{name} {getattr(self, name):g}{mark}")
        return ", ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in AUTO_FIELDS} | {
            "auto": list(self.auto),
            "problems": list(self.problems),
        }


def auto_fields(recipe: Recipe) -> list[str]:
    """The fields of AUTO_FIELDS the recipe leaves to `auto`."""
    trainer = recipe.trainer
    if trainer is None:
        return []
    values = {
        "micro_batch_size": trainer.batch.micro_batch_size,
        "gpu_memory_utilization": trainer.rollout.gpu_memory_utilization,
        "tensor_parallel_size": trainer.rollout.tensor_parallel_size,
    }
    return [name for name, value in values.items() if value == AUTO]


def with_sizes(
    recipe: Recipe,
    *,
    micro_batch_size: int | None = None,
    gpu_memory_utilization: float | None = None,
    tensor_parallel_size: int | None = None,
) -> Recipe:
    """The recipe with the sizes given (None: as it is)."""
    trainer = recipe.trainer
    assert trainer is not None
    batch, rollout = trainer.batch, trainer.rollout
    if micro_batch_size is not None:
        batch = batch.model_copy(update={"micro_batch_size": micro_batch_size})
    update: dict[str, Any] = {}
    if gpu_memory_utilization is not None:
        update["gpu_memory_utilization"] = gpu_memory_utilization
    if tensor_parallel_size is not None:
        update["tensor_parallel_size"] = tensor_parallel_size
    rollout = rollout.model_copy(update=update)
    trainer = trainer.model_copy(update={"batch": batch, "rollout": rollout})
    return recipe.model_copy(update={"trainer": trainer})


def choose_sizes(
    recipe: Recipe,
    env: Mapping[str, str] | None,
    plan: PlanOf,
    *,
    host_bytes: int | None = None,
    alternatives: int | None = None,
) -> tuple[Recipe, Sizes]:
    """The recipe with its `auto` sizes chosen from the plan of its first (preferred)
    accelerator alternative, and the sizes. host_bytes: the memory of this machine, the host
    capacity of a CPU-only recipe that gives no resources.memory (unset: the largest size
    that splits the batch). alternatives: how many the job chose from (unset: the recipe's),
    so that a problem says to drop this one when there are others. Sizes.problems says why
    a field has no valid value; the recipe then carries the most frugal one, so its plan
    shows what does not fit."""
    trainer = recipe.trainer
    if trainer is None:
        raise RlxError(f"recipe {recipe.name!r} has no trainer section; nothing to size")
    narrowed = recipe
    options = recipe.resources.train_nodes.accelerator_options
    rollout_group = recipe.resources.rollout_nodes
    rollout_options = rollout_group.accelerator_options if rollout_group else ()
    if len(options) > 1 or len(rollout_options) > 1:
        narrowed = recipe.on_accelerators(
            options[0] if options else None, rollout_options[0] if rollout_options else None
        )
    chosen = auto_fields(recipe)
    planned = narrowed
    if host_bytes is not None and narrowed.resources.memory is None:
        resources = narrowed.resources.model_copy(update={"memory": str(host_bytes / 1e9)})
        planned = narrowed.model_copy(update={"resources": resources})
    if trainer.batch.micro_batch_size == AUTO:  # the rollout's sizes do not depend on it
        planned = with_sizes(planned, micro_batch_size=1)
    problems: list[str] = []
    tp = trainer.rollout.tensor_parallel_size
    if tp == AUTO:
        tp, problem = _choose_tensor_parallel(planned, env, plan)
        problems += [problem] if problem else []
    util = trainer.rollout.gpu_memory_utilization
    if util == AUTO:
        util, problem = _choose_utilization(with_sizes(planned, tensor_parallel_size=tp), env, plan)
        problems += [problem] if problem else []
    mbs = trainer.batch.micro_batch_size
    if mbs == AUTO:
        candidate = with_sizes(planned, tensor_parallel_size=tp, gpu_memory_utilization=util)
        mbs, problem = _choose_micro_batch(candidate, env, plan)
        problems += [problem] if problem else []
    assert not isinstance(tp, str) and not isinstance(util, str) and not isinstance(mbs, str)
    problems.reverse()  # the training state's first: a rollout size cannot fix it
    if alternatives is None:
        alternatives = max(len(options), 1) * max(len(rollout_options), 1)
    if alternatives <= 1:  # nothing to drop: nothing else
        other = f"use GPUs with more memory than {_accelerator(narrowed)}"
        problems = [p.replace(_drop(narrowed), other) for p in problems]
    sized = with_sizes(
        recipe, micro_batch_size=mbs, gpu_memory_utilization=util, tensor_parallel_size=tp
    )
    return sized, Sizes(mbs, util, tp, tuple(chosen), tuple(problems))


# --------------------------------------------------------------------------- the choices


def _accelerator(recipe: Recipe) -> str:
    return str(recipe.resources.train_nodes.accelerators or "CPU")


def _drop(recipe: Recipe) -> str:
    """What to write to do without this accelerator."""
    where = "resources.groups.train" if recipe.resources.groups else "resources"
    return f"drop {_accelerator(recipe)} from {where}.accelerators"


def _gpu(recipe: Recipe) -> bool:
    return recipe.resources.gpus_per_node > 0


def _engines_apart(recipe: Recipe) -> bool:
    """vLLM engines on GPUs of their own (layout: split on GPUs, with vLLM)."""
    from rlx.plan.budget import engine_of

    trainer = recipe.trainer
    assert trainer is not None
    return _gpu(recipe) and trainer.layout == "split" and engine_of(trainer, True) == "vllm"


def _needed_sequences(trainer: TrainerSettings, engines: int) -> int:
    """Full-length sequences an engine's KV cache should hold: MIN_ENGINE_SEQUENCES, or its
    share of a step's when fewer."""
    step = trainer.batch.prompts_per_step * trainer.rollout.n
    return max(1, min(MIN_ENGINE_SEQUENCES, math.ceil(step / max(engines, 1))))


def _choose_tensor_parallel(
    recipe: Recipe, env: Mapping[str, str] | None, plan: PlanOf
) -> tuple[int, str | None]:
    trainer = recipe.trainer
    assert trainer is not None
    if not _engines_apart(recipe):
        return 1, None
    gpus = recipe.resources.engine_gpus_per_node
    rollout_gpus = trainer.rollout_gpus
    grouped = recipe.resources.groups is not None
    candidates = [
        tp
        for tp in TENSOR_PARALLEL
        if gpus % tp == 0 and (grouped or (rollout_gpus and rollout_gpus % tp == 0))
    ]
    if not candidates:
        return 1, None  # the layout checks say what is wrong with rollout_gpus
    util = trainer.rollout.gpu_memory_utilization
    util = ENGINE_ALONE if util == AUTO else util
    for tp in candidates:
        planned = plan(
            with_sizes(recipe, tensor_parallel_size=tp, gpu_memory_utilization=util), env
        )
        rollout = planned.gpus[-1]
        engines = max(rollout.count // tp, 1)
        if rollout.fits and (rollout.engine_sequences or 0) >= _needed_sequences(trainer, engines):
            return tp, None
    largest = candidates[-1]
    return largest, (
        f"trainer.rollout.tensor_parallel_size: auto: on {_accelerator(recipe)} no engine of "
        f"up to {largest} GPUs holds the weights and a KV cache for "
        f"{MIN_ENGINE_SEQUENCES} full-length sequences; give the rollout more GPUs per node, "
        f"or {_drop(recipe)}"
    )


def _choose_utilization(
    recipe: Recipe, env: Mapping[str, str] | None, plan: PlanOf
) -> tuple[float, str | None]:
    from rlx.plan.budget import HEADROOM, colocated_vllm, gib

    trainer = recipe.trainer
    assert trainer is not None
    if _engines_apart(recipe):
        return ENGINE_ALONE, None
    if not colocated_vllm(trainer, _gpu(recipe)):
        return DEFAULT_UTILIZATION, None  # no vLLM on these GPUs: unused
    probe = plan(with_sizes(recipe, gpu_memory_utilization=DEFAULT_UTILIZATION), env)
    training = probe.gpus[0]
    capacity = training.capacity or 0
    resident = sum(i.bytes for i in training.items if i.phase == "all")
    room = (capacity * (1 - HEADROOM) - resident) / max(capacity, 1)
    steps = math.floor(round(room / UTILIZATION_STEP, 6))
    util = round(min(ENGINE_ALONE, steps * UTILIZATION_STEP), 2)
    where = "trainer.rollout.gpu_memory_utilization: auto"
    if util < MIN_UTILIZATION:
        return MIN_UTILIZATION, (
            f"{where}: on {_accelerator(recipe)} a training rank keeps {gib(resident)} of "
            f"{gib(capacity)} GiB while its colocated vLLM engine generates, which leaves the "
            f"engine too little; {_drop(recipe)}, or shard further (more GPUs, "
            "parallel.offload_optimizer) or use layout: split"
        )
    planned = plan(with_sizes(recipe, gpu_memory_utilization=util), env)
    if not planned.gpus[0].engine_sequences:
        return util, (
            f"{where}: on {_accelerator(recipe)} the {util:g} share a training rank leaves its "
            "colocated vLLM engine holds its weights but no KV cache for one full-length "
            f"sequence; {_drop(recipe)}, or use layout: split"
        )
    return util, None


def _choose_micro_batch(
    recipe: Recipe, env: Mapping[str, str] | None, plan: PlanOf
) -> tuple[int, str | None]:
    from rlx.plan.budget import HEADROOM, gib

    trainer = recipe.trainer
    assert trainer is not None
    share = _rank_share(recipe)
    sizes = [2**k for k in range(int(math.log2(share)), -1, -1)]
    planned = None
    for size in sizes:
        planned = plan(with_sizes(recipe, micro_batch_size=size), env)
        budgets = planned.gpus[:1] if _gpu(recipe) else planned.hosts
        if all(b.capacity is None or b.peak <= b.capacity * (1 - HEADROOM) for b in budgets):
            return size, None
    assert planned is not None
    budget = planned.gpus[0] if _gpu(recipe) else planned.hosts[0]
    return 1, (
        f"trainer.batch.micro_batch_size: auto: on {_accelerator(recipe)} even one sequence "
        f"per micro-batch needs {gib(budget.peak)} of {gib(budget.capacity or 0)} GiB at "
        f"{budget.peak_phase} with {HEADROOM:.0%} spare; {_drop(recipe)}, or see `rlx plan` "
        "for what to change"
    )


def _rank_share(recipe: Recipe) -> int:
    """Sequences a training rank gets per minibatch (at least 1)."""
    from rlx.plan.actors import plan_actors

    trainer = recipe.trainer
    assert trainer is not None
    try:
        ranks = plan_actors(recipe).train_workers
    except RlxError:  # an impossible split layout: the layout checks say so
        ranks = 1
    batch = trainer.batch
    samples = batch.prompts_per_step * trainer.rollout.n
    return max((batch.minibatch_size or samples) // max(ranks, 1), 1)
