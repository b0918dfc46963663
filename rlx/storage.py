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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlx.errors import TRY_AGAIN, RlxError

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

# Seconds one store request may wait to connect or for an answer (S3); unset: the library's.
STORE_TIMEOUT_ENV = "RLX_STORE_TIMEOUT"
# Seconds one store operation keeps retrying transient errors before it fails for good.
STORE_DEADLINE_ENV = "RLX_STORE_DEADLINE"
STORE_DEADLINE_SECONDS = 300.0


def is_url(path: str) -> bool:
    """Whether path is written as a URL (any scheme), so it must never be a local folder."""
    return URL.match(path) is not None


def is_store_url(path: str) -> bool:
    match = URL.match(path)
    return match is not None and match["scheme"].lower() in BY_SCHEME


def store_of(url: str) -> Store | None:
    match = URL.match(url)
    return None if match is None else BY_SCHEME.get(match["scheme"].lower())


# Schemes read letter by letter whose first letter sounds a vowel ("an s3:// URL", "an
# https:// URL"); the others take "a" ("a gs:// URL", "a file:// URL").
_AN_SCHEMES = frozenset(
    {"s3", "s3a", "az", "abfs", "abfss", "adl", "hf", "http", "https", "r2", "oci", "ftp", "sftp"}
)


def a_url(scheme: str) -> str:
    """'a gs://' or 'an s3://': the article a scheme's URL takes, with it."""
    return f"{'an' if scheme.lower() in _AN_SCHEMES else 'a'} {scheme}://"


def url_problem(path: str) -> str | None:
    """What is wrong with a path field's value as a URL, worded to follow the value (None when
    it is not a URL, or a store URL rlx can use)."""
    match = URL.match(path)
    if match is None:
        near = LOOKS_LIKE_URL.match(path)
        if near is not None:
            return (
                f"looks like {a_url(near['scheme'])} URL with a slash missing; write "
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
        return f"is {a_url(scheme)} URL, which rlx cannot store to; use {SUPPORTED}{hint}"
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


def storage_options(
    url: str, env: Mapping[str, str] | None = None, *, retried: bool = False
) -> dict[str, Any]:
    """What fsspec's filesystem for url needs beyond what its library reads by itself: the
    custom endpoint of an S3-compatible store, and the seconds a request may wait for an
    answer (STORE_TIMEOUT_ENV). retried: the caller retries transient errors itself
    (retry_call), so the library tries each request once and every retry is counted. Never
    credentials: those stay in the environment (or the node's identity) where the library
    finds them."""
    env = os.environ if env is None else env
    store = store_of(url)
    options: dict[str, Any] = {}
    if store is not None and store.extra == "s3":
        endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
        if endpoint:
            options["endpoint_url"] = endpoint
        config: dict[str, Any] = {}
        timeout = env.get(STORE_TIMEOUT_ENV)
        if timeout:
            config["read_timeout"] = config["connect_timeout"] = float(timeout)
        if retried:
            config["retries"] = {"mode": "standard", "max_attempts": 1}
        if config:
            options["config_kwargs"] = config
    return options


def filesystem(url: str, *, retried: bool = False) -> tuple[Any, str]:
    """(fsspec filesystem, path inside it) for a store URL; RlxError when it cannot be used.
    retried: for callers that go through retry_call (see storage_options)."""
    problem = url_problem(url) or missing_extra(url)
    if problem is not None or not is_store_url(url):
        raise RlxError(f"{url} {problem or 'is not a store URL'}")
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(url, **storage_options(url, retried=retried))
    if retried and store_of(url) is BY_SCHEME["s3"]:
        fs.retries = 1  # s3fs's own loop over throttling and resets: retry_call's job here
    return fs, path


def unstrip(url: str, path: str) -> str:
    """A path fsspec returned (no scheme) as a URL of url's scheme."""
    match = URL.match(url)
    assert match is not None
    return f"{match['scheme']}://{path.lstrip('/')}"


# --------------------------------------------------------------------------- faults

# Error codes of a store that is busy or briefly unwell (S3's, GCS's and Azure's names):
# the same request succeeds later.
TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequests",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
        "ServerBusy",
        "OperationTimedOut",
    }
)
# Failures of the connection itself, by class name (aiohttp's, botocore's, azure-core's and
# fsspec's, matched by name so that none of those libraries is imported here).
TRANSIENT_CLASSES = frozenset(
    {
        "ClientConnectionError",
        "ClientOSError",
        "ServerDisconnectedError",
        "ClientPayloadError",
        "ServerTimeoutError",
        "ConnectionClosedError",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "IncompleteReadError",
        "ResponseStreamingError",
        "FSTimeoutError",
        "ServiceRequestError",
        "ServiceResponseError",
    }
)


