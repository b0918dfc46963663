"""SkyPilot: a task YAML that `sky.Task.from_yaml_config` accepts; with resources.groups, a
job group (a multi-document YAML, `execution: parallel`) that SkyPilot's
`load_job_group_from_yaml` accepts: one job per group, each on its own cluster, the
training job primary (the rollout job ends with it)."""

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
from rlx.node.env import NODE_GROUP_ENV, RECIPE_ENV, recipe_json
from rlx.recipe import Recipe
from rlx.recipe.model import NodeGroup, is_bucket


def _resources(recipe: Recipe, group: NodeGroup | None = None) -> dict[str, Any]:
    res, sky = recipe.resources, recipe.sky
    shape = group or res
    out: dict[str, Any] = {
        "infra": sky.infra if sky else None,
        "accelerators": shape.accelerators,
        "cpus": shape.cpus,
        "memory": shape.memory,
        "disk_size": shape.disk_size,
        "disk_tier": sky.disk_tier if sky else None,
        # EFA on AWS, InfiniBand on Nebius and on Kubernetes clusters that have it
        "network_tier": "best" if res.fast_fabric else None,
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


def task_config(recipe: Recipe, group: str | None = None) -> dict[str, Any]:
    """The SkyPilot task as a plain dict (what the YAML says); group: the job of a job group
    that runs the nodes of resources.groups' group of that name."""
    envs = {**recipe.env, RECIPE_ENV: recipe_json(recipe)}
    shape = None
    if group is not None:
        envs[NODE_GROUP_ENV] = group
        shape = recipe.resources.group(group)
    return drop_empty(
        {
            # a job group's jobs are named by group: its nodes' hostnames are <job>-<i>.<group>
            "name": group or recipe.name,
            "num_nodes": recipe.resources.nodes if shape is None else shape.nodes,
            "resources": _resources(recipe, shape),
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


def job_group_configs(recipe: Recipe) -> list[dict[str, Any]]:
    """The header and one job per group, as SkyPilot's job-group loader reads them."""
    header = {
        "name": recipe.name,
        "execution": "parallel",
        # The training job's head runs the trainer; when it ends, the rollout job is ended.
        "primary_tasks": ["train"],
    }
    return [header, *(task_config(recipe, name) for name, _ in recipe.resources.node_groups())]


def render(recipe: Recipe, source: str) -> str:
    if recipe.resources.groups is not None:
        how = [
            f"Run with: rlx launch {source} --backend sky",
            "(a job group runs as a managed job; by hand: sky jobs launch THIS_FILE"
            + (
                " --secret RLX_RAY_TOKEN=$(openssl rand -hex 32)"
                if recipe.ray.auth == "token"
                else ""
            )
            + "".join(f" --secret {name}" for name in recipe.secrets)
            + ")",
        ]
        documents = [dump_yaml(config) for config in job_group_configs(recipe)]
        return "\n".join(header_lines(recipe, source, how)) + "\n---\n" + "---\n".join(documents)
    how = [
        f"Run with: rlx launch {source} --backend sky",
        "(or by hand: sky launch -c NAME THIS_FILE"
        + (" --secret RLX_RAY_TOKEN=$(openssl rand -hex 32)" if recipe.ray.auth == "token" else "")
        + "".join(f" --secret {name}" for name in recipe.secrets)
        + ")",
    ]
    return "\n".join(header_lines(recipe, source, how)) + "\n" + dump_yaml(task_config(recipe))
