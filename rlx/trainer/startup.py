"""The start-up plan: the memory plan (rlx.plan) of the recipe as the job runs it, narrowed to
the accelerator alternative it got and its `auto` sizes chosen (rlx.trainer.device), made
once on the head and carried by the job (TrainJob.plan). Start-up reads from it what it
needs: the checkpoint sizes the probes check room for, the training ranks' strategy, a
training GPU's planned peak for the run's summary.

A plan that cannot be made (a model whose config reaches this node only with the model,
an accelerator the plan's table lacks) is tried again when next asked: by then the model
may be in this node's cache.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from rlx.errors import RlxError
from rlx.recipe.model import Recipe

if TYPE_CHECKING:
    from rlx.plan.planner import MemoryPlan
    from rlx.plan.strategy import StrategyChoice

# What makes a plan impossible here; the checkpoint sizes are 0 for any of them, the GPU
# peak unknown for the first (the others are errors of the run there).
_NO_PLAN = (RlxError, OSError, ValueError)  # PlanError is an RlxError


class StartPlan:
    """The plan of `recipe` (sized, one alternative) with `env` (the sizing's env merged in)."""

    def __init__(self, recipe: Recipe, env: Mapping[str, str] | None = None) -> None:
        self.recipe = recipe
        self.env = None if env is None else dict(env)
        self._plan: MemoryPlan | None = None
        self._failure: Exception | None = None

    def __getstate__(self) -> dict[str, object]:
        # The job travels to the actors, which never plan: the environment stays here.
        return {**self.__dict__, "env": None, "_failure": None}

    def memory(self) -> MemoryPlan | None:
        """The plan, made once (None where it cannot be made yet, see the module)."""
        from rlx.plan.planner import plan_recipe

        if self._plan is None:
            try:
                self._plan = plan_recipe(self.recipe, self.env, advise=False)
                self._failure = None
            except _NO_PLAN as exc:
                self._failure = exc
        return self._plan

    def checkpoint_sizes(self) -> tuple[int, int]:
        """(a checkpoint's bytes, the most one node stages of it) as rlx plan counts them; 0
        where the plan cannot say."""
        plan = self.memory()
        if plan is None:
            return 0, 0
        return plan.checkpoint_bytes, plan.staging_bytes or plan.checkpoint_bytes

    def strategy(self) -> StrategyChoice:
        """How the training ranks share the models (rlx.plan.strategy.choose_strategy): the
        plan's choice, or asked alone where there is no plan."""
        from rlx.plan.strategy import choose_strategy

        plan = self.memory()
        if plan is not None and plan.strategy_choice is not None:
            return plan.strategy_choice
        return choose_strategy(self.recipe, self.env)

    def gpu_peak_gib(self) -> float | None:
        """What the plan gives one training GPU at its peak (None where it cannot say)."""
        plan = self.memory()
        if plan is None:
            if self._failure is not None and not isinstance(self._failure, RlxError):
                raise self._failure
            return None
        return plan.gpus[0].peak / 2**30 if plan.gpus else None
