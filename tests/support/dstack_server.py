"""A real dstack server for tests, as a pytest plugin (`-p tests.support.dstack_server`).

`dstack server` runs on loopback with a fixed admin token, its own server folder and a private
HOME (where it writes the client config, ~/.dstack/config.yml, for its "main" project). No
backend is configured (and none is picked up from this machine's credentials), so there are
no fleets: a submitted run finds nowhere to go and fails on the server, as it would for a user
who has not created a fleet yet. The server is stopped at the end of the session, also when a
test or the start-up fails.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

TOKEN = "rlx-test-admin-token"
PROJECT = "main"
START_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 60.0
CLIENT_ENV = ("DSTACK_SERVER_URL", "DSTACK_TOKEN", "DSTACK_PROJECT")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class DstackServer:
    url: str
    token: str
    project: str
    home: Path  # HOME of a configured client (holds .dstack/config.yml)
    server_dir: Path  # DSTACK_SERVER_DIR: config.yml, data/sqlite.db, logs
    log: Path  # the server's stdout and stderr
    pid: int

    def client(self):
        """A dstack API client for this server's project (for checks from tests)."""
        from dstack.api import Client

        return Client.from_config(
            project_name=self.project, server_url=self.url, user_token=self.token
        )

    def log_tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def _answers(url: str) -> bool:
    request = urllib.request.Request(f"{url}/api/server/get_info", data=b"", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _stop(proc: subprocess.Popen) -> None:
    """End the server's process group (it was started as its own session), politely first."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture(scope="session")
def dstack_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DstackServer]:
    pytest.importorskip("dstack")
    pytest.importorskip("uvicorn", reason="dstack's server extras are not installed")
    dstack_bin = Path(sys.executable).parent / "dstack"
    if not dstack_bin.exists():
        pytest.skip(f"no dstack command next to {sys.executable}")
    root = tmp_path_factory.mktemp("dstack")
    home, server_dir, log = root / "home", root / "server", root / "server.log"
    home.mkdir()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k not in CLIENT_ENV}
    env.update(
        HOME=str(home),
        DSTACK_SERVER_DIR=str(server_dir),
        # no backend from whatever cloud credentials this machine has: no fleets, no offers
        DSTACK_DEFAULT_CREDS_DISABLED="1",
    )
    command = [str(dstack_bin), "server", "--host", "127.0.0.1", "--port", str(port)]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*command, "--token", TOKEN, "--yes"],
            env=env,
            cwd=root,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    server = DstackServer(url, TOKEN, PROJECT, home, server_dir, log, proc.pid)
    try:
        deadline, delay = time.monotonic() + START_TIMEOUT_S, 0.1
        while not (_answers(url) and (home / ".dstack" / "config.yml").exists()):
            if proc.poll() is not None:
                pytest.fail(
                    f"dstack server exited with code {proc.returncode} while starting; its log:\n"
                    + server.log_tail()
                )
            if time.monotonic() > deadline:
                pytest.fail(
                    f"dstack server did not answer at {url} within {START_TIMEOUT_S:.0f}s; "
                    "its log:\n" + server.log_tail()
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 2.0)
        yield server
    finally:
        _stop(proc)


@pytest.fixture
def dstack_client_env(dstack_server: DstackServer, monkeypatch: pytest.MonkeyPatch) -> DstackServer:
    """This process as a user whose dstack client is configured for the test server (through
    ~/.dstack/config.yml, the way `dstack server` / `dstack project add` leave it)."""
    monkeypatch.setenv("HOME", str(dstack_server.home))
    for name in CLIENT_ENV:
        monkeypatch.delenv(name, raising=False)
    return dstack_server
