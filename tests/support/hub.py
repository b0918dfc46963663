"""Models named by hub id, served from a Hugging Face cache a test fills itself (the cache's
own layout: blobs, snapshots of links, refs/main) with HF_HUB_OFFLINE=1: how users name
models, without a network."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# The id every shipped small recipe names: a test puts a tiny model of the same architecture
# under it.
HUB_ID = "Qwen/Qwen2.5-0.5B-Instruct"


@dataclass(frozen=True)
class HubCache:
    root: Path  # HF_HUB_CACHE
    repo_id: str
    snapshot: Path  # the folder the cache serves for repo_id

    @property
    def env(self) -> dict[str, str]:
        """What a process needs to be served from this cache, and only from it."""
        return {"HF_HUB_CACHE": str(self.root), "HF_HUB_OFFLINE": "1"}


def fill_hub_cache(root: Path, model_dir: Path, repo_id: str = HUB_ID) -> HubCache:
    """model_dir stored in a hub cache at root under repo_id."""
    from rlx.hub import put_in_cache

    snapshot = put_in_cache(model_dir, repo_id, {"HF_HUB_CACHE": str(root)})
    return HubCache(root, repo_id, snapshot)
