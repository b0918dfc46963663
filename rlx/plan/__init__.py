"""The memory plan: per-GPU and per-node memory of a recipe, computed from the model's shape
(no torch needed), and the verdict lint enforces."""

from rlx.plan.budget import HEADROOM, Budget, Item
from rlx.plan.memory import ACCELERATOR_GIB, accelerator_gib, training_state_bytes
from rlx.plan.planner import MemoryPlan, plan_recipe
from rlx.plan.shapes import ModelShape, PlanError, find_shape

__all__ = [
    "ACCELERATOR_GIB",
    "HEADROOM",
    "Budget",
    "Item",
    "MemoryPlan",
    "ModelShape",
    "PlanError",
    "accelerator_gib",
    "find_shape",
    "plan_recipe",
    "training_state_bytes",
]