def chain(exc: BaseException) -> list[BaseException]:
    """exc and the exceptions it was raised from or during, outermost first."""
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not other for other in seen):
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def _status(exc: BaseException) -> tuple[int | None, str | None]:
    """The HTTP status and error code a store's error carries, where it carries them."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):  # botocore's ClientError
        meta = response.get("ResponseMetadata", {})
        return meta.get("HTTPStatusCode"), response.get("Error", {}).get("Code")
    status = getattr(exc, "status_code", None) or getattr(exc, "code", None)
    return (status if isinstance(status, int) else None), getattr(exc, "error_code", None)


def _busy(error: BaseException) -> bool:
    """Whether error is the store's own answer that it is busy: throttling or a 5xx."""
    status, code = _status(error)
    return code in TRANSIENT_CODES or (status is not None and (status >= 500 or status == 429))


def is_transient(exc: BaseException) -> bool:
    """Whether the same store request may succeed if made again: a 5xx or throttling answer,
    a connection reset or refused mid-run, a timeout. A missing bucket, a denied request or
    a full disk are not."""
    for error in chain(exc):
        if isinstance(error, (TimeoutError, ConnectionError)):
            return True
        if any(cls.__name__ in TRANSIENT_CLASSES for cls in type(error).__mro__):
            return True
        if _busy(error):
            return True
    return False


def reason(exc: BaseException) -> str:
    """What went wrong, in a few words for a one-line message: an OS error's own words (No
    space left on device), a store's answer, else the first line of the error."""
    for error in chain(exc):
        if isinstance(error, OSError) and error.strerror:
            return error.strerror
    for error in reversed(chain(exc)):
        status, code = _status(error)
        if code or status:
            text = f"{code or ''} {f'(HTTP {status})' if status else ''}".strip()
            return text
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class StoreUnavailable(RlxError):
    """A store that kept failing with transient errors past the deadline: worth a retry of
    the job later (exit 75), unlike a refusal."""

    exit_code = TRY_AGAIN


@dataclass
class Retries:
    """Retries of transient store errors with backoff, within a deadline per operation; the
    number made is counted (the metric checkpoint/retries)."""

    deadline: float = STORE_DEADLINE_SECONDS
    count: int = 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Retries:
        env = os.environ if env is None else env
        return cls(float(env.get(STORE_DEADLINE_ENV) or STORE_DEADLINE_SECONDS))

    def call(
        self,
        what: str,
        func: Any,
        *args: Any,
        transient: Callable[[BaseException], bool] = is_transient,
        **kwargs: Any,
    ) -> Any:
        """func(*args, **kwargs), made again after a transient error (0.1 s, doubling up to
        10 s) until it succeeds or the deadline passes; then StoreUnavailable naming what.
        Other errors are raised as they are."""
        import random
        import time

        start = time.monotonic()
        delay = 0.1
        while True:
            try:
                return func(*args, **kwargs)
            except Exception as exc:
                if not transient(exc):
                    raise
                waited = time.monotonic() - start
                if waited + delay > self.deadline:
                    raise StoreUnavailable(
                        f"{what}: the store kept failing for {waited:.0f} s ({reason(exc)}); "
                        "it may be down or throttling: run the job again later"
                    ) from exc
            self.count += 1
            time.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, 10.0)


# --------------------------------------------------------------------------- start-up probe

