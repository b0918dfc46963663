"""Every place a run writes, tried before the model loads: a missing bucket, a denied write,
a wrong endpoint, a read-only or full folder is one line in seconds, not a traceback at the
first save an hour of GPUs later.

The head tries them before anything starts (probe_locations from `rlx train`); every other
node of the cluster tries the ones it writes itself (each rank uploads its own shard, each
node stages on its own disk) in a task on that node before the actors start
(rlx.trainer.actors.probes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rlx.errors import RlxError
from rlx.recipe.model import Recipe
from rlx.storage import is_store_url, probe_writable, space_problem
from rlx.trainer.checkpoint.remote import STAGING_ENV, staging_root


@dataclass(frozen=True)
class Location:
    """One place a run writes: its folder or URL, the field that names it, and the free
    space a local folder needs (0: not checked)."""

    where: str
    field: str
    needs: int = 0


def locations(recipe: Recipe, sizes: tuple[int, int]) -> list[Location]:
    """Where the recipe's run writes: checkpoint.dir, logging.dir (the run folder and the
    export in it) and, when either is in a store, this node's staging folder; local
    checkpoint and staging folders with the room two checkpoints take. sizes: (a
    checkpoint's bytes, the most one node stages of it) as rlx plan counts them, 0 where the
    plan cannot say (rlx.trainer.startup.StartPlan.checkpoint_sizes)."""
    settings = recipe.trainer
    assert settings is not None
    size, staged = sizes
    found = []
    ckpt = settings.checkpoint.dir
    if ckpt is not None:
        local = not is_store_url(ckpt)
        found.append(Location(ckpt, "trainer.checkpoint.dir", 2 * size if local else 0))
    found.append(Location(settings.logging.dir, "trainer.logging.dir"))
    stores = [place for place in (ckpt, settings.logging.dir) if place and is_store_url(place)]
    if stores:
        needs = 2 * staged if ckpt is not None and is_store_url(ckpt) else 0
        found.append(Location(str(staging_root()), f"{STAGING_ENV} (staging)", needs))
    return found


def probe(places: Sequence[Location]) -> None:
    """Write and delete a small file in every place, and check local ones have room; the
    first problem as one RlxError."""
    for place in places:
        probe_writable(place.where, place.field)
        if place.needs and not is_store_url(place.where):
            problem = space_problem(Path(place.where).expanduser(), place.needs, place.field)
            if problem is not None:
                raise RlxError(problem)


def probe_locations(recipe: Recipe, sizes: tuple[int, int]) -> list[Location]:
    """The head's probe, before anything starts; returns the places for probe_nodes."""
    places = locations(recipe, sizes)
    probe(places)
    return places


def probe_on_node(places: Sequence[Location], ip: str) -> None:
    """probe, on a node other than the head: its own staging folder, errors naming it."""
    here = str(staging_root())  # this node's own staging folder (its RLX_STAGING_DIR)
    mine = [
        Location(here, place.field, place.needs) if place.field.startswith(STAGING_ENV) else place
        for place in places
    ]
    try:
        probe(mine)
    except RlxError as exc:
        raise RlxError(f"on node {ip}: {exc}") from None
