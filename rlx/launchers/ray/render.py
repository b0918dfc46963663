"""The Ray Jobs submission request of a recipe, as JSON (what `rlx launch -b ray` sends).

The request is what `JobSubmissionClient.submit_job` takes: the entrypoint (the head
command, run by bash, quoted with shlex.join), and a runtime_env with the recipe's env, the
recipe itself and, when the recipe names a workdir, that folder as the job's working dir.
Secrets appear by name only; `rlx launch` fills in their values from your environment.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from rlx.errors import RlxError
from rlx.launchers.common import header_lines
from rlx.launchers.ray import BACKEND
from rlx.node.env import RECIPE_ENV, recipe_json
from rlx.recipe import Recipe

SECRET_PLACEHOLDER = "<from your environment at launch>"


def entrypoint(recipe: Recipe) -> str:
    """The head command as one shell line: bash runs the recipe's commands, stopping at the
    first failure, exactly as the head node would run them."""
    script = "set -e\n" + "\n".join(recipe.head_command) + "\n"
    return shlex.join(["bash", "-c", script])


def submission(recipe: Recipe) -> dict[str, Any]:
    """submit_job's keyword arguments, secrets by name only (no values)."""
    env_vars = {**recipe.env, RECIPE_ENV: recipe_json(recipe)}
    env_vars.update(dict.fromkeys(recipe.secrets, SECRET_PLACEHOLDER))
    runtime_env: dict[str, Any] = {"env_vars": env_vars}
    if recipe.workdir:
        runtime_env["working_dir"] = recipe.workdir
    return {
        "entrypoint": entrypoint(recipe),
        "runtime_env": runtime_env,
        "metadata": {"rlx_recipe": recipe.name},
    }


NO_IDLE_LIMIT = (
    "resources.idle_minutes: a -b ray job runs on a cluster that is not its own, which its "
    "idle limit cannot end; set it in the recipe launched with --keep, and drop it here"
)


def render(recipe: Recipe, source: str) -> str:
    # An idle limit asked for by name here would be taken for the cluster's: refused.
    if "idle_minutes" in recipe.resources.model_fields_set:
        raise RlxError(NO_IDLE_LIMIT)
    how = [
        f"Run with: rlx launch {source} --backend ray --address http://HOST:8265",
        "(the cluster's dashboard through a tunnel; RAY_AUTH_TOKEN holds its token)",
        BACKEND.stays_up[:1].upper() + BACKEND.stays_up[1:] + ".",
    ]
    header = {"_comment": header_lines(recipe, source, how)}
    return json.dumps({**header, **submission(recipe)}, indent=2) + "\n"
