"""The recipe as the trainer takes it, narrowed once at `rlx train`'s entry.

TrainJob.of runs the start-up checks lint runs (rlx.lint.STARTUP_CHECKS) and then holds what
every part of the trainer asks of the recipe: its trainer section (present), the actors it
places (rlx.plan.actors), the rollout engine it runs (rlx.trainer.rollout.choose_engine), the
dtype that engine runs in and whether rollouts run ahead of the update, each decided here once,
and the start-up plan of the recipe (rlx.trainer.startup), made once and read from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from rlx.errors import RlxError
from rlx.lint import refuse_at_startup
from rlx.plan.actors import ActorPlan, plan_actors
from rlx.recipe.model import Recipe, Resources, TrainerSettings
from rlx.trainer.rollout import (
    choose_engine,
    compute_dtype_name,
    engine_dtype_name,
    samples_with_own_kernels,
)
from rlx.trainer.startup import StartPlan

# Set by a dress rehearsal (rlx rehearse): the GPUs Ray's nodes declare are stand-ins, so the
# job is placed exactly as on GPUs and computes on CPU.
STAND_IN_GPUS_ENV = "RLX_STAND_IN_GPUS"


@dataclass(frozen=True)
class TrainJob:
    recipe: Recipe
    settings: TrainerSettings  # the recipe's trainer section
    actors: ActorPlan
    engine: str  # "hf" | "vllm"
    on_gpus: bool  # the actors compute on GPUs (the recipe names them, and they are real)
    engine_dtype: str  # the engines' weights: "float32" | "bfloat16" | "float16"
    # Rollouts run ahead of the update (rollout.max_staleness > 0): a step trains on samples
    # up to max_staleness versions old, and a push queues behind the engines' rollouts.
    ahead: bool
    # The memory plan of the recipe as it runs, made once at start-up (rlx.trainer.startup).
    plan: StartPlan = field(repr=False, compare=False)

    @classmethod
    def of(
        cls,
        recipe: Recipe,
        *,
        stand_in_gpus: bool = False,
        plan: StartPlan | None = None,
        env: Mapping[str, str] | None = None,
    ) -> TrainJob:
        """The job of a recipe the start-up checks pass; RlxError (field: what to change)
        for one they refuse. stand_in_gpus: the recipe's GPUs are placed but not computed
        on (a dress rehearsal). plan: the start-up plan already begun for this recipe (a new
        one with `env` otherwise)."""
        settings = recipe.trainer
        if settings is None:  # fine for lint when a command runs instead; not for rlx train
            raise RlxError(
                f"recipe {recipe.name!r} has no 'trainer:' section, so there is nothing for "
                "`rlx train` to run; add one (see recipes/quickstart.yaml)"
            )
        refuse_at_startup(recipe)
        engine = choose_engine(settings.rollout.engine, recipe.resources.engine_gpus_per_node)
        on_gpus = recipe.resources.total_gpus > 0 and not stand_in_gpus
        settings = with_correction_decided(settings, engine, on_gpus)
        return cls(
            recipe,
            settings,
            plan_actors(recipe),
            engine,
            on_gpus,
            engine_dtype=engine_dtype_name(settings, on_gpus),
            ahead=runs_ahead(settings),
            plan=plan if plan is not None else StartPlan(recipe, env),
        )

    @property
    def name(self) -> str:
        return self.recipe.name

    @property
    def resources(self) -> Resources:
        return self.recipe.resources


def runs_ahead(settings: TrainerSettings) -> bool:
    """Whether rollouts run ahead of the update: max_staleness > 0."""
    return settings.rollout.max_staleness > 0


def correction_needed(settings: TrainerSettings, engine: str, on_gpus: bool) -> bool:
    """Whether the engines and the learner can disagree on a sampled token's log-prob: an
    engine with kernels of its own (vLLM), an engine or learner dtype other than float32, or
    samples up to max_staleness versions old. Where none holds (the HF engine in float32 on
    CPU) they agree to float32 rounding, and rollout_correction's auto stays off."""
    learner = compute_dtype_name(settings.model.dtype, on_gpus)
    return (
        samples_with_own_kernels(engine)
        or learner != "float32"
        or engine_dtype_name(settings, on_gpus) != "float32"
        or runs_ahead(settings)
    )


def with_correction_decided(
    settings: TrainerSettings, engine: str, on_gpus: bool
) -> TrainerSettings:
    """The settings with algo.rollout_correction.on decided (auto -> true or false), once,
    so every actor reads a bool."""
    correction = settings.algo.rollout_correction
    if correction.on != "auto":
        return settings
    decided = correction.model_copy(update={"on": correction_needed(settings, engine, on_gpus)})
    algo = settings.algo.model_copy(update={"rollout_correction": decided})
    return settings.model_copy(update={"algo": algo})
