"""Object storage for a run's state: which URLs a recipe's path fields may hold, the extra each
store needs, and an fsspec filesystem for one.

A path field (checkpoint.dir, logging.dir, model.path, critic_model.path, checkpoint.resume)
holds a local path, a hub id, or a store URL: s3://, gs:// (gcs://), az:// (abfs://, abfss://).
Anything else that looks like a URL (`scheme://`) is refused, never taken as a local folder:
`s3:/bucket` written by mistake would otherwise create a folder named `s3:` on a node that a
preemption deletes.

Credentials come from the environment or the node's cloud identity, as each library reads
them (AWS_*, GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_*); rlx never writes them
anywhere. Custom endpoints: AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL (MinIO, R2, CoreWeave,
a test server), STORAGE_EMULATOR_HOST for GCS, AZURE_STORAGE_CONNECTION_STRING for Azure.

What each store guarantees, and what rlx relies on (docs/storage.md has the long form):
S3, GCS and Azure Blob give strong read-after-write consistency for an object and for
listings; none has an atomic rename of a folder (it is a copy per object), so a checkpoint
is made complete by writing its COMPLETE marker last, never by renaming.

Light: fsspec and the store libraries are imported only when a store is used.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rlx.errors import RlxError

URL = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<rest>.*)")
# Written by mistake for a URL: one slash (`s3:/bucket`) or none (`s3:bucket`).
LOOKS_LIKE_URL = re.compile(r"(?P<scheme>s3|gs|gcs|az|abfs|abfss|r2|https?):/?(?!/)", re.I)


@dataclass(frozen=True)
class Store:
    """One kind of object store: its URL schemes, the rlx extra and the module it needs."""

    name: str
    schemes: tuple[str, ...]
    extra: str
    module: str
    package: str


STORES = (
    Store("S3", ("s3",), "s3", "s3fs", "s3fs"),
    Store("GCS", ("gs", "gcs"), "gcs", "gcsfs", "gcsfs"),
    Store("Azure Blob", ("az", "abfs", "abfss"), "azure", "adlfs", "adlfs"),
)
BY_SCHEME = {scheme: store for store in STORES for scheme in store.schemes}
SUPPORTED = "s3://, gs:// or az://"


def is_url(path: str) -> bool:
    """Whether path is written as a URL (any scheme), so it must never be a local folder."""
    return URL.match(path) is not None


def is_store_url(path: str) -> bool:
    match = URL.match(path)
    return match is not None and match["scheme"].lower() in BY_SCHEME


def store_of(url: str) -> Store | None:
    match = URL.match(url)
    return None if match is None else BY_SCHEME.get(match["scheme"].lower())


def url_problem(path: str) -> str | None:
    """What is wrong with a path field's value as a URL, worded to follow the value (None when
    it is not a URL, or a store URL rlx can use)."""
    match = URL.match(path)
    if match is None:
        near = LOOKS_LIKE_URL.match(path)
        if near is not None:
            return (
                f"looks like a {near['scheme']}:// URL with a slash missing; write "
                f"{near['scheme']}://bucket/prefix (rlx never makes a folder named "
                f"'{near['scheme']}:')"
            )
        return None
    scheme = match["scheme"].lower()
    if scheme not in BY_SCHEME:
        hint = (
            "; an S3-compatible store (R2, MinIO, CoreWeave) is s3:// with AWS_ENDPOINT_URL"
            if scheme in ("r2", "minio", "cos", "oci")
            else ""
        )
        return f"is a {scheme}:// URL, which rlx cannot store to; use {SUPPORTED}{hint}"
    bucket = match["rest"].split("/", 1)[0]
    if not bucket:
        return f"names no bucket; write {scheme}://bucket/prefix"
    return None


def missing_extra(url: str) -> str | None:
    """The one line to say when the library a store URL needs is not installed here."""
    store = store_of(url)
    if store is None or importlib.util.find_spec(store.module) is not None:
        return None
    return f"{store.schemes[0]}:// needs {store.package}: pip install 'rlx[{store.extra}]'"


def check_url(path: str, field: str) -> None:
    """Refuse a path field whose URL rlx cannot use here, with one line naming the field."""
    problem = url_problem(path) or missing_extra(path)
    if problem is not None:
        raise RlxError(f"trainer.{field}: {path} {problem}")


def location(value: str, what: str) -> Any:
    """A path argument as a local Path or a store URL (str); a URL rlx cannot use is one
    line naming `what`, never a local folder."""
    from pathlib import Path

    problem = url_problem(value) or missing_extra(value)
    if problem is not None:
        raise RlxError(f"{what}: {value} {problem}")
    return value.rstrip("/") if is_store_url(value) else Path(value).expanduser()


def join(base: str, *names: str) -> str:
    """base/name/... for a URL or a local path (no normalisation of the URL's slashes)."""
    out = base.rstrip("/")
    for name in names:
        out = f"{out}/{name.strip('/')}"
    return out


# --------------------------------------------------------------------------- filesystems


def storage_options(url: str, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What fsspec's filesystem for url needs beyond what its library reads by itself: the
    custom endpoint of an S3-compatible store. Never credentials: those stay in the
    environment (or the node's identity) where the library finds them."""
    env = os.environ if env is None else env
    store = store_of(url)
    if store is not None and store.extra == "s3":
        endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
        if endpoint:
            return {"endpoint_url": endpoint}
    return {}


def filesystem(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, path inside it) for a store URL; RlxError when it cannot be used."""
    problem = url_problem(url) or missing_extra(url)
    if problem is not None or not is_store_url(url):
        raise RlxError(f"{url} {problem or 'is not a store URL'}")
    from fsspec.core import url_to_fs

    return url_to_fs(url, **storage_options(url))


def unstrip(url: str, path: str) -> str:
    """A path fsspec returned (no scheme) as a URL of url's scheme."""
    match = URL.match(url)
    assert match is not None
    return f"{match['scheme']}://{path.lstrip('/')}"
