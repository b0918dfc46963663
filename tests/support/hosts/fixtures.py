"""pytest plugin: emulated hosts and a Slurm cluster as fixtures.

Load it from a conftest with `pytest_plugins = ["tests.support.hosts.fixtures"]` (or `-p
tests.support.hosts.fixtures`). Fixtures skip, with the reason, where the machine cannot provide
them (not root, no `ip netns`, Slurm not installed); where it can, they must work.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from types import FrameType

import pytest

from tests.support.hosts.netns import DEFAULT_PREFIX, Hosts, unavailable_reason
from tests.support.hosts.slurm import SlurmCluster, slurm_unavailable_reason

HostsFactory = Callable[..., Hosts]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "hosts: uses emulated hosts (root, iproute2, util-linux; see docs/testing.md)"
    )
    config.addinivalue_line(
        "markers", "slurm: uses a real Slurm cluster on emulated hosts (root, munge, slurm)"
    )


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_sessionstart(session: pytest.Session) -> None:
    # A CI timeout sends SIGTERM; as KeyboardInterrupt it still runs fixture finalizers,
    # so hosts and daemons are torn down instead of waiting for the next run's sweep.
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_interrupt)


def _skip_unless_hosts() -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture
def hosts_factory() -> Iterator[HostsFactory]:
    """Call with n (and a prefix) to get fresh hosts, closed after the test."""
    _skip_unless_hosts()
    made: list[Hosts] = []

    def make(n: int = 3, *, prefix: str = DEFAULT_PREFIX) -> Hosts:
        hosts = Hosts.create(n, prefix=prefix)
        made.append(hosts)
        return hosts

    yield make
    for hosts in reversed(made):
        hosts.close()


@pytest.fixture
def emulated_hosts(hosts_factory: HostsFactory) -> Hosts:
    """Three fresh emulated hosts: node1 (head, 10.77.S.11), node2, node3."""
    return hosts_factory(3)


@pytest.fixture(scope="session")
def slurm_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """One Slurm cluster (slurmctld here, slurmd on three hosts) for the whole session."""
    _skip_unless_hosts()
    reason = slurm_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    logs = tmp_path_factory.mktemp("slurm-logs")
    with Hosts.create(3) as hosts, SlurmCluster.start(hosts, logs) as cluster:
        yield cluster


@pytest.fixture
def slurm_cluster(slurm_session: SlurmCluster) -> Iterator[SlurmCluster]:
    """The session's Slurm cluster, with the queue emptied and nodes idle after the test."""
    yield slurm_session
    slurm_session.cancel_all()
    slurm_session.wait_idle()