PROBE_NAME = ".rlx-probe"
PROBE_DEADLINE_SECONDS = 10.0  # how long the probe retries a store that answers "busy"


def answered_busy(exc: BaseException) -> bool:
    """A transient error the store itself answered (throttling, a 5xx), not a connection
    that failed: the store is there, and busy."""
    return any(_busy(error) for error in chain(exc))


def probe_writable(value: str, what: str) -> None:
    """Create and delete a small file (object) under value, a folder or store URL that `what`
    (a field, for messages) names: a missing bucket, a denied write, an endpoint that does
    not answer or a read-only folder is one RlxError naming what, the location, the error
    and what to do. Made once, without retries: a fault found here costs seconds, not a
    checkpoint interval."""
    import secrets

    name = f"{PROBE_NAME}-{secrets.token_hex(4)}"
    if is_store_url(value):
        _probe_store(value.rstrip("/"), name, what)
    else:
        _probe_folder(Path(value).expanduser(), name, what)


def _probe_store(url: str, name: str, what: str) -> None:
    problem = url_problem(url) or missing_extra(url)
    if problem is not None:
        raise RlxError(f"{what}: {url} {problem}")
    # A store that answers "busy" (throttling, a 5xx) is there: the probe waits a little for
    # it. One that does not answer at all (a wrong endpoint) is said at once.
    retries = Retries(PROBE_DEADLINE_SECONDS)
    try:
        fs, base = filesystem(url, retried=True)
        target = f"{base.rstrip('/')}/{name}"
        retries.call(f"writing {url}", fs.pipe, target, b"rlx probe\n", transient=answered_busy)
        retries.call(f"deleting in {url}", fs.rm, target, transient=answered_busy)
    except Exception as exc:
        raise RlxError(f"{what}: {url}: cannot write there ({store_advice(url, exc)})") from None


def store_advice(url: str, exc: BaseException) -> str:
    """A store error during the probe and what to do about it, for one line."""
    bucket = URL.match(url)["rest"].split("/", 1)[0]  # type: ignore[index]
    status, code = next(((s, c) for s, c in map(_status, chain(exc)) if s or c), (None, None))
    text = reason(exc)
    if code in ("NoSuchBucket", "ContainerNotFound") or "bucket does not exist" in str(exc):
        return f"the bucket {bucket} does not exist; create it or correct the name"
    if status in (401, 403) or isinstance(exc, PermissionError):
        return (
            f"{text}: access denied; give this node's credentials (environment or cloud "
            "identity) write access to the prefix"
        )
    if is_transient(exc) or any("Endpoint" in type(e).__name__ for e in chain(exc)):
        endpoint = storage_options(url).get("endpoint_url")
        at = f" at {endpoint}" if endpoint else ""
        return (
            f"{text}: no answer from the store{at}; check the endpoint "
            "(AWS_ENDPOINT_URL for S3-compatible stores) and the network"
        )
    return f"{text}; check the URL and this node's credentials"


def _probe_folder(folder: Path, name: str, what: str) -> None:
    where = f"{what}: {folder}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / name
        with target.open("wb") as handle:
            handle.write(b"rlx probe\n")
            handle.flush()
            os.fsync(handle.fileno())
        target.unlink()
    except OSError as exc:
        raise RlxError(
            f"{where}: cannot write there ({exc.strerror or exc}); point it at a writable "
            "folder, or mount that one read-write"
        ) from None


def existing_ancestor(path: Path) -> Path:
    """path, or its nearest ancestor that exists (where a folder to be made would live)."""
    path = path.expanduser().absolute()
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def space_problem(folder: Path, needed: int, what: str) -> str | None:
    """One line when folder's file system has less than needed bytes free (None otherwise)."""
    import shutil

    free = shutil.disk_usage(existing_ancestor(folder)).free
    if free >= needed:
        return None
    return (
        f"{what}: {folder} has {free / 2**20:.1f} MiB free, less than the {needed / 2**20:.1f} "
        "MiB two checkpoints take (rlx plan's checkpoint size); free space there or point "
        "it at a larger disk"
    )
