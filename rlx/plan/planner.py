"""`rlx plan`: the memory a recipe needs, per GPU and per node, against what it asks for.

The plan follows the trainer as it is built: one training rank per GPU (one per node on
CPU), FSDP2 per decoder layer then the root or DDP as rlx.plan.strategy chooses, float32
master weights, gradients and AdamW moments (sharded under FSDP), the
reference in the compute dtype, PPO's critic with its own AdamW, micro-batches of
micro_batch_size sequences or max_tokens_per_micro_batch tokens, chunked log-probs, and
rollout engines colocated (vLLM in the training process at gpu_memory_utilization, asleep
while training) or split onto their own GPUs. With LoRA (trainer.model.lora) the base is
frozen in the compute dtype, only the float32 adapters have gradients and AdamW moments,
the reference is the base with the adapters off (no copy), vLLM engines hold LoRA slots
beside their copy of the base, and pushes and checkpoints carry the adapters alone
(rlx.plan.lora has the sizes).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from rlx.errors import RlxError
from rlx.plan import lora as lora_sizes
from rlx.plan import memory as mem
from rlx.plan.budget import (
    GIB,
    HEADROOM,
    Budget,
    Generation,
    Layout,
    TrainedModel,
    UnknownAccelerator,
    checkpoint_size,
    dtypes,
    engine_of,
    generation_of,
    gib,
    gpu_capacity,
    host_budgets,
    layout_of,
    rollout_budget,
    sequence_tokens,
    trained_models,
    training_budget,
)
from rlx.plan.shapes import ModelShape, PlanError, find_shape
from rlx.plan.sizing import Sizes, auto_fields, choose_sizes
from rlx.plan.strategy import StrategyChoice, choose_strategy
from rlx.recipe.model import Recipe, Resources, TrainerSettings, episode_token_budget
from rlx.storage import is_store_url


@dataclass
class MemoryPlan:
    recipe: str
    model: str
    accelerator: str | None
    strategy: str
    strategy_reason: str
    train_ranks: int
    gpus: list[Budget]
    hosts: list[Budget]
    checkpoint_bytes: int
    checkpoints_on_disk: int
    export_bytes: int
    staging_bytes: int = 0  # per node: the shards staged on local disk before an upload
    checkpoints_in_store: bool = False  # checkpoints_on_disk counts the store's copies
    episode_turns: int | None = None  # with an environment: model turns per episode at most
    episode_tokens: int = 0  # tokens after the prompt a rollout may hold (episode_token_budget)
    generation: Generation | None = None  # a step's generate calls
    export_merged_bytes: int = 0  # with LoRA: the base with the adapter merged in
    lora: dict[str, dict[str, Any]] = field(default_factory=dict)  # per adapted model
    sizes: Sizes | None = None  # what `auto` chose, when the recipe leaves a size to it
    problems: list[str] = field(default_factory=list)  # does not fit: what to change
    warnings: list[str] = field(default_factory=list)  # fits, but tightly
    # the choice behind strategy and strategy_reason, for the trainer's start-up
    strategy_choice: StrategyChoice | None = field(default=None, repr=False, compare=False)

    @property
    def fits(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        def budget(b: Budget) -> dict[str, Any]:
            return {
                "title": b.title,
                "count": b.count,
                "capacity_bytes": b.capacity,
                "peak_bytes": b.peak,
                "peak_phase": b.peak_phase,
                "fits": b.fits,
                "headroom": None if b.headroom is None else round(b.headroom, 4),
                "items": [asdict(item) for item in b.items],
            }

        return {
            "recipe": self.recipe,
            "model": self.model,
            "accelerator": self.accelerator,
            "strategy": self.strategy,
            "strategy_reason": self.strategy_reason,
            "train_ranks": self.train_ranks,
            "gpus": [budget(b) for b in self.gpus],
            "hosts": [budget(b) for b in self.hosts],
            "checkpoint_bytes": self.checkpoint_bytes,
            "checkpoints_on_disk_bytes": self.checkpoints_on_disk,
            "export_bytes": self.export_bytes,
            "export_merged_bytes": self.export_merged_bytes,
            "lora": self.lora,
            "staging_bytes_per_node": self.staging_bytes,
            "episode_turns": self.episode_turns,
            "episode_tokens": self.episode_tokens,
            **(
                {"generation": {**asdict(self.generation), "samples": self.generation.samples}}
                if self.generation is not None
                else {}
            ),
            **({"sizes": self.sizes.to_json()} if self.sizes is not None else {}),
            "fits": self.fits,
            "problems": self.problems,
            "warnings": self.warnings,
        }


def plan_recipe(
    recipe: Recipe,
    env: Mapping[str, str] | None = None,
    *,
    advise: bool = True,
    alternatives_of: int | None = None,
) -> MemoryPlan:
    """The memory plan of a recipe with a trainer section (PlanError if it has none, or its
    model or accelerator is unknown). advise: say which single changes make a budget that
    does not fit fit (by planning each changed recipe). alternatives_of: how many
    alternatives the recipe is one of (for what its `auto` sizes' problems say)."""
    trainer = recipe.trainer
    if trainer is None:
        raise PlanError(f"recipe {recipe.name!r} has no trainer section; nothing to plan")
    alternatives = recipe.alternatives()
    if len(alternatives) > 1:  # the preferred one; plan_alternatives plans them all
        recipe = alternatives[0][1]
    sizes = None
    if auto_fields(recipe):  # chosen for the preferred alternative, as its job would
        several = alternatives_of or len(alternatives)
        recipe, sizes = size_recipe(recipe, env, alternatives=several)
        trainer = recipe.trainer
        assert trainer is not None
    shape = find_shape(trainer.model.path, env)
    critic_shape = None
    if trainer.algorithm == "ppo":
        critic_shape = find_shape((trainer.critic_model or trainer.model).path, env)
    resources = recipe.resources
    gpu = resources.gpus_per_node > 0
    capacity, rollout_capacity = _gpu_capacities(resources, env)
    layout = layout_of(recipe)
    strategy = (choice := choose_strategy(recipe, env)).strategy
    plan = MemoryPlan(
        recipe=recipe.name,
        model=f"{trainer.model.path}: {shape.describe()}",
        accelerator=_accelerator_line(resources),
        strategy=strategy,
        strategy_reason=choice.reason,
        strategy_choice=choice,
        train_ranks=layout.train_ranks,
        gpus=[],
        hosts=[],
        checkpoint_bytes=0,
        checkpoints_on_disk=0,
        export_bytes=0,
        episode_turns=None if trainer.environment is None else trainer.environment.max_turns,
        episode_tokens=episode_token_budget(trainer),
        generation=generation_of(trainer, gpu),
    )
    if sizes is not None:
        plan.sizes = sizes
        plan.problems += sizes.problems
    training = training_budget(trainer, shape, critic_shape, layout, strategy, gpu, capacity)
    if gpu:
        plan.gpus.append(training)
        if trainer.layout == "split" and layout.engines:
            plan.gpus.append(rollout_budget(trainer, shape, layout, rollout_capacity or 0))
    plan.hosts = host_budgets(recipe, shape, critic_shape, layout, strategy, training, gpu)
    _add_disk_figures(plan, recipe, shape, critic_shape, layout, strategy, gpu)
    _verdict(plan, recipe, env, advise)
    return plan


def _gpu_capacities(
    resources: Resources, env: Mapping[str, str] | None
) -> tuple[int | None, int | None]:
    """(a training GPU's memory, a rollout GPU's), None for unknown or none."""
    gpu = resources.gpus_per_node > 0
    capacity = gpu_capacity(resources.train_nodes, env) if gpu else None
    rollout_nodes = resources.rollout_nodes
    # resources.groups: the engines run on the rollout group's GPUs, of their own size
    rollout_capacity = capacity if rollout_nodes is None else gpu_capacity(rollout_nodes, env)
    return capacity, rollout_capacity


def _accelerator_line(resources: Resources) -> str | None:
    """The accelerators the plan is for: both groups' with resources.groups."""
    rollout_nodes = resources.rollout_nodes
    if rollout_nodes is None:
        return resources.accelerators
    return (
        f"train {resources.train_nodes.nodes} x {resources.train_nodes.accelerators or 'CPU'}"
        f", rollout {rollout_nodes.nodes} x {rollout_nodes.accelerators or 'CPU'}"
    )


def _add_disk_figures(
    plan: MemoryPlan,
    recipe: Recipe,
    shape: ModelShape,
    critic_shape: ModelShape | None,
    layout: Layout,
    strategy: str,
    gpu: bool,
) -> None:
    """The checkpoints' and the export's sizes, the LoRA summaries, and where checkpoints go
    to a store the shards each node stages before the upload (a problem where they do not
    fit its disk)."""
    trainer = recipe.trainer
    assert trainer is not None
    compute, master, _ = dtypes(trainer, gpu, strategy)
    models = trained_models(trainer, shape, critic_shape)
    plan.checkpoint_bytes = checkpoint_size(models, master)
    # keep complete checkpoints plus the one being written before the oldest is pruned
    plan.checkpoints_on_disk = plan.checkpoint_bytes * (trainer.checkpoint.keep + 1)
    plan.export_bytes = shape.params * mem.DTYPE_BYTES[compute]
    plan.lora = {m.label: _lora_summary(trainer, m, gpu) for m in models if m.lora is not None}
    if trainer.model.lora is not None:  # the adapter alone, in PEFT's format; or merged
        plan.export_merged_bytes = plan.export_bytes
        plan.export_bytes = lora_sizes.adapter_bytes(shape, trainer.model.lora)
    if trainer.checkpoint.dir is None:
        plan.checkpoints_on_disk = 0
    elif is_store_url(trainer.checkpoint.dir):
        # Each node stages its ranks' shards (rank 0's node: the small parts and hf/ too)
        # before uploading them; the store keeps the retained copies, not the node.
        plan.checkpoints_in_store = True
        most_ranks = max((ranks for ranks, _, _ in layout.node_kinds), default=1)
        share = plan.checkpoint_bytes // max(layout.train_ranks, 1)
        plan.staging_bytes = most_ranks * share
        disk = recipe.resources.train_nodes.disk_size  # only training nodes stage shards
        if disk is not None and plan.staging_bytes > int(disk) * GIB:
            plan.problems.append(
                f"checkpoint staging: {gib(plan.staging_bytes)} GiB of shards per node before "
                f"the upload, more than resources.disk_size {disk} GB; raise disk_size"
            )


@dataclass
class AlternativePlan:
    """One accelerator alternative of a recipe: its plan, or why it has none (an accelerator
    the plan's table lacks)."""

    label: str
    plan: MemoryPlan | None
    error: str | None = None

    @property
    def fits(self) -> bool:
        return self.plan is not None and self.plan.fits

    def why(self) -> str:
        """One phrase: what the GPU holds at its peak, or what does not fit and its largest
        items."""
        if self.plan is None:
            return "not in the plan's table"
        plan = self.plan
        over = [b for b in [*plan.gpus, *plan.hosts] if not b.fits]
        if plan.sizes is not None and plan.sizes.problems and not over:
            return plan.sizes.problems[0].split(": ")[0] + ": no size fits"
        budgets = over or plan.gpus or plan.hosts
        if not budgets:
            return "no memory limits given"
        if not over and not plan.fits:  # a KV cache with no room for one sequence
            return plan.problems[0].split(" (")[0]
        tightest = min(budgets, key=lambda b: b.headroom if b.headroom is not None else 1.0)
        where = tightest.title.split(" (")[0]
        return f"{where} at {tightest.peak_phase}: {_largest(tightest, 2)}"

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "fits": self.fits,
            "error": self.error,
            "plan": None if self.plan is None else self.plan.to_json(),
        }


