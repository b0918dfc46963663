"""Checks of where a run's state lives: checkpoints, the checkpoint to resume from, models
and data every node reads, volumes and file mounts."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from rlx.launchers import specs
from rlx.launchers.dstack import per_node
from rlx.lint.core import ERROR, WARNING, Check, Problem
from rlx.recipe import Recipe
from rlx.recipe.model import is_bucket
from rlx.recipe.specs import HUB_DATA_PREFIX
from rlx.storage import is_store_url, missing_extra, store_of, url_problem


def _retries_on(recipe: Recipe) -> str | None:
    """Which setting restarts the job on failure, if any (the backends declare theirs)."""
    return next((found for b in specs() if (found := b.restarts(recipe))), None)


def _shared_roots(recipe: Recipe, *, writable: bool) -> list[str]:
    """Paths every node sees with the same content. File mounts of local files are copies,
    fine to read but not to write; bucket mounts and volumes are shared both ways."""
    roots = [
        v.path
        for v in recipe.volumes
        if not (writable and v.read_only) and not per_node(v.name)  # one disk per node
    ]
    for target, source in recipe.file_mounts.items():
        if is_bucket(source) or not writable:
            roots.append(target.rstrip("/") or "/")
    return roots


def _under(path: str, roots: Iterable[str]) -> bool:
    path = path.rstrip("/")
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def check_checkpoint_storage(recipe: Recipe) -> Iterator[Problem]:
    trainer = recipe.trainer
    if trainer is None:
        return
    ckpt = trainer.checkpoint
    retries = _retries_on(recipe)
    if ckpt.dir is None:
        if retries:
            yield Problem(
                ("trainer", "checkpoint", "dir"),
                ERROR,
                f"{retries} restarts the job, but without checkpoint.dir it starts "
                "over from step 0; set checkpoint.dir to a bucket (s3://BUCKET/checkpoints) "
                "or a shared disk",
            )
        if "resume" in ckpt.model_fields_set and ckpt.resume == "auto":
            yield Problem(
                ("trainer", "checkpoint", "resume"),
                ERROR,
                "resume: auto needs checkpoint.dir to look in; set it",
            )
        return
    if url_problem(ckpt.dir) is not None:
        return  # a mistyped URL (check_store_urls), not a folder on a node's disk
    if is_store_url(ckpt.dir) or _under(ckpt.dir, _shared_roots(recipe, writable=True)):
        return
    reasons = []
    writers = recipe.resources.train_nodes.nodes  # only training nodes hold shards
    if writers > 1:
        reasons.append(f"{writers} nodes write shards there")
    if retries:
        reasons.append(f"{retries} may restart the job on another machine")
    if reasons:
        yield Problem(
            ("trainer", "checkpoint", "dir"),
            ERROR,
            f"{ckpt.dir} is on node-local disk but {' and '.join(reasons)}; put it in "
            "a bucket (s3://BUCKET/checkpoints, gs://, az://) or on a filesystem every node "
            "shares (Slurm, SkyPilot on Kubernetes)",
        )


def check_resume_path(recipe: Recipe) -> Iterator[Problem]:
    trainer = recipe.trainer
    if trainer is None or trainer.checkpoint.resume in ("auto", "never"):
        return
    if is_store_url(trainer.checkpoint.resume) or url_problem(trainer.checkpoint.resume):
        return  # a store, or a mistyped URL that check_store_urls names
    readable = _shared_roots(recipe, writable=False)
    readers = recipe.resources.train_nodes.nodes
    if readers > 1 and not _under(trainer.checkpoint.resume, readable):
        yield Problem(
            ("trainer", "checkpoint", "resume"),
            ERROR,
            "every training node loads the checkpoint to resume from, but this path is not on "
            "shared storage; put it under a volume or a file mount",
        )


def check_shared_model_and_data(recipe: Recipe) -> Iterator[Problem]:
    trainer = recipe.trainer
    if trainer is None or recipe.resources.total_nodes == 1:
        return
    readable = _shared_roots(recipe, writable=False)
    models = [("model", trainer.model.path)]
    if trainer.critic_model:
        models.append(("critic_model", trainer.critic_model.path))
    for field, path in models:
        if path.startswith(("/", "~")) and not _under(path, readable):  # a URL: each fetches
            yield Problem(
                ("trainer", field, "path"),
                ERROR,
                f"{path} is read on every node but is not on shared storage; put it "
                "under a volume, a file mount, or the workdir (relative path)",
            )
    data = trainer.data.train
    if data.startswith(("/", "~")) and not _under(data, readable):
        yield Problem(
            ("trainer", "data", "train"),
            WARNING,
            f"{data} is read on the head only, which a restarted job may not land "
            "on; keep data on a volume or in the workdir",
        )


def check_volumes_for_backends(recipe: Recipe) -> Iterator[Problem]:
    # Backends that attach volumes by name, when the recipe has their section.
    cloud_backends = [
        b.name
        for b in specs()
        if b.volumes_by_name and getattr(recipe, b.section or "") is not None
    ]
    for i, volume in enumerate(recipe.volumes):
        if volume.name is None and cloud_backends:
            yield Problem(
                ("volumes", i, "path"),
                ERROR,
                f"{volume.path} has no volume name, so "
                f"{' and '.join(cloud_backends)} cannot attach it; add 'name:'",
            )
    for target in recipe.file_mounts:
        if not target.startswith(("/", "~")):
            yield Problem(
                ("file_mounts", target),
                ERROR,
                f"mount point {target!r} must be absolute (or start with ~)",
            )


# The fields that hold a place: a local path, a hub id (models), or a store URL (the prompt
# file: a local path or a URL, an hf:// dataset being rlx.lint.sources's).
def _path_fields(recipe: Recipe) -> list[tuple[tuple, str]]:
    trainer = recipe.trainer
    if trainer is None:
        return []
    fields: list[tuple[tuple, str]] = [
        (("trainer", "logging", "dir"), trainer.logging.dir),
        (("trainer", "model", "path"), trainer.model.path),
    ]
    if not trainer.data.train.startswith(HUB_DATA_PREFIX):  # a hub dataset: lint.sources
        fields.append((("trainer", "data", "train"), trainer.data.train))
    if trainer.checkpoint.dir:
        fields.append((("trainer", "checkpoint", "dir"), trainer.checkpoint.dir))
    if trainer.checkpoint.resume not in ("auto", "never"):
        fields.append((("trainer", "checkpoint", "resume"), trainer.checkpoint.resume))
    if trainer.critic_model:
        fields.append((("trainer", "critic_model", "path"), trainer.critic_model.path))
    return fields


def _installs(recipe: Recipe, extra: str, package: str) -> bool:
    """Whether the recipe's setup installs a store's library: rlx[...extra...] or the
    package by name."""
    text = "\n".join(recipe.setup)
    extras = re.findall(r"rlx\[([^\]]*)\]", text)
    if any(extra in [e.strip() for e in group.split(",")] for group in extras):
        return True
    return re.search(rf"(^|[\s\"'=])({re.escape(package)})([\s\"'<>=~!;,]|$)", text) is not None


def check_store_urls(recipe: Recipe) -> Iterator[Problem]:
    """A URL in a path field names a store rlx writes to, and the nodes will have its
    library; anything else written as a URL is an error, never a local folder."""
    for where, value in _path_fields(recipe):
        problem = url_problem(value)
        if problem is not None:
            yield Problem(where, ERROR, f"{value} {problem}")
            continue
        store = store_of(value)
        if store is None:
            continue
        if where[-1] == "train":
            yield Problem(
                where,
                ERROR,
                "the prompt file is read on the head, not from a store; keep it in the "
                "workdir, or copy it down in setup: (e.g. aws s3 cp)",
            )
            continue
        if recipe.setup:
            if not _installs(recipe, store.extra, store.package):
                yield Problem(
                    where,
                    ERROR,
                    f"{value} needs {store.package} on every node, and setup: does not "
                    f'install it; write pip install "rlx[train,{store.extra}]" there',
                )
        elif (missing := missing_extra(value)) is not None:
            yield Problem(where, ERROR, f"{value}: {missing}")


CHECKS: list[Check] = [
    check_store_urls,
    check_checkpoint_storage,
    check_resume_path,
    check_shared_model_and_data,
    check_volumes_for_backends,
]
