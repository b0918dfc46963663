"""Ray Jobs client errors as one line each: what happened and what to do.

Keyed by the exception's module and class name, so the table needs no import of ray.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from rlx.launchers.ops_common import ErrorTable, one_line


@dataclass(frozen=True)
class Target:
    """What an operation was about: the dashboard address and, once known, the job."""

    address: str
    job: str = ""

    @property
    def what(self) -> str:
        return f"Ray job {self.job} at {self.address}" if self.job else self.address


TUNNEL = "is the tunnel to its dashboard open (the command `rlx launch --keep` printed)?"


def _unreachable(exc: BaseException, target: Target) -> str:
    return f"Ray: cannot reach the dashboard at {target.address}; {TUNNEL}"


def _auth(exc: BaseException, target: Target) -> str:
    if "401" in str(exc) or "Authentication required" in str(exc):
        return (
            f"Ray: {target.address} requires a token; export RAY_AUTH_TOKEN with the cluster's "
            "token (for a cluster rlx keeps: RAY_AUTH_TOKEN=$(cat .rlx/tokens/NAME))"
        )
    return (
        f"Ray: {target.address} refused the token in RAY_AUTH_TOKEN; export the token of "
        "that cluster (for a cluster rlx keeps: .rlx/tokens/NAME)"
    )


def _request_failed(exc: BaseException, target: Target) -> str:
    text = str(exc)
    if "status code 404" in text and target.job:
        return f"Ray: no job {target.job} on {target.address} (it may have been deleted)"
    match = re.search(r"status code (\d+)", text)
    code = f" (HTTP {match.group(1)})" if match else ""
    return f"Ray: the dashboard at {target.address} refused the request{code}: {one_line(exc)}"


def _value(exc: BaseException, target: Target) -> str:
    if "exceeds the maximum size" in str(exc):
        return (
            f"Ray: the working dir is too large to upload ({one_line(exc)}); exclude big files "
            "with a .rayignore or .gitignore there, or put data on a volume"
        )
    return f"Ray: {one_line(exc)}"


EXPLAIN: dict[str, Callable[[BaseException, Target], str]] = {
    "builtins.ConnectionError": _unreachable,
    "requests.exceptions.ConnectionError": _unreachable,
    "ray.exceptions.AuthenticationError": _auth,
    "builtins.RuntimeError": _request_failed,
    "builtins.ValueError": _value,
}


def _unknown(exc: BaseException, target: Target) -> str:
    return f"Ray: {target.what}: {one_line(exc)}"


ERRORS = ErrorTable(EXPLAIN, _unknown)
