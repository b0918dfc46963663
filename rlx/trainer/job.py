"""The recipe as the trainer takes it, narrowed once at `rlx train`'s entry.

TrainJob.of runs the start-up checks lint runs (rlx.lint.STARTUP_CHECKS) and then holds what
every part of the trainer asks of the recipe: its trainer section (present), the actors it
places (rlx.plan.actors) and the rollout engine it runs (rlx.trainer.rollout.choose_engine),
each decided here once.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlx.errors import RlxError
from rlx.lint import refuse_at_startup
from rlx.plan.actors import ActorPlan, plan_actors
from rlx.recipe.model import Recipe, Resources, TrainerSettings
from rlx.trainer.rollout import choose_engine

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

    @classmethod
    def of(cls, recipe: Recipe, *, stand_in_gpus: bool = False) -> TrainJob:
        """The job of a recipe the start-up checks pass; RlxError (field: what to change)
        for one they refuse. stand_in_gpus: the recipe's GPUs are placed but not computed
        on (a dress rehearsal)."""
        settings = recipe.trainer
        if settings is None:  # fine for lint when a command runs instead; not for rlx train
            raise RlxError(
                f"recipe {recipe.name!r} has no 'trainer:' section, so there is nothing for "
                "`rlx train` to run; add one (see recipes/quickstart.yaml)"
            )
        refuse_at_startup(recipe)
        engine = choose_engine(settings.rollout.engine, recipe.resources.engine_gpus_per_node)
        on_gpus = recipe.resources.total_gpus > 0 and not stand_in_gpus
        return cls(recipe, settings, plan_actors(recipe), engine, on_gpus)

    @property
    def name(self) -> str:
        return self.recipe.name

    @property
    def resources(self) -> Resources:
        return self.recipe.resources
