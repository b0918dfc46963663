"""dstack: a task YAML that dstack's `parse_run_configuration` accepts; with resources.groups,
one node group per recipe group (train first: dstack ranks the nodes of its groups in order,
so the master node, rank 0, is the first training node), each with its own resources."""

from __future__ import annotations

from typing import Any

from rlx.errors import RlxError
from rlx.launchers.common import (
    drop_empty,
    dump_yaml,
    header_lines,
    node_command,
    refuse,
    secret_names,
    setup_script,
)
from rlx.launchers.dstack import BACKEND
from rlx.launchers.dstack.names import BACKEND_NAMES, gpu_name
from rlx.launchers.offers import describe
from rlx.node.env import RECIPE_ENV, recipe_json
from rlx.recipe import Recipe
from rlx.recipe.model import NodeGroup, Resources, is_bucket


def escape(value: str) -> str:
    """dstack's server interpolates `${{ ... }}` in env values and reads `$$` as `$`;
    doubling every `$` makes any value arrive on the node exactly as written."""
    return value.replace("$", "$$")


def _amount(value: str | None, unit: str) -> str | None:
    if value is None:
        return None
    return value[:-1] + unit + ".." if value.endswith("+") else value + unit


def gpu_spec(shape: Resources | NodeGroup) -> str | dict[str, Any] | None:
    """dstack's `gpu` for a kind of node: its shorthand for one type dstack spells as the
    recipe does (H100:8), else {name: [..], memory, count}. dstack holds one count and one
    memory range for all its names: the memory is the least any alternative names (lint
    says when that lets in a GPU the recipe does not list), and counts that differ are
    refused (check_gpu_counts)."""
    options = shape.accelerator_options
    if not options:
        return None
    named = [gpu_name(option.type) for option in options]
    if len(options) == 1 and named[0][1] is None:
        return str(options[0])
    names = list(dict.fromkeys(name for name, _ in named))
    sizes = {gib for _, gib in named}
    memory = None
    if sizes != {None}:
        least = min(gib for gib in sizes if gib is not None)
        memory = f"{least}GB" if len(sizes) == 1 else f"{least}GB.."
    return drop_empty({"name": names, "memory": memory, "count": options[0].count})


def placement(recipe: Recipe) -> dict[str, list[str]]:
    """backends, regions and availability_zones from resources.infra (cloud/region/zone),
    else dstack.backends and dstack.regions (lint refuses both)."""
    settings = recipe.dstack
    places = [place.split("/") for place in recipe.resources.infra_list]
    if not places:
        return {
            "backends": list(settings.backends) if settings else [],
            "regions": list(settings.regions) if settings else [],
        }

    def column(i: int) -> list[str]:
        return list(dict.fromkeys(p[i] for p in places if len(p) > i))

    return {
        "backends": [BACKEND_NAMES.get(cloud, cloud) for cloud in column(0)],
        "regions": column(1),
        "availability_zones": column(2),
    }


def spot_policy(recipe: Recipe) -> str | None:
    spot = recipe.resources.spot
    return "auto" if spot == "auto" else "spot" if spot else None


def max_price(recipe: Recipe) -> float | None:
    """resources.max_hourly_cost, else dstack.max_price (lint refuses both): per instance and
    hour, and a node is one instance."""
    if recipe.resources.max_hourly_cost is not None:
        return recipe.resources.max_hourly_cost
    return recipe.dstack.max_price if recipe.dstack else None


def _resources(res: Resources | NodeGroup) -> dict[str, Any]:
    return drop_empty(
        {
            "gpu": gpu_spec(res),
            "cpu": _amount(res.cpus, ""),
            "memory": _amount(res.memory, "GB"),
            "disk": f"{res.disk_size}GB" if res.disk_size else None,
        }
    )


def run_config(recipe: Recipe) -> dict[str, Any]:
    """The dstack task as a plain dict (what the YAML says)."""
    # here, not at the top: the checks module loads lint, whose storage checks import it
    from rlx.launchers.dstack.checks import RENDER_CHECKS

    refuse(recipe, RENDER_CHECKS)
    settings = recipe.dstack
    env, files = _env(recipe), _files(recipe)
    commands = [setup_script(recipe) + node_command(BACKEND.name)]
    groups = [
        # Each group its own resources (dstack's groups inherit none from the top level).
        {
            "name": name,
            "nodes": group.nodes,
            "resources": _resources(group),
            "commands": [*commands],
        }
        for name, group in recipe.resources.node_groups()
    ]
    retry = None
    if settings and settings.retry:
        retry = {"on_events": list(settings.retry.on_events), "duration": settings.retry.duration}
    return drop_empty(
        {
            "type": "task",
            "name": recipe.name,
            "nodes": None if groups else recipe.resources.nodes,
            "groups": groups,
            "image": recipe.resources.image,
            "shell": "bash",
            "env": env,
            "files": files,
            "volumes": [
                drop_empty({"name": v.name, "path": v.path}) for v in recipe.volumes if v.name
            ],
            # Workers block in `rlx node` until the head is done, so dstack keeps them up.
            "commands": None if groups else commands,
            "resources": None if groups else _resources(recipe.resources),
            "spot_policy": spot_policy(recipe),
            "fleets": list(settings.fleets) if settings else [],
            **placement(recipe),
            "max_price": max_price(recipe),
            "max_duration": settings.max_duration if settings else None,
            "retry": retry,
            "stop_criteria": "master-done",
        }
    )


def _env(recipe: Recipe) -> list[str]:
    """The task's env list: the recipe's env and the recipe itself, one line each, then the
    secrets' names."""
    plain = {**recipe.env, RECIPE_ENV: recipe_json(recipe)}
    for key, value in plain.items():
        if "\n" in value or "\r" in value:
            raise RlxError(
                f"env.{key}: dstack cannot pass a value with a line break (its env "
                "list takes one line per variable); put it in a file instead"
            )
    # Secrets by name only: dstack takes the value from the environment of `dstack apply`
    # (or from a dstack secret of that name).
    return [*(f"{k}={escape(v)}" for k, v in plain.items()), *secret_names(recipe)]


def _files(recipe: Recipe) -> list[dict[str, str]]:
    """The working directory and the file mounts that are not buckets."""
    files = []
    if recipe.workdir:
        files.append({"local_path": recipe.workdir, "path": "."})
    files += [
        {"local_path": src, "path": dst}
        for dst, src in recipe.file_mounts.items()
        if not is_bucket(src)
    ]
    return files


def render(recipe: Recipe, source: str) -> str:
    exports = "export " + " ".join(f"{n}=..." for n in secret_names(recipe))
    how = [
        f"Run with: rlx launch {source} --backend dstack",
        "(or by hand: "
        + (f"{exports}; " if secret_names(recipe) else "")
        + "dstack apply -f THIS_FILE)",
    ]
    return "\n".join(header_lines(recipe, source, how)) + "\n" + dump_yaml(run_config(recipe))


def alternatives(recipe: Recipe) -> list[str]:
    """What `rlx launch --dry-run` says about the alternatives dstack is given."""
    places = recipe.resources.infra_list
    return describe(
        recipe,
        "dstack",
        places,
        keeps_order=False,
        note="(dstack keeps no order among GPU names or places; spot_policy: auto takes spot first)"
        if recipe.resources.spot == "auto" or len(recipe.resources.accelerator_options) > 1
        else None,
    )
