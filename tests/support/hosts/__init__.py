"""Emulated hosts (namespaces on one machine) and a real Slurm cluster across them.

For tests: real multi-node Ray and Slurm runs with no cloud account. See docs/testing.md.
"""

from tests.support.hosts.env import backend_env
from tests.support.hosts.netns import Host, Hosts, HostsUnavailable, unavailable_reason
from tests.support.hosts.procs import HostProcess, HostProcessInfo, HostsError
from tests.support.hosts.slurm import SlurmCluster, SlurmJob, slurm_unavailable_reason

__all__ = [
    "Host",
    "HostProcess",
    "HostProcessInfo",
    "Hosts",
    "HostsError",
    "HostsUnavailable",
    "SlurmCluster",
    "SlurmJob",
    "backend_env",
    "slurm_unavailable_reason",
    "unavailable_reason",
]
