"""The accelerator a job got, read once on the head at start-up, and the recipe sized for it.

A recipe may name several accelerator alternatives and leave sizes to `auto`; the backend
picks one alternative. The head reads its own GPUs (their name and memory, as CUDA reports
them), finds the alternative they are, and sizes the recipe from that alternative's plan
(rlx.plan.sizing.size_recipe, the function lint and `rlx plan` call). The sized recipe is
what every actor receives, so every rank runs with the same sizes. A GPU the plan's table
lacks is planned with the memory it reports; no GPU here (CPU jobs, a dress rehearsal's
stand-in GPUs) plans the preferred alternative, or this machine's memory on CPU.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rlx.errors import RlxError
from rlx.plan import memory as mem
from rlx.plan.planner import size_recipe
from rlx.plan.sizing import Sizes, auto_fields
from rlx.recipe.model import Accelerator, Recipe

UNKNOWN = "unknown"


@dataclass(frozen=True)
class Devices:
    """The GPUs of this node as CUDA names them: one name, each one's memory, how many."""

    name: str
    total_bytes: int
    count: int

    @property
    def table_name(self) -> str | None:
        """The plan table's name for them (None for a GPU the table lacks)."""
        return mem.device_accelerator(self.name)

    def describe(self) -> str:
        return f"{self.count} x {self.name} ({self.total_bytes / mem.GIB:.1f} GiB)"


def read_devices() -> Devices | None:
    """This node's GPUs, or None without any. NVML first: it reads them without a CUDA
    context (the head's driver holds no GPU, and a context would take memory on GPU 0 from
    the rank or engine Ray places there); torch.cuda where NVML is not installed."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
            if not count:
                return None
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            total = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
            return Devices(name, total, count)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML library or no driver: ask torch
        pass
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return None
    props = torch.cuda.get_device_properties(0)
    return Devices(props.name, int(props.total_memory), torch.cuda.device_count())


def host_memory() -> int:
    """This machine's memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def placement(env: Mapping[str, str], recipe: Recipe) -> dict[str, str]:
    """Where the job runs, as far as the node's environment says: cloud, region and spot
    or on-demand ("unknown" where it does not). SkyPilot gives its cluster's cloud and
    region (SKYPILOT_CLUSTER_INFO); dstack and Slurm give neither. Spot is known when the
    recipe asked for spot only or on-demand only."""
    cloud = region = UNKNOWN
    info = env.get("SKYPILOT_CLUSTER_INFO")
    if info:
        try:
            data = json.loads(info)
        except ValueError:
            data = {}
        cloud = str(data.get("cloud") or UNKNOWN).lower()
        region = str(data.get("region") or UNKNOWN)
    elif env.get("SLURM_JOB_ID"):
        cloud = "slurm"
    spot = recipe.resources.spot
    market = UNKNOWN if spot == "auto" else ("spot" if spot else "on-demand")
    return {"cloud": cloud, "region": region, "market": market}


@dataclass(frozen=True)
class StartSizes:
    """The recipe as this job runs it: narrowed to the alternative it got and sized."""

    recipe: Recipe
    alternative: str  # the recipe's own label, e.g. 'H100:8', or 'CPU'
    devices: Devices | None
    sizes: Sizes | None  # None: the recipe leaves nothing to auto
    where: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # for the plan: an unknown GPU's size

    def line(self) -> str:
        """The start-up line: the accelerator, where, and the sizes."""
        got = self.devices.describe() if self.devices else "no GPU on this node"
        where = self.where
        line = (
            f"accelerator: {got} = {self.alternative}; cloud {where.get('cloud', UNKNOWN)}, "
            f"region {where.get('region', UNKNOWN)}, {where.get('market', UNKNOWN)}"
        )
        if self.sizes is not None:
            line += f"; sizes: {self.sizes.line()}"
        return line

    def to_json(self) -> dict[str, Any]:
        devices = self.devices
        return {
            "line": self.line(),
            "alternative": self.alternative,
            "device": None if devices is None else devices.name,
            "device_memory_bytes": None if devices is None else devices.total_bytes,
            "count": None if devices is None else devices.count,
            **self.where,
            "sizes": None if self.sizes is None else self.sizes.to_json(),
        }


def _custom_name(device_name: str) -> str:
    """A TYPE for a GPU the table lacks, as resources.accelerators would write it."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", device_name.removeprefix("NVIDIA ")).strip("-.")
    return name if name and name[0].isalpha() else f"GPU-{name}"


def matching_alternative(
    options: tuple[Accelerator, ...], devices: Devices
) -> tuple[Accelerator, dict[str, str]]:
    """The alternative these GPUs are (its type names the same table row, or one of the same
    memory; of several, the one whose count is theirs), or, for GPUs that are none of them,
    their own name with the preferred alternative's count (what the job asked for); and the
    plan's env sizing that name by the memory the GPUs report. The table's sizes are what
    such devices report (some only the maker's GB converted); at start-up the reported one
    is the truth."""
    table = devices.table_name
    chosen = None
    if table is not None:
        size = mem.accelerator_gib(table, {})
        same = [o for o in options if o.type.upper() == table.upper()] or [
            o for o in options if mem.accelerator_gib(o.type, {}) == size
        ]
        counted = [o for o in same if o.count == devices.count]
        chosen = (counted or same or [None])[0]
    if chosen is None:
        chosen = Accelerator(table or _custom_name(devices.name), options[0].count)
    gib = devices.total_bytes / mem.GIB
    return chosen, {mem.ACCELERATOR_GIB_ENV: f"{chosen.type}={gib:.3f}"}


def size_at_start(
    recipe: Recipe,
    env: Mapping[str, str],
    devices: Devices | None,
    *,
    host_bytes: int | None = None,
) -> StartSizes:
    """The recipe narrowed to the alternative `devices` are (the preferred one without
    devices, or for a rollout group, which the head does not see) and its `auto` sizes
    chosen from that alternative's plan. RlxError, one line, when a size has no valid value
    there."""
    resources = recipe.resources
    train = resources.train_nodes.accelerator_options
    rollout_group = resources.rollout_nodes
    rollout = rollout_group.accelerator_options if rollout_group else ()
    where = placement(env, recipe)
    plan_env: dict[str, str] = {}
    chosen_train = train[0] if train else None
    if devices is not None and train:
        chosen_train, plan_env = matching_alternative(train, devices)
    chosen_rollout = rollout[0] if rollout else None
    narrowed = recipe
    if len(train) > 1 or len(rollout) > 1 or (train and chosen_train != train[0]):
        narrowed = recipe.on_accelerators(chosen_train, chosen_rollout)
    label = narrowed.alternatives()[0][0]
    if not auto_fields(narrowed):
        return StartSizes(narrowed, label, devices, None, where, plan_env)
    merged = {**env, **plan_env}
    cpu_host = host_bytes if not narrowed.resources.total_gpus else None
    several = len(recipe.alternatives())
    sized, sizes = size_recipe(narrowed, merged, host_bytes=cpu_host, alternatives=several)
    if sizes.problems:
        raise RlxError(sizes.problems[0])
    return StartSizes(sized, label, devices, sizes, where, plan_env)
