"""Lint checks that concern SkyPilot (run when the recipe has a sky section)."""

from __future__ import annotations

from collections.abc import Iterator

from rlx.launchers.sky.render import places
from rlx.lint.core import ERROR, WARNING, Check, Problem
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
    if sky.infra and recipe.resources.infra is not None:
        yield Problem(
            ("sky", "infra"),
            ERROR,
            "resources.infra says where to run for every backend; drop sky.infra (or move it "
            "into resources.infra)",
        )
        return
    where = places(recipe)
    infra_field = ("resources", "infra") if recipe.resources.infra is not None else ("sky", "infra")
    named = [(i, v) for i, v in enumerate(recipe.volumes) if v.name]
    elsewhere = [p for p in where if not p.lower().startswith(VOLUME_INFRAS)]
    if named and (elsewhere or not where):
        on = f"infra: {elsewhere[0]}" if elsewhere else "no infra (any cloud)"
        for i, volume in named:
            yield Problem(
                ("volumes", i, "name"),
                ERROR,
                f"SkyPilot has volumes only on Kubernetes and RunPod, and this recipe runs on "
                f"{on}, so {volume.name} cannot be attached; {BUCKET_LINE}",
            )
    if named and sky.recovery and sky.recovery.strategy == "EAGER_NEXT_REGION":
        yield Problem(
            ("sky", "recovery", "strategy"),
            ERROR,
            "EAGER_NEXT_REGION recovers in another region, where a region-bound volume "
            f"({named[0][1].name}) is not; use strategy: FAILOVER, or {BUCKET_LINE}",
        )
    fabric = recipe.resources.fabric
    for place in where:
        cloud = place.lower().split("/")[0]
        if fabric in FABRIC_INFRAS and cloud not in FABRIC_INFRAS[fabric]:
            yield Problem(
                infra_field,
                ERROR,
                f"SkyPilot's network_tier: best gives {fabric} only on "
                f"{' or '.join(FABRIC_INFRAS[fabric][:2])}, and this recipe runs on {place}; "
                f"set infra: {FABRIC_INFRAS[fabric][0]}, or name the fabric these nodes have "
                "(resources.fabric)",
            )
            break
    if recipe.resources.max_duration is not None:
        yield Problem(
            ("resources", "max_duration"),
            WARNING,
            "SkyPilot has no run time limit: on SkyPilot the job runs until it ends or `rlx "
            "down` (dstack and Slurm keep max_duration)",
        )
    no_spot = [p for p in where if p.lower().startswith(("k8s", "kubernetes", "ssh"))]
    if recipe.resources.spot is True and no_spot:
        yield Problem(
            ("resources", "spot"),
            ERROR,
            f"{no_spot[0]} has no spot instances; set spot: auto (spot where there is) or "
            "false, or pick a cloud",
        )


CHECKS: list[Check] = [check_sky]
