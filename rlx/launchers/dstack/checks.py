"""Lint checks that concern dstack (run when the recipe has a dstack section)."""

from __future__ import annotations

from collections.abc import Iterator

from rlx.lint.core import ERROR, WARNING, Check, Problem
from rlx.recipe import Recipe
from rlx.recipe.model import is_bucket

# A dstack network volume is one cloud disk (EBS, a persistent disk): one node attaches it.
# Several nodes get one each when its name carries the node's rank.
NODE_RANK = "${{ dstack.node_rank }}"


def per_node(name: str | None) -> bool:
    return name is not None and NODE_RANK.replace(" ", "") in name.replace(" ", "")


def check_dstack(recipe: Recipe) -> Iterator[Problem]:
    dstack = recipe.dstack
    if dstack is None:
        return
    for i, volume in enumerate(recipe.volumes):
        if volume.name and recipe.resources.total_nodes > 1 and not per_node(volume.name):
            yield Problem(
                ("volumes", i, "name"),
                ERROR,
                f"a dstack network volume attaches to one node, and this job has "
                f"{recipe.resources.total_nodes}; for state every node shares use a bucket "
                "(trainer.checkpoint.dir: s3://BUCKET/checkpoints), for node-local data name "
                f"one volume per node: {volume.name}-{NODE_RANK}",
            )
    if len(dstack.regions) > 1 and any(v.name for v in recipe.volumes):
        yield Problem(
            ("dstack", "regions"),
            ERROR,
            "a network volume lives in one region, and this run may start in any of "
            f"{', '.join(dstack.regions)}; keep one region, or keep state in a bucket",
        )
    if recipe.resources.total_nodes > 1 and not dstack.fleets:
        yield Problem(
            ("dstack", "fleets"),
            WARNING,
            "a distributed task needs a fleet with placement: cluster; name it "
            "here so the run does not wait for one that never fits",
        )
    # dstack turns EFA on by itself for the EFA instances of its AWS fleets
    if recipe.resources.fabric == "efa" and dstack.backends and "aws" not in dstack.backends:
        yield Problem(
            ("dstack", "backends"),
            ERROR,
            f"fabric: efa is AWS's, and these backends ({', '.join(dstack.backends)}) leave AWS "
            "out; add aws, or name the fabric these nodes have",
        )
    for name, value in recipe.env.items():
        if "\n" in value or "\r" in value:
            yield Problem(
                ("env", name),
                ERROR,
                "dstack cannot pass a value with a line "
                "break; put it in a file in the workdir instead",
            )
    for target, source in recipe.file_mounts.items():
        if is_bucket(source):
            yield Problem(
                ("file_mounts", target),
                WARNING,
                "dstack copies local files only; this bucket is not mounted there",
            )


CHECKS: list[Check] = [check_dstack]
