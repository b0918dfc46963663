"""SkyPilot, for real up to SkyPilot's own answer on a machine with no cloud account.

`rlx launch --backend sky` goes through SkyPilot's SDK, which starts a local API server as
`sky launch` would. The tests give it a private HOME and port (one server for the module,
stopped at the end) and check that each refusal reaches the user as one line naming the cause
and the next step, and that secret values are never written by rlx.
"""

from __future__ import annotations

import base64
import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from io import StringIO
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlx.cli import app
from rlx.launchers.base import Job, remember
from tests.conftest import RECIPES, REPO
from tests.support.cli import assert_one_line_error
from tests.support.dstack_server import free_port

GSM8K = RECIPES / "gsm8k-grpo.yaml"
QUICKSTART = RECIPES / "quickstart.yaml"
SECRETS = {"HF_TOKEN": "hf_rlxTestValue9c1e7a", "WANDB_API_KEY": "wandb_rlxTestValue52bd04"}
runner = CliRunner()


@dataclass(frozen=True)
class SkyHome:
    home: Path
    port: int


def server_pids(port: int) -> list[int]:
    """Ids of SkyPilot API server processes bound to `port` (from /proc, no extra tools)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"sky.server.server" in cmdline and f"--port={port}".encode() in cmdline:
            pids.append(int(proc.name))
    return pids


@pytest.fixture(scope="module")
def sky_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SkyHome]:
    """A private HOME and API server port for SkyPilot; the server the SDK starts there is
    stopped (and checked gone) when the module is done."""
    # Imported before any CliRunner call, so SkyPilot's log handlers bind to pytest's
    # streams rather than to a runner's stream that is closed after one command.
    pytest.importorskip("sky")
    from sky.server import common as server_common

    home = tmp_path_factory.mktemp("sky-home")
    port = free_port()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(home))
        mp.setenv("SKYPILOT_API_SERVER_LOCAL_PORT", str(port))
        mp.delenv("SKYPILOT_API_SERVER_ENDPOINT", raising=False)
        # The SDK caches its server URL; an earlier import in this session may have seen
        # the default port.
        for cached in (server_common.get_server_url, server_common.is_api_server_local):
            getattr(cached, "cache_clear", lambda: None)()
        assert server_common.get_server_url() == f"http://127.0.0.1:{port}"
        try:
            yield SkyHome(home, port)
        finally:
            subprocess.run(
                [str(Path(sys.executable).parent / "sky"), "api", "stop"],
                env=dict(os.environ),
                capture_output=True,
                timeout=180,
                check=False,
            )
    assert server_pids(port) == [], "the SkyPilot API server started by the tests is still up"


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sky_home: SkyHome) -> Path:
    folder = tmp_path / "project"
    folder.mkdir()
    monkeypatch.chdir(folder)
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    return folder


def launch(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["launch", *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, result.output


# ------------------------------------------------------------------------- launch refusals


def volume_variant(folder: Path) -> Path:
    """gsm8k-grpo on Kubernetes with a SkyPilot volume (where SkyPilot has them) that was
    never created."""
    text = GSM8K.read_text().replace("sky:\n  infra: gcp", "sky:\n  infra: k8s")
    text = text[: text.index("\ndstack:")] + "\n"  # a dstack volume is one node's disk
    text = text.replace("\nsetup:", "\nvolumes:\n  - name: rlx-gsm8k\n    path: /shared\n\nsetup:")
    path = folder / "gsm8k-grpo.yaml"
    path.write_text(text)
    return path


@pytest.mark.timeout(600)
def test_gsm8k_stops_at_the_missing_volume(workdir: Path, sky_home: SkyHome):
    code, output = launch(str(volume_variant(workdir)), "--backend", "sky")
    assert code == 1
    assert_one_line_error(output, "SkyPilot: volume rlx-gsm8k does not exist", "sky volumes apply")
    # the SDK really went to its own API server (started on our port)
    assert server_pids(sky_home.port)
    # nothing was created, so nothing is remembered
    assert not (workdir / ".rlx" / "jobs" / "gsm8k-grpo.json").exists()
    assert (workdir / ".rlx" / "rendered" / "gsm8k-grpo.sky.yaml").is_file()


@pytest.mark.timeout(600)
def test_gsm8k_managed_stops_at_the_missing_volume(workdir: Path):
    code, output = launch(str(volume_variant(workdir)), "--backend", "sky", "--managed")
    assert code == 1
    assert_one_line_error(output, "volume rlx-gsm8k does not exist", "sky volumes apply")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("managed", [False, True], ids=["cluster", "managed"])
def test_no_cloud_enabled(workdir: Path, managed: bool):
    args = ["--managed"] if managed else []
    code, output = launch(str(QUICKSTART), "--backend", "sky", *args)
    assert code == 1
    assert_one_line_error(output, "no cloud is enabled", "run `sky check`")
    assert not (workdir / ".rlx" / "jobs" / "quickstart.json").exists()


@pytest.mark.timeout(600)
def test_unreachable_catalog(workdir: Path, write_recipe):
    # one GPU node, no volume: SkyPilot gets as far as looking the GPU up in its catalog
    text = GSM8K.read_text().replace("  nodes: 2\n", "  nodes: 1\n")
    text = text.replace("volumes:\n  - name: rlx-gsm8k", "# no volume:\n#  - name: rlx-gsm8k")
    text = text.replace("    path: /shared\n", "", 1)
    recipe = write_recipe(text, "one-gpu.yaml")
    code, output = launch(str(recipe), "--backend", "sky")
    assert code == 1
    assert_one_line_error(output, "cannot download its cloud catalog", "sky check")


@pytest.mark.timeout(600)
def test_unreachable_api_server(workdir: Path, monkeypatch: pytest.MonkeyPatch):
    from sky.server import common as server_common

    url = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("SKYPILOT_API_SERVER_ENDPOINT", url)
    for cached in (server_common.get_server_url, server_common.is_api_server_local):
        cached.cache_clear()
    try:
        code, output = launch(str(QUICKSTART), "--backend", "sky")
    finally:
        monkeypatch.delenv("SKYPILOT_API_SERVER_ENDPOINT")
        for cached in (server_common.get_server_url, server_common.is_api_server_local):
            cached.cache_clear()
    assert code == 1
    assert_one_line_error(output, f"cannot reach the API server at {url}", "sky api start")


def test_missing_secret_fails_before_any_skypilot_call(tmp_path: Path):
    """In a fresh process with a fresh HOME: the error comes first, and SkyPilot is never
    imported (so no API server is started, no request sent)."""
    home, port = tmp_path / "home", free_port()
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in SECRETS}
    env.update(
        HOME=str(home),
        SKYPILOT_API_SERVER_LOCAL_PORT=str(port),
        HF_TOKEN=SECRETS["HF_TOKEN"],
        PYTHONPATH=str(REPO),
    )
    probe = (
        "import sys\n"
        "from rlx.cli import app\n"
        "try:\n"
        "    app(args=sys.argv[1:], prog_name='rlx')\n"
        "except SystemExit as exc:\n"
        "    print('EXIT', exc.code, 'SKY', 'sky' in sys.modules, file=sys.stderr)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe, "launch", str(GSM8K), "--backend", "sky"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert "EXIT 1 SKY False" in proc.stderr, proc.stderr
    assert_one_line_error(proc.stderr, "WANDB_API_KEY", "not set in your environment")
    assert not (home / ".sky").exists()
    assert server_pids(port) == []


# ------------------------------------------------------------------------- secrets


def places_holding(value: str, *roots: Path) -> list[str]:
    """Every file under `roots` that holds `value` in plain text, plus every row of a
    SkyPilot requests database whose (base64 + pickle) request body holds it."""
    needle = value.encode()
    found = []
    for root in roots:
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            if needle in path.read_bytes():
                found.append(str(path))
            if path.name == "requests.db":
                with sqlite3.connect(path) as db:
                    for (body,) in db.execute("SELECT request_body FROM requests"):
                        if body and needle in base64.b64decode(body):
                            found.append(f"{path.name}:request_body")
    return found


@pytest.mark.timeout(600)
def test_secret_values_are_written_nowhere(workdir: Path, sky_home: SkyHome):
    code, output = launch(str(GSM8K), "--backend", "sky")
    assert code == 1
    for value in SECRETS.values():
        assert value not in output
        assert places_holding(value, sky_home.home, workdir) == []
    # the rendered file that rlx keeps names the secrets, without values
    rendered = (workdir / ".rlx" / "rendered" / "gsm8k-grpo.sky.yaml").read_text()
    assert "HF_TOKEN: null" in rendered


@pytest.mark.timeout(600)
def test_secrets_reach_skypilot_and_only_its_request_store(
    workdir: Path, sky_home: SkyHome, write_recipe
):
    """When SkyPilot accepts the launch request (and only then fails for want of a cloud),
    the value has travelled to its API server, which keeps request bodies in its requests
    database. That must be the only place, and rlx's own files must not hold it."""
    text = QUICKSTART.read_text().replace("name: quickstart", "name: with-secret", 1)
    recipe = write_recipe(text + "\nsecrets: [HF_TOKEN]\n", "with-secret.yaml")
    code, output = launch(str(recipe), "--backend", "sky")
    assert code == 1
    # SkyPilot checks secret values before it looks for a cloud: had the value not arrived,
    # the answer would be "No value available for secret(s): HF_TOKEN".
    assert_one_line_error(output, "no cloud is enabled")
    assert SECRETS["HF_TOKEN"] not in output
    assert set(places_holding(SECRETS["HF_TOKEN"], sky_home.home)) <= {"requests.db:request_body"}
    assert places_holding(SECRETS["HF_TOKEN"], workdir) == []


