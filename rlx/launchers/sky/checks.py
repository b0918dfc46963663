"""Lint checks that concern SkyPilot (run when the recipe has a sky section)."""

from __future__ import annotations

from collections.abc import Iterator

from rlx.lint.core import ERROR, Check, Problem
from rlx.recipe import Recipe

# Where SkyPilot has volumes (sky/utils/volume.py: k8s-pvc, k8s-hostpath,
# runpod-network-volume); on every other cloud a named volume cannot be created or attached.
VOLUME_INFRAS = ("k8s", "kubernetes", "runpod")
# Where SkyPilot's network_tier: best gives each fabric (sky/clouds: AWS turns EFA on for
# its EFA instance types; Nebius and Kubernetes clusters with InfiniBand give InfiniBand).
FABRIC_INFRAS = {"efa": ("aws", "k8s", "kubernetes"), "infiniband": ("nebius", "k8s", "kubernetes")}
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
    fabric = recipe.resources.fabric
    cloud = infra.split("/")[0]
    if fabric in FABRIC_INFRAS and cloud and cloud not in FABRIC_INFRAS[fabric]:
        where = " or ".join(FABRIC_INFRAS[fabric][:2])
        yield Problem(
            ("sky", "infra"),
            ERROR,
            f"SkyPilot's network_tier: best gives {fabric} only on {where}, and this recipe "
            f"runs on {sky.infra}; set infra: {FABRIC_INFRAS[fabric][0]}, or name the fabric "
            "these nodes have (resources.fabric)",
        )
    if recipe.resources.spot and infra.startswith(("k8s", "kubernetes", "ssh")):
        yield Problem(
            ("resources", "spot"),
            ERROR,
            f"{sky.infra} has no spot instances; set spot: false or pick a cloud",
        )


CHECKS: list[Check] = [check_sky]
