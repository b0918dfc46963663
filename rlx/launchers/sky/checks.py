"""Lint checks that concern SkyPilot (run when the recipe has a sky section)."""

from __future__ import annotations

from collections.abc import Iterator

from rlx.lint.core import ERROR, Check, Problem
from rlx.recipe import Recipe

# Where SkyPilot has volumes (sky/utils/volume.py: k8s-pvc, k8s-hostpath,
# runpod-network-volume); on every other cloud a named volume cannot be created or attached.
VOLUME_INFRAS = ("k8s", "kubernetes", "runpod")
BUCKET_LINE = (
    "keep shared state in a bucket instead: trainer.checkpoint.dir: s3://BUCKET/checkpoints "
    "and trainer.logging.dir: s3://BUCKET/runs (gs:// on GCP), and drop the volume"
)


def check_sky(recipe: Recipe) -> Iterator[Problem]:
    sky = recipe.sky
    if sky is None:
        return
    infra = (sky.infra or "").lower()
    named = [(i, v) for i, v in enumerate(recipe.volumes) if v.name]
    if named and not infra.startswith(VOLUME_INFRAS):
        where = f"infra: {sky.infra}" if sky.infra else "no sky.infra (any cloud)"
        for i, volume in named:
            yield Problem(
                ("volumes", i, "name"),
                ERROR,
                f"SkyPilot has volumes only on Kubernetes and RunPod, and this recipe runs on "
                f"{where}, so {volume.name} cannot be attached; {BUCKET_LINE}",
            )
    if named and sky.recovery and sky.recovery.strategy == "EAGER_NEXT_REGION":
        yield Problem(
            ("sky", "recovery", "strategy"),
            ERROR,
            "EAGER_NEXT_REGION recovers in another region, where a region-bound volume "
            f"({named[0][1].name}) is not; use strategy: FAILOVER, or {BUCKET_LINE}",
        )
    if recipe.resources.spot and infra.startswith(("k8s", "kubernetes", "ssh")):
        yield Problem(
            ("resources", "spot"),
            ERROR,
            f"{sky.infra} has no spot instances; set spot: false or pick a cloud",
        )


CHECKS: list[Check] = [check_sky]