# ------------------------------------------------------------------------- status / logs / down


@pytest.mark.timeout(600)
def test_operating_a_cluster_that_does_not_exist(workdir: Path):
    remember(Job("ghost", "sky", "ghost", str(GSM8K), "", extra={"job_id": "1"}), workdir)
    result = runner.invoke(app, ["status", "ghost"])
    assert result.exit_code == 0, result.output
    assert "UNKNOWN" in result.output and "no cluster ghost" in result.output
    for command in (["logs", "ghost"], ["logs", "ghost", "--node", "1"], ["down", "ghost"]):
        result = runner.invoke(app, command)
        assert result.exit_code == 1, (command, result.output)
        assert_one_line_error(result.output, "cluster ghost does not exist", "sky status ghost")


@pytest.mark.timeout(600)
def test_operating_a_managed_job_without_controller(workdir: Path):
    remember(Job("ghostjob", "sky", "7", str(GSM8K), "", extra={"managed": "1"}), workdir)
    result = runner.invoke(app, ["status", "ghostjob"])
    assert result.exit_code == 0, result.output
    assert "UNKNOWN" in result.output and "jobs controller not up" in result.output
    result = runner.invoke(app, ["down", "ghostjob"])
    assert result.exit_code == 1
    assert_one_line_error(result.output, "managed jobs controller is not up", "sky jobs queue")


