"""dstack: a task YAML that dstack's `parse_run_configuration` accepts; with resources.groups,
one node group per recipe group (train first: dstack ranks the nodes of its groups in order,
so the master node, rank 0, is the first training node), each with its own resources.

A recipe that names no fleet (dstack.fleets) gets one of its own, rendered before the task in
the same file (two YAML documents, each what `dstack apply -f` reads): named after the job,
`placement: cluster`, up to the job's nodes and none kept (`nodes: 0..N`: dstack terminates
only the instances above the least), so its instances go `idle_duration` after the run ends."""

from __future__ import annotations

from typing import Any

import yaml

from rlx.errors import RlxError
from rlx.launchers.common import (
    ENDED_IDLE_MINUTES,
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
from rlx.launchers.keep import kept_until
from rlx.launchers.offers import describe
from rlx.node.env import RECIPE_ENV, recipe_json
from rlx.recipe import Recipe
from rlx.recipe.model import NodeGroup, Resources, is_bucket

# How long the job's instances stay once idle (its run ended), in dstack's words.
IDLE_DURATION = f"{ENDED_IDLE_MINUTES}m"
# The events a start deadline retries on: no offer could be had.
NO_CAPACITY = "no-capacity"


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
            "fleets": fleets(recipe),
            **placement(recipe),
            "max_price": max_price(recipe),
            "max_duration": max_duration(recipe),
            "retry": retry(recipe),
            # instances this run provisions, in any fleet, go once the run has ended
            "idle_duration": IDLE_DURATION,
            "stop_criteria": "master-done",
        }
    )


def named_fleets(recipe: Recipe) -> list[str]:
    """The fleets the recipe names to run in (dstack.fleets)."""
    return list(recipe.dstack.fleets) if recipe.dstack else []


def own_fleet(recipe: Recipe) -> bool:
    """The job brings its own fleet: the recipe names none to run in."""
    return not named_fleets(recipe)


def fleets(recipe: Recipe) -> list[str]:
    return named_fleets(recipe) or [recipe.name]


def fleet_config(recipe: Recipe) -> dict[str, Any]:
    """The fleet a job that names none runs in, as a plain dict: its instances are made for
    the run (none before, at most the job's nodes) and terminated once idle for
    IDLE_DURATION. The run's own resources, spot policy, places and price cap choose them."""
    return drop_empty(
        {
            "type": "fleet",
            "name": recipe.name,
            "nodes": f"0..{recipe.resources.total_nodes}",
            "placement": "cluster",
            "spot_policy": spot_policy(recipe),
            **placement(recipe),
            "max_price": max_price(recipe),
            "idle_duration": IDLE_DURATION,
        }
    )


def max_duration(recipe: Recipe) -> str | None:
    """resources.max_duration, else dstack.max_duration (lint refuses both)."""
    if recipe.resources.max_duration is not None:
        return recipe.resources.max_duration
    return recipe.dstack.max_duration if recipe.dstack else None


def retry(recipe: Recipe) -> dict[str, Any] | None:
    """dstack.retry; resources.start_deadline is how long it retries for want of an offer
    (dstack holds one duration for all its events)."""
    settings = recipe.dstack.retry if recipe.dstack else None
    deadline = recipe.resources.start_deadline
    if settings is None:
        return None if deadline is None else {"on_events": [NO_CAPACITY], "duration": deadline}
    duration = settings.duration if deadline is None else deadline
    return {"on_events": list(settings.on_events), "duration": duration}


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
    task = run_config(recipe)
    exported = f"{exports}; " if secret_names(recipe) else ""
    by_hand = f"{exported}dstack apply -f THIS_FILE"
    if own_fleet(recipe):
        by_hand = (
            "save the fleet (the first document) and the task (the second) as two files; "
            f"dstack apply -f FLEET_FILE; {exported}dstack apply -f TASK_FILE"
        )
    how = [
        f"Run with: rlx launch {source} --backend dstack",
        f"(or by hand: {by_hand})",
        f"When the run ends dstack terminates the instances it made for it once idle for "
        f"{IDLE_DURATION} (idle_duration); a cluster kept with rlx launch --keep stays "
        f"{kept_until(recipe)}.",
    ]
    documents = [dump_yaml(task)]
    if own_fleet(recipe):
        documents.insert(0, dump_yaml(fleet_config(recipe)))
    return "\n".join(header_lines(recipe, source, how)) + "\n" + "---\n".join(documents)


def task_text(rendered: str) -> dict[str, Any]:
    """The task of a rendered dstack file (its last document)."""
    *_, task = yaml.safe_load_all(rendered)
    return task


def fleet_text(rendered: str) -> dict[str, Any] | None:
    """The fleet a rendered dstack file brings (its first of two documents), or None."""
    documents = list(yaml.safe_load_all(rendered))
    return documents[0] if len(documents) > 1 else None


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
