"""SkyPilot: a task YAML that `sky.Task.from_yaml_config` accepts; with resources.groups, a
job group (a multi-document YAML, `execution: parallel`) that SkyPilot's
`load_job_group_from_yaml` accepts: one job per group, each on its own cluster, the
training job primary (the rollout job ends with it)."""

from __future__ import annotations

from typing import Any

from rlx.errors import TRY_AGAIN
from rlx.launchers.common import (
    ENDED_IDLE_MINUTES,
    drop_empty,
    dump_yaml,
    header_lines,
    node_command,
    secret_names,
    setup_script,
)
from rlx.launchers.keep import kept_until
from rlx.launchers.offers import describe, offers, spot_levels
from rlx.launchers.sky import BACKEND
from rlx.node.env import NODE_GROUP_ENV, RECIPE_ENV, recipe_json
from rlx.recipe import Recipe
from rlx.recipe.model import Accelerator, NodeGroup, Resources, duration_seconds, is_bucket

# Torn down when its job ends, also when a session holds an ssh connection (a forgotten
# `ssh -L` tunnel must not keep the cluster billed). A managed job's controller sets its own.
AUTOSTOP = {"idle_minutes": ENDED_IDLE_MINUTES, "down": True, "wait_for": "jobs"}
KUBERNETES = ("kubernetes", "k8s")


def places(recipe: Recipe) -> list[str]:
    """Where SkyPilot may run: resources.infra, else the older sky.infra (lint refuses both)."""
    return recipe.places


def _accelerator_set(options: tuple[Accelerator, ...]) -> dict[str, int | None]:
    """SkyPilot's set of accelerators: {H100: 8, A100-80GB: 8}, or {'H100:4': None, ...}
    when a type comes with two counts (a mapping holds each type once)."""
    if len({o.type for o in options}) == len(options):
        return {o.type: o.count for o in options}
    return dict.fromkeys(str(o) for o in options)


def _alternatives(recipe: Recipe, shape: Resources | NodeGroup) -> dict[str, Any]:
    """The fields that vary between the alternatives: one offer as plain fields; only the
    accelerators varying as SkyPilot's list (a preference) or set; else `ordered:` (spot auto,
    or a preference list) or `any_of:` entries, one per offer. SkyPilot keeps no set inside
    an order, so a set under spot auto is tried in the order written."""
    res = recipe.resources
    where = places(recipe)
    choices, ordered = offers(res, shape, where)
    options = shape.accelerator_options
    if len(choices) <= 1:
        first = choices[0]
        return {
            "infra": first.place,
            "accelerators": str(first.accelerator) if first.accelerator else None,
            "use_spot": first.spot or None,
        }
    if len(spot_levels(res)) == 1 and len(where) <= 1:
        return {
            "infra": where[0] if where else None,
            "accelerators": [str(o) for o in options]
            if shape.accelerators_ordered
            else _accelerator_set(options),
            "use_spot": choices[0].spot or None,
        }
    entries = [
        drop_empty(
            {
                "infra": offer.place,
                "accelerators": str(offer.accelerator) if offer.accelerator else None,
                "use_spot": offer.spot,
            }
        )
        for offer in choices
    ]
    return {"ordered" if ordered else "any_of": entries}


def _resources(recipe: Recipe, group: NodeGroup | None = None) -> dict[str, Any]:
    res, sky = recipe.resources, recipe.sky
    shape = group or res
    varying = _alternatives(recipe, shape)
    out: dict[str, Any] = {
        "infra": varying.pop("infra", None),
        "accelerators": varying.pop("accelerators", None),
        "cpus": shape.cpus,
        "memory": shape.memory,
        "disk_size": shape.disk_size,
        "disk_tier": sky.disk_tier if sky else None,
        # EFA on AWS, InfiniBand on Nebius and on Kubernetes clusters that have it
        "network_tier": "best" if res.fast_fabric else None,
        "image_id": f"docker:{res.image}" if res.image else None,
        "ports": [str(p) for p in res.ports],
        "use_spot": varying.pop("use_spot", None),
        # per node and hour, as the recipe's (SkyPilot prices a whole node's offer)
        "max_hourly_cost": res.max_hourly_cost,
        **varying,
        "autostop": dict(AUTOSTOP),
        "job_recovery": job_recovery(recipe),
    }
    return drop_empty(out)


def job_recovery(recipe: Recipe) -> dict[str, Any]:
    """A managed job's recovery: the recipe's strategy and restarts, and rlx's exit code for
    "stopped and saved, run me again" (a preemption warning, a lost node) as a recovery that
    does not count against max_restarts_on_errors."""
    recovery = recipe.sky.recovery if recipe.sky else None
    out: dict[str, Any] = {}
    if recovery is not None:
        out["strategy"] = recovery.strategy
        out["max_restarts_on_errors"] = recovery.max_restarts_on_errors
    out["recover_on_exit_codes"] = [TRY_AGAIN]
    return out


def task_settings(recipe: Recipe) -> dict[str, Any]:
    """SkyPilot settings the task overrides: Kubernetes' provision_timeout from
    resources.start_deadline, where the job may run on Kubernetes (any place, or one named)."""
    deadline = recipe.resources.start_deadline
    clouds = {place.split("/")[0].lower() for place in places(recipe)}
    if deadline is None or (clouds and not clouds & set(KUBERNETES)):
        return {}
    return {"kubernetes": {"provision_timeout": duration_seconds(deadline)}}


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
            "config": task_settings(recipe),
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
        how.append(
            "SkyPilot's jobs controller tears every job's cluster down when the job group ends."
        )
        documents = [dump_yaml(config) for config in job_group_configs(recipe)]
        return "\n".join(header_lines(recipe, source, how)) + "\n---\n" + "---\n".join(documents)
    how = [
        f"Run with: rlx launch {source} --backend sky",
        "(or by hand: sky launch -c NAME THIS_FILE"
        + (" --secret RLX_RAY_TOKEN=$(openssl rand -hex 32)" if recipe.ray.auth == "token" else "")
        + "".join(f" --secret {name}" for name in recipe.secrets)
        + ")",
        f"When the job ends SkyPilot tears the cluster down (autostop: down, within "
        f"{ENDED_IDLE_MINUTES} minute); a cluster kept with rlx launch --keep stays "
        f"{kept_until(recipe)}.",
    ]
    return "\n".join(header_lines(recipe, source, how)) + "\n" + dump_yaml(task_config(recipe))


def alternatives(recipe: Recipe) -> list[str]:
    """What `rlx launch --dry-run` says about the alternatives SkyPilot is given."""
    return describe(recipe, "SkyPilot", places(recipe))