# ------------------------------------------------------------------------- pure parts


def test_every_explained_error_is_a_skypilot_exception():
    sky_exceptions = pytest.importorskip("sky.exceptions")
    from rlx.launchers.sky.errors import ERRORS

    for key in ERRORS.lines:
        module, _, name = key.rpartition(".")
        assert module == "sky.exceptions"
        assert isinstance(getattr(sky_exceptions, name, None), type), f"no {key}"


def test_unknown_errors_get_a_generic_line():
    from rlx.launchers.sky.errors import ERRORS, Target

    line = ERRORS.explain(RuntimeError("\x1b[1mboom\x1b[0m\ndetails"), Target("c"))
    assert line == "SkyPilot failed: boom; run `sky check` or see `sky api logs`"


def test_node_filter_keeps_one_rank():
    from rlx.launchers.sky.ops import NodeFilter

    out = StringIO()
    sink = NodeFilter(1, out)
    sink.write("(head, rank=0, pid=11) step 1\n(worker1, rank=1, pid=12, ip=10.0.0.2) st")
    sink.write("ep 1\n\x1b[36m(worker1, rank=1, pid=12, ip=10.0.0.2)\x1b[0m done\n")
    sink.write("(worker11, rank=11, pid=13, ip=10.0.0.12) other\nJob finished\n")
    assert out.getvalue() == (
        "(worker1, rank=1, pid=12, ip=10.0.0.2) step 1\n"
        "\x1b[36m(worker1, rank=1, pid=12, ip=10.0.0.2)\x1b[0m done\n"
    )
    assert sink.shown == 2
