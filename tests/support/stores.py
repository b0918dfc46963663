"""Real object stores started on this machine for the tests, each speaking its cloud's own
protocol over HTTP: S3 through moto's server (ThreadedMotoServer), GCS through
gcp-storage-emulator, Azure Blob through Azurite (Microsoft's emulator, from npm). Each comes
back with the environment a client needs (endpoint, the emulator's well-known dummy
credentials) as a dict, which a test passes to the processes it starts and nothing else.
The URL of a fresh, empty place in the store comes from new_prefix()."""

from __future__ import annotations

import contextlib
import logging
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

# Azurite's development account: the documented, public key every Azurite install has.
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)


@dataclass
class StoreServer:
    scheme: str  # s3 | gs | az
    endpoint: str
    env: dict[str, str] = field(default_factory=dict)

    def new_prefix(self, name: str = "rlx") -> str:
        """A URL under a new, empty bucket (container)."""
        bucket = f"{name}-{secrets.token_hex(4)}"
        fs = self.filesystem()
        fs.mkdir(bucket)
        return f"{self.scheme}://{bucket}/data"

    def filesystem(self):
        """An fsspec filesystem on this store for the test's own checks (rlx itself is
        configured by env only, in the processes a test starts)."""
        from fsspec import filesystem

        if self.scheme == "s3":
            return filesystem(
                "s3",
                endpoint_url=self.endpoint,
                key=self.env["AWS_ACCESS_KEY_ID"],
                secret=self.env["AWS_SECRET_ACCESS_KEY"],
                skip_instance_cache=True,
            )
        if self.scheme == "gs":
            return filesystem(
                "gs", endpoint_url=self.endpoint, token="anon", skip_instance_cache=True
            )
        return filesystem(
            "az",
            connection_string=self.env["AZURE_STORAGE_CONNECTION_STRING"],
            skip_instance_cache=True,
        )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_for_port(
    host: str, port: int, proc: subprocess.Popen | None = None, timeout: float = 300
) -> None:
    """Until something listens on host:port: as long as `proc` (the server) runs, so a
    loaded machine's slow start is waited for and a server that died is said at once;
    `timeout` only bounds a hang."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            socket.create_connection((host, port), 0.5).close()
            return
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode} before listening")
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout} s")


def stop(proc: subprocess.Popen) -> None:
    """A server process ended: asked first, killed after 10 s."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def s3_server(host: str = "127.0.0.1") -> Iterator[StoreServer]:
    """moto's S3 server on host (a free port), in a process of its own: its web framework
    (Flask) must not be imported into the test's process, where it breaks an in-process vLLM
    engine started later (vLLM's CPU build scans every module's globals, and Flask's context
    proxies raise on the scan); stopped on exit."""
    port = free_port(host)
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", host, "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(host, port, proc)
        endpoint = f"http://{host}:{port}"
        env = {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        yield StoreServer("s3", endpoint, env)
    finally:
        stop(proc)


@contextlib.contextmanager
def gcs_server(host: str = "127.0.0.1") -> Iterator[StoreServer]:
    """gcp-storage-emulator in memory on host; gcsfs finds it through STORAGE_EMULATOR_HOST.
    The emulator speaks JSON over HTTP only: gcsfs's gRPC bucket-type probe is turned off."""
    from gcp_storage_emulator.server import create_server

    logging.getLogger("gcp_storage_emulator").setLevel(logging.WARNING)  # a line per request
    port = free_port(host)
    server = create_server(host, port, in_memory=True)
    server.start()
    try:
        endpoint = f"http://{host}:{port}"
        env = {
            "STORAGE_EMULATOR_HOST": endpoint,
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        }
        yield StoreServer("gs", endpoint, env)
    finally:
        server.stop()


@contextlib.contextmanager
def azure_server(host: str = "127.0.0.1") -> Iterator[StoreServer]:
    """Azurite's blob service in memory on host; adlfs reads the connection string."""
    binary = shutil.which("azurite-blob")
    if binary is None:
        pytest.skip("azurite-blob is not installed (npm install -g azurite)")
    port = free_port(host)
    proc = subprocess.Popen(
        [
            *(binary, "--blobHost", host, "--blobPort", str(port), "--inMemoryPersistence"),
            *("--skipApiVersionCheck", "--silent", "--loose"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(host, port, proc)
        endpoint = f"http://{host}:{port}/{AZURITE_ACCOUNT}"
        env = {
            "AZURE_STORAGE_CONNECTION_STRING": (
                f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
                f"AccountKey={AZURITE_KEY};BlobEndpoint={endpoint};"
            )
        }
        yield StoreServer("az", endpoint, env)
    finally:
        stop(proc)
