"""The network joining the nodes: FSDP's collectives across nodes need a fast fabric."""

from __future__ import annotations

from collections.abc import Iterator

from rlx.errors import RlxError
from rlx.lint.alternatives import sized
from rlx.lint.core import WARNING, Check, Problem
from rlx.recipe import Recipe


def check_fabric_for_fsdp(recipe: Recipe) -> Iterator[Problem]:
    """FSDP whose ranks span GPU nodes with no fabric named: every micro-batch's all-gathers
    and reduce-scatters cross the nodes' network, over TCP unless NCCL is told otherwise."""
    from rlx.plan.budget import HEADROOM, layout_of
    from rlx.plan.strategy import choose_strategy

    resources = recipe.resources
    if recipe.trainer is None or recipe.command is not None or resources.fabric is not None:
        return
    if resources.gpus_per_node == 0:  # CPU ranks: gloo over the nodes' network anyway
        return
    try:
        nodes = layout_of(recipe).train_nodes
        choice = choose_strategy(sized(recipe))  # the sizes the job runs with, not `auto`
    except RlxError:  # an impossible layout (check_layout says so) or an unknown model
        return
    if choice.strategy != "fsdp" or nodes <= 1:
        return
    # why auto chose FSDP, only where DDP was planned (an unknown GPU or model has no plan)
    auto = recipe.trainer.parallel.strategy == "auto" and choice.ddp_short_of_headroom
    yield Problem(
        ("resources",),
        WARNING,
        f"FSDP's training ranks span {nodes} nodes and no fabric is named: NCCL would carry "
        "every micro-batch's all-gathers and reduce-scatters over TCP; write fabric: efa (AWS "
        "EFA instances) or fabric: infiniband where the nodes have it, or fabric: tcp to say "
        "they have none"
        + (
            f" (strategy auto chose FSDP as DDP leaves no {HEADROOM:.0%} spare on a GPU: "
            "gradient checkpointing or a smaller micro-batch would let it choose DDP)"
            if auto
            else ""
        ),
    )


CHECKS: list[Check] = [check_fabric_for_fsdp]
