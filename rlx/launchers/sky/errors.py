"""SkyPilot's errors as one line each: what happened and what to run next.

Keyed by the exception's module and class name, so this table needs no import of sky (and
can be read and tested without it).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from rlx.launchers.ops_common import ErrorTable, one_line


@dataclass(frozen=True)
class Target:
    """What an operation was about, for the error line: a cluster or a managed job."""

    name: str  # cluster name, or managed job id
    managed: bool = False

    @property
    def what(self) -> str:
        return f"managed job {self.name}" if self.managed else f"cluster {self.name}"

    @property
    def see(self) -> str:
        return "`sky jobs queue`" if self.managed else f"`sky status {self.name}`"


CHECK = "run `sky check` to see which clouds are enabled and why"


def _no_cloud(exc: BaseException, target: Target) -> str:
    return "SkyPilot: no cloud is enabled for this job's resources; run `sky check` to enable one"


def _unavailable(exc: BaseException, target: Target) -> str:
    return (
        f"SkyPilot: no enabled cloud offers the resources this job asks for ({one_line(exc)}); "
        "check `sky check` and `sky show-gpus`, or change resources / sky.infra in the recipe"
    )


def _kube_unreachable(exc: BaseException, target: Target) -> str:
    return (
        f"SkyPilot: the Kubernetes API is unreachable ({one_line(exc)}); check your kubeconfig, "
        "then run `sky check kubernetes`"
    )


def _cloud_error(exc: BaseException, target: Target) -> str:
    text = str(exc)
    if "catalog" in text or "raw.githubusercontent.com" in text:
        return (
            "SkyPilot: cannot download its cloud catalog (no network access to "
            "raw.githubusercontent.com); check this machine's internet access, then run "
            "`sky check`"
        )
    provider = getattr(exc, "cloud_provider", "") or "the cloud"
    return f"SkyPilot: {provider} refused: {one_line(exc)}; {CHECK}"


def _credentials(exc: BaseException, target: Target) -> str:
    return f"SkyPilot: cloud credentials do not work ({one_line(exc)}); {CHECK}"


def _not_supported(exc: BaseException, target: Target) -> str:
    return (
        f"SkyPilot: not supported here: {one_line(exc)}; change resources or sky.infra in the "
        "recipe"
    )


def _server_url(exc: BaseException) -> str:
    found = re.search(r"API server at (\S+?)\.?(?:\s|$)", str(exc))
    return found.group(1) if found else "its configured endpoint"


def _server_unreachable(exc: BaseException, target: Target) -> str:
    return (
        f"SkyPilot: cannot reach the API server at {_server_url(exc)}; start a local one with "
        "`sky api start`, or log in to yours with `sky api login -e URL`"
    )


def _server_auth(exc: BaseException, target: Target) -> str:
    url = _server_url(exc)
    return f"SkyPilot: the API server at {url} wants a login; run `sky api login -e {url}`"


def _version_mismatch(exc: BaseException, target: Target) -> str:
    return (
        f"SkyPilot: client and API server versions differ ({one_line(exc)}); restart the local "
        "server with `sky api stop` (it starts again on the next call) or upgrade one side"
    )


def _volume_missing(exc: BaseException, target: Target) -> str:
    found = re.search(r"[Vv]olume '?([\w.-]+)'? not found", str(exc))
    volume = found.group(1) if found else "named in the recipe"
    return (
        f"SkyPilot: volume {volume} does not exist; create it first (`sky volumes apply "
        f"--name {volume} ...`, see `sky volumes apply --help`) or remove it from the "
        "recipe's volumes"
    )


def _volume_not_ready(exc: BaseException, target: Target) -> str:
    return f"SkyPilot: {one_line(exc)}; check it with `sky volumes ls`"


def _no_cluster(exc: BaseException, target: Target) -> str:
    return f"SkyPilot: {target.what} does not exist (already down?); see {target.see}"


def _cluster_not_up(exc: BaseException, target: Target) -> str:
    if target.managed:  # the cluster that is not up is the jobs controller
        return (
            f"SkyPilot: the managed jobs controller is not up ({one_line(exc)}), so "
            f"{target.what} is not running; see {target.see}"
        )
    return f"SkyPilot: {target.what} is not up ({one_line(exc)}); see {target.see}"


def _resources_mismatch(exc: BaseException, target: Target) -> str:
    return (
        f"SkyPilot: {target.what} already exists with other resources; stop it with "
        f"`sky down {target.name}` or launch with another --name"
    )


def _bad_cluster_name(exc: BaseException, target: Target) -> str:
    return f"SkyPilot: {one_line(exc)}; launch with another --name"


def _prechecks(exc: BaseException, target: Target) -> str:
    reasons = getattr(exc, "reasons", None) or [exc]
    return f"SkyPilot: provisioning pre-checks failed: {one_line(reasons[0])}; {CHECK}"


def _cancelled(exc: BaseException, target: Target) -> str:
    return f"SkyPilot: the request was cancelled ({one_line(exc)}); launch again if needed"


def _managed_state(exc: BaseException, target: Target) -> str:
    return f"SkyPilot: {target.what}: {one_line(exc)}; see {target.see}"


# Keyed by the exception's module and class name, so that this table needs no import of sky;
# subclasses are looked up along the class hierarchy (most specific first).
EXPLAIN: dict[str, Callable[[BaseException, Target], str]] = {
    "sky.exceptions.NoCloudAccessError": _no_cloud,
    "sky.exceptions.KubeAPIUnreachableError": _kube_unreachable,
    "sky.exceptions.ResourcesUnavailableError": _unavailable,
    "sky.exceptions.CloudError": _cloud_error,
    "sky.exceptions.InvalidCloudCredentials": _credentials,
    "sky.exceptions.InvalidCloudConfigs": _credentials,
    "sky.exceptions.CloudUserIdentityError": _credentials,
    "sky.exceptions.NotSupportedError": _not_supported,
    "sky.exceptions.ApiServerConnectionError": _server_unreachable,
    "sky.exceptions.ApiServerAuthenticationError": _server_auth,
    "sky.exceptions.APIVersionMismatchError": _version_mismatch,
    "sky.exceptions.VolumeNotFoundError": _volume_missing,
    "sky.exceptions.VolumeNotReadyError": _volume_not_ready,
    "sky.exceptions.ClusterDoesNotExist": _no_cluster,
    "sky.exceptions.ClusterNotUpError": _cluster_not_up,
    "sky.exceptions.ResourcesMismatchError": _resources_mismatch,
    "sky.exceptions.InvalidClusterNameError": _bad_cluster_name,
    "sky.exceptions.ProvisionPrechecksError": _prechecks,
    "sky.exceptions.RequestCancelled": _cancelled,
    "sky.exceptions.ManagedJobStatusError": _managed_state,
}


def _unknown(exc: BaseException, target: Target) -> str:
    return f"SkyPilot failed: {one_line(exc)}; run `sky check` or see `sky api logs`"


ERRORS = ErrorTable(EXPLAIN, _unknown)
