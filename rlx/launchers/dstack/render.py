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
    secret_names,
    setup_script,
)
from rlx.launchers.dstack import BACKEND
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


def _resources(res: Resources | NodeGroup) -> dict[str, Any]:
    return drop_empty(
        {
            "gpu": res.accelerators,
            "cpu": _amount(res.cpus, ""),
            "memory": _amount(res.memory, "GB"),
            "disk": f"{res.disk_size}GB" if res.disk_size else None,
        }
    )


def run_config(recipe: Recipe) -> dict[str, Any]:
    """The dstack task as a plain dict (what the YAML says)."""
    settings = recipe.dstack
    plain = {**recipe.env, RECIPE_ENV: recipe_json(recipe)}
    for key, value in plain.items():
        if "\n" in value or "\r" in value:
            raise RlxError(
                f"env.{key}: dstack cannot pass a value with a line break (its env "
                "list takes one line per variable); put it in a file instead"
            )
    # Secrets by name only: dstack takes the value from the environment of `dstack apply`
    # (or from a dstack secret of that name).
    env = [*(f"{k}={escape(v)}" for k, v in plain.items()), *secret_names(recipe)]
    files = []
    if recipe.workdir:
        files.append({"local_path": recipe.workdir, "path": "."})
    files += [
        {"local_path": src, "path": dst}
        for dst, src in recipe.file_mounts.items()
        if not is_bucket(src)
    ]
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
            "spot_policy": "spot" if recipe.resources.spot else None,
            "fleets": list(settings.fleets) if settings else [],
            "backends": list(settings.backends) if settings else [],
            "regions": list(settings.regions) if settings else [],
            "max_price": settings.max_price if settings else None,
            "max_duration": settings.max_duration if settings else None,
            "retry": retry,
            "stop_criteria": "master-done",
        }
    )


def render(recipe: Recipe, source: str) -> str:
    exports = "export " + " ".join(f"{n}=..." for n in secret_names(recipe))
    how = [
        f"Run with: rlx launch {source} --backend dstack",
        "(or by hand: "
        + (f"{exports}; " if secret_names(recipe) else "")
        + "dstack apply -f THIS_FILE)",
    ]
    return "\n".join(header_lines(recipe, source, how)) + "\n" + dump_yaml(run_config(recipe))
