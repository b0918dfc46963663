"""Models (and datasets) named by a Hugging Face hub id: where each node finds (or fetches)
its snapshot.

A recipe names its model the way people do, `Qwen/Qwen2.5-7B-Instruct`. The head resolves the
id once, before any actor starts, to a snapshot folder in its hub cache: the commit it names
is the revision every node then loads, so a push to the repository during the run changes
nothing. Each node resolves the same commit in its own cache (a shared cache is fine), once
per node however many ranks it holds: the first rank takes a lock, fetches what is missing
and the others find it complete. huggingface_hub does the fetching, with its own cache
layout, HF_TOKEN (the recipe's secret, from the environment), HF_HUB_CACHE / HF_HOME, and
HF_HUB_OFFLINE=1 (nothing fetched; the cache must hold the snapshot).

Only what a run reads is fetched: safetensors weights (every loader here reads them), the
config, tokenizer and chat-template files. A dataset repository (trainer.data.train:
hf://org/name) is fetched whole, on the head that reads it, the same way (dataset_snapshot).
Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shlex
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

from rlx.errors import RlxError
from rlx.recipe.specs import TINY_PREFIX, is_local_path
from rlx.storage import is_url

# The files of a model a run reads: weights (safetensors only), config, tokenizer, template.
SMALL_FILE_PATTERNS = ("*.json", "*.txt", "*.model", "*.jinja", "*.py", "*.tiktoken")
WEIGHT_PATTERNS = ("*.safetensors",)
SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
COMMIT = re.compile(r"[0-9a-f]{40}")
LOCK_WAIT_S = 3600.0  # a node's first rank may be downloading tens of GB for the others


def is_hub_id(spec: str) -> bool:
    """Whether a model path names a hub repository: not a tiny spec, not a URL, not written
    as a local path, and no folder of that name here (an existing folder wins, as in
    transformers' from_pretrained)."""
    if spec.startswith(TINY_PREFIX) or is_url(spec) or is_local_path(spec):
        return False
    return not Path(spec).is_dir()


def cache_root(env: Mapping[str, str] | None = None) -> Path:
    """The hub cache huggingface_hub uses with this environment."""
    env = os.environ if env is None else env
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    home = Path(env["HF_HOME"]).expanduser() if env.get("HF_HOME") else None
    return (home or Path.home() / ".cache" / "huggingface") / "hub"


def offline(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return env.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def repo_folder(
    repo_id: str, env: Mapping[str, str] | None = None, repo_type: str = "model"
) -> Path:
    """The cache's folder of a repository: models--<org>--<name> (datasets--... for a
    dataset)."""
    return cache_root(env) / f"{repo_type}s--{repo_id.replace('/', '--')}"


def cached_file(repo_id: str, name: str, env: Mapping[str, str] | None = None) -> Path | None:
    """A file of the repository's main revision as the cache holds it, without any network
    (the planner reads config.json so), or None."""
    folder = repo_folder(repo_id, env)
    ref = folder / "refs" / "main"
    if not ref.is_file():
        return None
    path = folder / "snapshots" / ref.read_text().strip() / name
    return path if path.is_file() else None


def commit_of(snapshot: str | Path) -> str | None:
    """The commit a snapshot folder holds (its name in the cache), or None for another folder."""
    path = Path(snapshot)
    if path.parent.name == "snapshots" and COMMIT.fullmatch(path.name):
        return path.name
    return None


def weight_files(folder: Path) -> list[str] | None:
    """The safetensors files a model folder's weights are in (from its index, or the one
    file), or None when it has none."""
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted(set(weight_map.values()))
    if (folder / SAFETENSORS_SINGLE).is_file():
        return [SAFETENSORS_SINGLE]
    return None


def is_complete(folder: Path) -> bool:
    """Whether a snapshot folder holds what a run reads: its config and every weight file."""
    if not (folder / "config.json").is_file():
        return False
    files = weight_files(folder)
    return files is not None and all((folder / name).is_file() for name in files)


def snapshot(
    repo_id: str,
    *,
    revision: str | None = None,
    field: str = "trainer.model.path",
    env: Mapping[str, str] | None = None,
) -> Path:
    """The local snapshot folder of `repo_id` at `revision` (the main branch when None):
    found complete in this node's cache, or fetched into it, once per node (a lock in the
    cache). A problem is one RlxError naming `field`, the id and what to do."""
    env = os.environ if env is None else env
    folder = repo_folder(repo_id, env)
    if revision is not None and is_complete(folder / "snapshots" / revision):
        return folder / "snapshots" / revision
    with _node_lock(repo_id, env):
        if revision is not None and is_complete(folder / "snapshots" / revision):
            return folder / "snapshots" / revision  # another rank of this node fetched it
        path = _download(repo_id, revision, field, env)
    if weight_files(path) is None:
        raise RlxError(
            f"{field}: {repo_id} has no safetensors weights (model.safetensors or "
            f"{SAFETENSORS_INDEX}); rlx loads safetensors only: convert the checkpoint "
            "(save_pretrained(..., safe_serialization=True)) and point the field at it"
        )
    if not is_complete(path):
        raise RlxError(
            f"{field}: the cached snapshot of {repo_id} at {path} is incomplete (a weight "
            "file or config.json is missing); delete that folder and run again"
            + (" without HF_HUB_OFFLINE" if offline(env) else "")
        )
    return path


def _download(
    repo_id: str,
    revision: str | None,
    field: str,
    env: Mapping[str, str],
    repo_type: str = "model",
    local_only: bool = False,
) -> Path:
    from huggingface_hub import errors as hub_errors
    from huggingface_hub import snapshot_download

    where = f"the Hugging Face cache {cache_root(env)}"
    dataset = repo_type == "dataset"
    fetch = f"hf download {shlex.quote(repo_id)}" + (" --repo-type dataset" if dataset else "")
    try:
        return Path(
            snapshot_download(
                repo_id,
                repo_type=repo_type,
                revision=revision,
                cache_dir=cache_root(env),
                local_files_only=local_only or offline(env),
                token=env.get("HF_TOKEN") or None,
                # A dataset's files are what it is: all of them; a model's, what a run reads.
                allow_patterns=None if dataset else [*WEIGHT_PATTERNS, *SMALL_FILE_PATTERNS],
            )
        )
    except hub_errors.HFValidationError:
        problem = (
            "is not a hub id (org/name) nor a local folder; give a folder written as ./path or "
            "/path, or a hub id such as Qwen/Qwen2.5-0.5B-Instruct"
        )
    except hub_errors.LocalEntryNotFoundError:
        at = "" if revision is None else f" at revision {revision!r}"
        if offline(env):
            problem = (
                f"is not in {where}{at} and HF_HUB_OFFLINE=1 forbids fetching it; fetch it "
                f"first ({fetch}) or unset HF_HUB_OFFLINE"
            )
        else:
            problem = (
                f"is not in {where}{at} and the hub could not be reached; check the network, "
                f"or fetch it where there is one ({fetch})"
            )
    except hub_errors.GatedRepoError:
        problem = (
            "is a gated repository: accept its terms on the hub and give the job a token "
            "(secrets: [HF_TOKEN])"
        )
    except hub_errors.RepositoryNotFoundError:
        problem = (
            "is not on the hub (or is private and no token with access was given: secrets: "
            "[HF_TOKEN]); check the id"
        )
    except hub_errors.RevisionNotFoundError:
        problem = f"has no revision {revision!r} on the hub"
    except (hub_errors.HfHubHTTPError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        problem = f"could not be fetched: {first}"
    raise RlxError(f"{field}: {repo_id} {problem}")


@contextlib.contextmanager
def _node_lock(repo_id: str, env: Mapping[str, str], repo_type: str = "model") -> Iterator[None]:
    """One fetch of a repository per node at a time (the cache's own lock folder)."""
    from filelock import FileLock, Timeout

    locks = cache_root(env) / ".locks" / "rlx"
    locks.mkdir(parents=True, exist_ok=True)
    kind = "" if repo_type == "model" else f"{repo_type}s--"
    lock = FileLock(str(locks / (kind + repo_id.replace("/", "--") + ".lock")))
    try:
        lock.acquire(timeout=LOCK_WAIT_S)
    except Timeout:
        raise RlxError(
            f"waited {LOCK_WAIT_S:.0f} s for another process of this node to fetch {repo_id} "
            f"(lock {lock.lock_file}); if none is running, delete the lock file"
        ) from None
    try:
        yield
    finally:
        lock.release()


# --------------------------------------------------------------------------- datasets

# The commit each dataset (cache, repository, revision as written) resolved to in this
# process: the start-up check, the training set and the held-out set all read that one, even
# when the branch moves on the hub meanwhile.
_PINNED: dict[tuple[str, str, str | None], str] = {}


def dataset_snapshot(
    repo_id: str,
    *,
    revision: str | None = None,
    field: str = "trainer.data.train",
    env: Mapping[str, str] | None = None,
    fetch: bool = True,
) -> Path | None:
    """The local snapshot folder of dataset repository `repo_id` at `revision` (the main
    branch when None), fetched into this node's hub cache under the node's lock as a model
    is, and pinned: later calls in this process get the same commit. fetch=False (lint)
    reads the cache only and gives None when it does not hold the dataset, unless
    HF_HUB_OFFLINE says that is final. A problem is one RlxError naming `field`."""
    env = os.environ if env is None else env
    key = (str(cache_root(env)), repo_id, revision)
    folder = repo_folder(repo_id, env, "dataset")
    pinned = _PINNED.get(key)
    if pinned is not None and (folder / "snapshots" / pinned).is_dir():
        return folder / "snapshots" / pinned
    commit = revision if revision is not None and COMMIT.fullmatch(revision) else None
    if commit is not None and (folder / "snapshots" / commit).is_dir():
        _PINNED[key] = commit
        return folder / "snapshots" / commit
    if not fetch:
        known = revision is None and (folder / "refs" / "main").is_file()
        known = known or (revision is not None and (folder / "refs" / revision).is_file())
        if not known and not offline(env):
            return None  # the job's node may fetch it: not lint's to say
        path = _download(repo_id, revision, field, env, "dataset", local_only=True)
    else:
        with _node_lock(repo_id, env, "dataset"):
            path = _download(repo_id, revision, field, env, "dataset")
    commit = commit_of(path)
    if commit is not None:
        _PINNED[key] = commit
    return path


# --------------------------------------------------------------------------- filling a cache


def put_in_cache(
    folder: Path,
    repo_id: str,
    env: Mapping[str, str] | None = None,
    repo_type: str = "model",
    ref: str = "main",
) -> Path:
    """Store a model folder (or a dataset's, repo_type="dataset") in the hub cache under
    `repo_id`, in the cache's own layout (blobs by content, a snapshot of links, refs/<ref>),
    as if it had been fetched: what a dress rehearsal (and a test) serves offline. The commit
    is derived from the content, so the same files give the same snapshot. Returns the
    snapshot folder."""
    files = sorted(p for p in Path(folder).rglob("*") if p.is_file())
    digests = {p: _sha256(p) for p in files}
    commit = hashlib.sha1(
        "".join(f"{p.relative_to(folder)}:{digests[p]}\n" for p in files).encode()
    ).hexdigest()
    repo = repo_folder(repo_id, env, repo_type)
    target = repo / "snapshots" / commit
    for path in files:
        blob = repo / "blobs" / digests[path]
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            shutil.copyfile(path, blob)
        link = target / path.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(2**20), b""):
            digest.update(chunk)
    return digest.hexdigest()