def plan_alternatives(
    recipe: Recipe, env: Mapping[str, str] | None = None, *, advise: bool = True
) -> list[AlternativePlan]:
    """A plan for every accelerator alternative of the recipe, the preferred first (one
    entry for a recipe that names one). An alternative whose accelerator the table lacks
    has its error instead; a recipe without a trainer or with an unknown model raises
    PlanError as plan_recipe does."""
    out = []
    alternatives = recipe.alternatives()
    for label, alternative in alternatives:
        try:
            plan = plan_recipe(alternative, env, advise=advise, alternatives_of=len(alternatives))
            out.append(AlternativePlan(label, plan))
        except UnknownAccelerator as exc:
            out.append(AlternativePlan(label, None, str(exc)))
    return out


def size_recipe(
    recipe: Recipe,
    env: Mapping[str, str] | None = None,
    *,
    host_bytes: int | None = None,
    alternatives: int | None = None,
) -> tuple[Recipe, Sizes]:
    """The recipe with its `auto` sizes chosen from the plan of its preferred accelerator
    alternative, and the sizes (rlx.plan.sizing.choose_sizes has the rule): what `rlx plan`,
    lint and the trainer at start-up each call."""

    def plan(sized: Recipe, plan_env: Mapping[str, str] | None) -> MemoryPlan:
        return plan_recipe(sized, plan_env, advise=False)

    return choose_sizes(recipe, env, plan, host_bytes=host_bytes, alternatives=alternatives)


