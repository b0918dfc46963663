"""SkyPilot: a task YAML that `sky.Task.from_yaml_config` accepts."""

from __future__ import annotations

from typing import Any

from rlx.launchers.common import (
    drop_empty,
    dump_yaml,
    header_lines,
    node_command,
    secret_names,
    setup_script,
)
from rlx.launchers.sky import BACKEND
from rlx.node.env import RECIPE_ENV, recipe_json
from rlx.recipe import Recipe
from rlx.recipe.model import is_bucket


def _resources(recipe: Recipe) -> dict[str, Any]:
    res, sky = recipe.resources, recipe.sky
    out: dict[str, Any] = {
        "infra": sky.infra if sky else None,
        "accelerators": res.accelerators,
        "cpus": res.cpus,
        "memory": res.memory,
        "disk_size": res.disk_size,
        "disk_tier": sky.disk_tier if sky else None,
        "image_id": f"docker:{res.image}" if res.image else None,
        "ports": [str(p) for p in res.ports],
        "use_spot": res.spot or None,
    }
    if sky and sky.recovery:
        out["job_recovery"] = {
            "strategy": sky.recovery.strategy,
            "max_restarts_on_errors": sky.recovery.max_restarts_on_errors,
        }
    return drop_empty(out)


def _file_mounts(recipe: Recipe) -> dict[str, Any]:
    mounts: dict[str, Any] = {}
    for target, source in recipe.file_mounts.items():
        if is_bucket(source):
            # A bucket mounted (not copied) is shared storage: checkpoints can live there.
            mounts[target] = {"source": source, "mode": "MOUNT"}
        else:
            mounts[target] = source
    return mounts


def task_config(recipe: Recipe) -> dict[str, Any]:
    """The SkyPilot task as a plain dict (what the YAML says)."""
    envs = {**recipe.env, RECIPE_ENV: recipe_json(recipe)}
    return drop_empty(
        {
            "name": recipe.name,
            "num_nodes": recipe.resources.nodes,
            "resources": _resources(recipe),
            "workdir": recipe.workdir,
            "file_mounts": _file_mounts(recipe),
            "volumes": {v.path: v.name for v in recipe.volumes if v.name},
            "envs": envs,
            # Names only: values come from `rlx launch` (or `sky launch --secret NAME`).
            "secrets": dict.fromkeys(secret_names(recipe)),
            "setup": setup_script(recipe),
            "run": node_command(BACKEND.name),
        }
    )


def render(recipe: Recipe, source: str) -> str:
    how = [
        f"Run with: rlx launch {source} --backend sky",
        "(or by hand: sky launch -c NAME THIS_FILE"
        + (" --secret RLX_RAY_TOKEN=$(openssl rand -hex 32)" if recipe.ray.auth == "token" else "")
        + "".join(f" --secret {name}" for name in recipe.secrets)
        + ")",
    ]
    return "\n".join(header_lines(recipe, source, how)) + "\n" + dump_yaml(task_config(recipe))
