"""Checks of LoRA (`trainer.model.lora`, `trainer.critic_model.lora`): target modules the
model has, a rank the rollout engine can serve, and LoRA settings that do nothing."""

from __future__ import annotations

from collections.abc import Iterator

from rlx.lint.core import ERROR, WARNING, Check, Problem
from rlx.recipe import Recipe
from rlx.recipe.model import ModelSettings
from rlx.trainer.rollout import choose_engine


def _adapted(recipe: Recipe) -> list[tuple[str, ModelSettings]]:
    """(field, model settings) of each model the trainer builds with LoRA: the policy and,
    for PPO, a critic_model of its own (without one the critic is the policy's model, whose
    lora is checked as the policy's)."""
    trainer = recipe.trainer
    if trainer is None:
        return []
    models = [("model", trainer.model)]
    if trainer.algorithm == "ppo" and trainer.critic_model is not None:
        models.append(("critic_model", trainer.critic_model))
    return [(field, model) for field, model in models if model.lora is not None]


def check_lora_target_modules(recipe: Recipe) -> Iterator[Problem]:
    """Every name in target_modules is a linear layer of the model's decoder layers (the
    architecture from the plan's model shapes); an architecture the plan does not know is a
    warning (peft still refuses a name the model lacks, at start-up)."""
    from rlx.plan import PlanError, find_shape
    from rlx.plan.lora import DECODER_LINEARS, layer_names, unknown_targets

    for field, model in _adapted(recipe):
        assert model.lora is not None
        targets = model.lora.target_modules
        if isinstance(targets, str):  # all-linear: whatever the model's linear layers are
            continue
        where = ("trainer", field, "lora", "target_modules")
        try:
            shape = find_shape(model.path)
        except PlanError:  # no shape, no names: the memory check says why
            continue
        names = layer_names(shape)
        arch = shape.model_type or "unnamed"
        if names is None:
            yield Problem(
                where,
                WARNING,
                f"not checked: {model.path} is a {arch!r} model, whose layer names rlx "
                f"does not know (it knows {', '.join(DECODER_LINEARS)}); write all-linear, "
                "or check the names against the model's modules",
            )
            continue
        valid = ", ".join(names)
        if not targets:
            yield Problem(where, ERROR, f"names no layer; write all-linear or names from {valid}")
            continue
        for bad in unknown_targets(shape, targets):
            yield Problem(
                (*where, targets.index(bad)),
                ERROR,
                f"{model.path} ({arch}) has no linear layer {bad!r} in its decoder layers; "
                f"write names from {valid} (or all-linear)",
            )


def check_lora_rank_servable(recipe: Recipe) -> Iterator[Problem]:
    """vLLM serves adapters up to its largest max_lora_rank: a rank above it cannot be
    pushed to the engines."""
    from rlx.plan.lora import VLLM_LORA_RANKS, vllm_lora_rank

    trainer = recipe.trainer
    if trainer is None or trainer.model.lora is None:
        return
    engine = choose_engine(trainer.rollout.engine, recipe.resources.engine_gpus_per_node)
    rank = trainer.model.lora.rank
    if engine == "vllm" and vllm_lora_rank(rank) is None:
        largest = VLLM_LORA_RANKS[-1]
        yield Problem(
            ("trainer", "model", "lora", "rank"),
            ERROR,
            f"rank {rank} is more than vLLM serves (its largest max_lora_rank is {largest}); "
            f"write rank: {largest} or less, or rollout.engine: hf",
        )


def check_critic_lora_unused(recipe: Recipe) -> Iterator[Problem]:
    """critic_model.lora without a critic (grpo, rloo) trains nothing."""
    trainer = recipe.trainer
    if trainer is None or trainer.algorithm == "ppo" or trainer.critic_model is None:
        return
    if trainer.critic_model.lora is not None:
        yield Problem(
            ("trainer", "critic_model", "lora"),
            WARNING,
            f"{trainer.algorithm} has no critic, so critic_model and its lora are ignored; "
            "remove them (the policy's adapters are trainer.model.lora)",
        )


def check_lora_offload_reference(recipe: Recipe) -> Iterator[Problem]:
    """With LoRA the reference is the policy's base (the adapters off): no copy to offload."""
    trainer = recipe.trainer
    if trainer is None or trainer.model.lora is None or not trainer.parallel.offload_reference:
        return
    yield Problem(
        ("trainer", "parallel", "offload_reference"),
        WARNING,
        "with trainer.model.lora the reference is the policy's own base with the adapters "
        "off, so there is no reference copy to offload; remove offload_reference",
    )


CHECKS: list[Check] = [
    check_lora_target_modules,
    check_lora_rank_servable,
    check_critic_lora_unused,
    check_lora_offload_reference,
]