def _lora_summary(trainer: TrainerSettings, model: TrainedModel, gpu: bool) -> dict[str, Any]:
    """What a model's LoRA amounts to: the layers adapted, the trained parameters and, for
    the policy, the reference it keeps and how a vLLM engine serves it."""
    lora = model.lora
    assert lora is not None
    out: dict[str, Any] = {
        "rank": lora.rank,
        "alpha": lora.scale_alpha,
        "layers": list(lora_sizes.adapted_layers(model.shape, lora.target_modules)),
        "decoder_layers": model.shape.layers,
        "adapter_params": model.adapters,
        "adapter_bytes": model.adapters * mem.DTYPE_BYTES[lora_sizes.ADAPTER_DTYPE],
        "trained_params": model.trained,
    }
    if model.label == "policy":
        out["reference"] = "the base (adapters off)" if trainer.algo.kl.coef > 0 else "none"
        if engine_of(trainer, gpu) == "vllm":
            out["max_lora_rank"] = lora_sizes.vllm_lora_rank(lora.rank)
            out["max_loras"] = lora_sizes.vllm_max_loras(trainer.rollout)
    return out


# --------------------------------------------------------------------------- verdict


def _verdict(plan: MemoryPlan, recipe: Recipe, env: Mapping[str, str] | None, advise: bool) -> None:
    for budget in [*plan.gpus, *plan.hosts]:
        if budget.capacity is None:
            continue
        where = budget.title.split(" (")[0]
        if not budget.fits:
            plan.problems.append(
                f"{where}: needs {gib(budget.peak)} GiB of {gib(budget.capacity)} GiB "
                f"({_largest(budget)})" + (f"; {_advice(recipe, budget, env)}" if advise else "")
            )
        elif budget.headroom is not None and budget.headroom < HEADROOM:
            plan.warnings.append(
                f"{where}: needs {gib(budget.peak)} GiB of {gib(budget.capacity)} GiB, only "
                f"{budget.headroom:.0%} spare (keep {HEADROOM:.0%}): {_largest(budget)}"
            )
    for budget in plan.gpus:
        if budget.engine_sequences == 0:
            where = budget.title.split(" (")[0]
            plan.problems.append(
                f"{where}: vLLM's share (gpu_memory_utilization) leaves no room for the KV "
                f"cache of one {_sequence(recipe)}-token sequence ({_engine_items(budget)}); "
                + (
                    "raise rollout.gpu_memory_utilization or tensor_parallel_size (layout: "
                    f"split), or shorten {_longest_setting(recipe)}"
                )
            )


