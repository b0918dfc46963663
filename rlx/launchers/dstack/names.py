"""How dstack spells what the recipe names the SkyPilot way: GPUs and clouds. Pure."""

from __future__ import annotations

import re

# SkyPilot's (and the recipe's) A100-80GB is dstack's A100 with 80GB of memory.
SIZED_NAME = re.compile(r"(?P<name>.+)-(?P<gib>[0-9]+)GB")
# dstack's word for a SkyPilot infra's cloud, where the two differ
BACKEND_NAMES = {"k8s": "kubernetes"}


def gpu_name(accelerator_type: str) -> tuple[str, int | None]:
    """dstack's name for an accelerator type, and the memory (GB) the type names, if any."""
    match = SIZED_NAME.fullmatch(accelerator_type)
    if match is None:
        return accelerator_type, None
    return match["name"], int(match["gib"])
