"""What every backend's launcher offers, and what `rlx launch` hands it.

Request first (TorchX style): `render` (pure) builds the native file; `launch` writes it and
submits it, and is a thin step on top. Every backend module provides:

    NAME: str
    SUFFIX: str                                    # file suffix of the rendered file
    render(recipe, source) -> str                  # sky, dstack, slurm
    launch(request: LaunchRequest) -> Job
    status(job: Job) -> JobStatus
    logs(job: Job, *, follow: bool, node: int | None) -> int     # exit code for the CLI
    down(job: Job) -> None
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rlx.errors import RlxError
from rlx.node.env import RAY_TOKEN_SECRET, recipe_json
from rlx.recipe import Recipe


@dataclass(frozen=True)
class LaunchRequest:
    recipe: Recipe
    source: str  # the recipe's path as the user gave it
    name: str  # job name (recipe name unless --name)
    rendered: str  # the native file's text ("" for local)
    secrets: Mapping[str, str]  # secret values, from the environment; never written
    workdir: Path  # where rendered files and logs go (.rlx/ under the current folder)
    managed: bool = False  # SkyPilot managed job
    dry_run: bool = False
    address: str | None = None  # ray: the cluster's dashboard (else RAY_ADDRESS)
    detach: bool = False  # ray: submit and return instead of following the job
    keep: bool = False  # sky, dstack, slurm: form the cluster and hold it, no trainer

    def job(self, backend: str, handle: str, rendered_file: str = "", **extra: str) -> Job:
        """The record of this launch: the backend's handle, the file submitted, and the
        recipe as launched (what attach and tunnel read back later)."""
        return Job(
            self.name,
            backend,
            handle,
            self.source,
            rendered_file,
            extra=dict(extra),
            recipe=recipe_json(self.recipe),
        )


@dataclass
class Job:
    """A launched job, as remembered in .rlx/jobs/<name>.json (no secrets in it)."""

    name: str
    backend: str
    handle: str  # backend's id: cluster/run name, Slurm job id, local pid
    source: str
    rendered_file: str
    launched_at: float = field(default_factory=time.time)
    extra: dict[str, str] = field(default_factory=dict)
    recipe: str = ""  # the recipe as launched, as JSON ("" in records of older rlx versions)
    # When rlx saw it end: `rlx down` took it down, or a launch that followed it returned.
    ended_at: float | None = None

    def launched_recipe(self) -> Recipe | None:
        """The recipe this job was launched with; None where the record does not hold one
        this rlx can read."""
        from pydantic import ValidationError

        if not self.recipe:
            return None
        try:
            return Recipe.model_validate_json(self.recipe)
        except ValidationError:
            return None


UP_STATES = ("PENDING", "RUNNING")


@dataclass(frozen=True)
class JobStatus:
    name: str
    backend: str
    state: str  # PENDING | RUNNING | SUCCEEDED | FAILED | CANCELLED | UNKNOWN
    detail: str = ""
    exit_code: int | None = None
    # Whether what the job runs on is still up (and billed), where the backend knows better
    # than the state: a SkyPilot cluster whose job is done but which is not yet torn down, a
    # Slurm job still queued. None: as the state says (UP_STATES).
    up: bool | None = None
    ended_at: float | None = None  # when it ended, where the backend's record says

    @property
    def is_up(self) -> bool:
        return self.up if self.up is not None else self.state in UP_STATES


def collect_secrets(recipe: Recipe, env: Mapping[str, str]) -> dict[str, str]:
    """Secret values for launch: the recipe's secrets from the user's environment, plus a
    fresh Ray token for this job. Missing ones are an error naming them all."""
    missing = [name for name in recipe.secrets if not env.get(name)]
    if missing:
        raise RlxError(
            f"secret(s) {', '.join(missing)} not set in your environment; export "
            "them before launching (values are never written to any file)"
        )
    values = {name: env[name] for name in recipe.secrets}
    if recipe.ray.auth == "token":
        values[RAY_TOKEN_SECRET] = secrets.token_hex(32)
    return values


# --------------------------------------------------------------------------- job registry


def state_dir(workdir: Path) -> Path:
    return workdir / ".rlx"


def remember(job: Job, workdir: Path) -> Path:
    folder = state_dir(workdir) / "jobs"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{job.name}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(job), indent=2))
    os.replace(tmp, path)
    return path


def recall(name: str, workdir: Path) -> Job:
    path = state_dir(workdir) / "jobs" / f"{name}.json"
    if not path.exists():
        known = ", ".join(j.name for j in recall_all(workdir)) or "none"
        raise RlxError(f"no job named {name!r} was launched from {workdir} (known: {known})")
    return Job(**json.loads(path.read_text()))


def recall_all(workdir: Path) -> list[Job]:
    folder = state_dir(workdir) / "jobs"
    if not folder.is_dir():
        return []
    jobs = [Job(**json.loads(p.read_text())) for p in sorted(folder.glob("*.json"))]
    return sorted(jobs, key=lambda j: j.launched_at)