def _sequence(recipe: Recipe) -> int:
    trainer = recipe.trainer
    assert trainer is not None
    return sequence_tokens(trainer)


def _longest_setting(recipe: Recipe) -> str:
    """The setting that bounds a sequence after its prompt."""
    trainer = recipe.trainer
    assert trainer is not None
    if trainer.environment is None:
        return "max_new_tokens"
    return "environment.max_tokens" + (
        " (unset: max_turns x 2 x max_new_tokens)" if trainer.environment.max_tokens is None else ""
    )


def _engine_items(budget: Budget) -> str:
    engine = (i for i in budget.items if "vLLM" in i.name and i.phase != "update")
    return ", ".join(f"{i.name} {gib(i.bytes)}" for i in engine)


def _largest(budget: Budget, top: int = 4) -> str:
    counted = sorted((i for i in budget.items if budget.in_peak(i)), key=lambda i: -i.bytes)
    return ", ".join(f"{i.name} {gib(i.bytes)}" for i in counted[:top])


Change = tuple[str, dict[str, Any]]  # (what the advice says, the recipe's change)


def _advice(recipe: Recipe, budget: Budget, env: Mapping[str, str] | None) -> str:
    """The single changes that make this budget fit, tried one by one on the recipe."""
    trainer = recipe.trainer
    assert trainer is not None
    if budget.title.startswith("host"):
        need = -(-budget.peak // 10**9)
        return f"ask for resources.memory: '{need}+' (GB per node), or fewer ranks per node"
    if budget.title.startswith("training"):
        tries = _training_changes(recipe, trainer)
    else:
        tries = _engine_changes(recipe, trainer)
    working: list[str] = []
    kind = budget.title.split(" (")[0]
    for label, change in tries:
        # the fewest nodes that fit is enough
        if label.startswith("resources.nodes") and any(w.startswith("resources.") for w in working):
            continue
        try:
            replan = plan_recipe(_changed(recipe, change), env, advise=False)
        except (RlxError, ValueError):  # a change the recipe cannot take
            continue
        match = [b for b in replan.gpus + replan.hosts if b.title.split(" (")[0] == kind]
        if match and all(b.fits for b in match):
            working.append(label)
        if len(working) == 3:
            break
    if not working:
        return "no single change fits it: use more GPUs with more memory or a smaller model"
    return "to fit, change one of: " + "; ".join(working)


def _training_changes(recipe: Recipe, trainer: TrainerSettings) -> list[Change]:
    """The changes that may fit a training budget, in the order they are tried: a sharding
    strategy, more nodes, offloads, checkpointing, smaller micro-batches, and colocated a
    smaller share for the engines or a split."""
    tries: list[Change] = []
    parallel = trainer.parallel
    if parallel.strategy == "ddp":
        tries.append(("parallel.strategy: fsdp", {"parallel": {"strategy": "fsdp"}}))
    for nodes in (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64):
        if nodes > recipe.resources.nodes and _splits_evenly(recipe, nodes):
            tries.append((f"resources.nodes: {nodes}", {"resources": {"nodes": nodes}}))
    if not parallel.offload_optimizer:
        tries.append(
            (
                "parallel.offload_optimizer: true",
                {"parallel": {"offload_optimizer": True}},
            )
        )
    has_reference = trainer.algo.kl.coef > 0 and trainer.model.lora is None
    if not parallel.offload_reference and has_reference:
        tries.append(
            (
                "parallel.offload_reference: true",
                {"parallel": {"offload_reference": True}},
            )
        )
    if not trainer.model.gradient_checkpointing:
        tries.append(
            ("model.gradient_checkpointing: true", {"model": {"gradient_checkpointing": True}})
        )
    mbs = trainer.batch.micro_batch_size
    while mbs > 1:
        mbs //= 2
        tries.append((f"batch.micro_batch_size: {mbs}", {"batch": {"micro_batch_size": mbs}}))
    if trainer.layout == "colocated" and recipe.resources.gpus_per_node > 0:
        util = trainer.rollout.gpu_memory_utilization
        for lower in (0.4, 0.3, 0.2):
            if lower < util:
                tries.append(
                    (
                        f"rollout.gpu_memory_utilization: {lower}",
                        {"rollout": {"gpu_memory_utilization": lower}},
                    )
                )
        half = recipe.resources.total_gpus // 2
        if half:
            tries.append(
                (
                    f"layout: split with rollout_gpus: {half}",
                    {"layout": "split", "rollout_gpus": half},
                )
            )
    return tries


def _engine_changes(recipe: Recipe, trainer: TrainerSettings) -> list[Change]:
    """The changes that may fit a split engine's budget: a wider tensor-parallel engine,
    a larger share of its GPU."""
    tries: list[Change] = []
    tp = trainer.rollout.tensor_parallel_size
    for bigger in (2, 4, 8):
        if bigger > tp and recipe.resources.engine_gpus_per_node % bigger == 0:
            tries.append(
                (
                    f"rollout.tensor_parallel_size: {bigger}",
                    {"rollout": {"tensor_parallel_size": bigger}},
                )
            )
    tries.append(
        ("rollout.gpu_memory_utilization: 0.9", {"rollout": {"gpu_memory_utilization": 0.9}})
    )
    return tries


def _splits_evenly(recipe: Recipe, nodes: int) -> bool:
    """Whether a step and a minibatch still split evenly over the ranks `nodes` give."""
    trainer = recipe.trainer
    assert trainer is not None
    gpus = recipe.resources.gpus_per_node
    ranks = nodes * gpus - (trainer.rollout_gpus if trainer.layout == "split" else 0)
    ranks = ranks if gpus else nodes
    samples = trainer.batch.prompts_per_step * trainer.rollout.n
    minibatch = trainer.batch.minibatch_size or samples
    return ranks > 0 and samples % ranks == 0 and minibatch % ranks == 0


def _changed(recipe: Recipe, change: dict[str, Any]) -> Recipe:
    data = recipe.model_dump()
    resources = change.pop("resources", None) if "resources" in change else None
    if resources:
        data["resources"].update(resources)
    for key, value in change.items():
        if isinstance(value, dict):
            data["trainer"][key].update(value)
        else:
            data["trainer"][key] = value
    return Recipe.model_validate(data)
