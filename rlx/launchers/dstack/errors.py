"""dstack's answers as one line each: what happened and what to run next.

Errors are keyed by the exception's module and class name (no import of dstack needed here);
`no_capacity` words the server's verdict on a run that found no fleet.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rlx.launchers.ops_common import ErrorTable, one_line

FLEET_DOCS = "https://dstack.ai/docs/concepts/fleets"
VOLUME_DOCS = "https://dstack.ai/docs/concepts/volumes"
PROJECT_ADD = "`dstack project add --name NAME --url URL --token TOKEN`"


@dataclass(frozen=True)
class Target:
    """What an operation was about, for the error line."""

    run: str
    project: str = ""
    url: str = ""


def _client_error(exc: BaseException, target: Target) -> str:
    text = str(exc)
    if text.startswith("Failed to connect"):
        where = target.url or text.rsplit(" ", 1)[-1]
        return (
            f"dstack: cannot reach the server at {where}; start it with `dstack server`, or "
            f"point this client at yours with {PROJECT_ADD}"
        )
    if "denied" in text:
        return (
            f"dstack: the server at {target.url} refused the token for project "
            f"{target.project}; check it with `dstack project list` (or DSTACK_TOKEN)"
        )
    return f"dstack: {one_line(exc)}"


def _configuration(exc: BaseException, target: Target) -> str:
    text = one_line(exc)
    if "No default project" in text or "is not configured" in text:
        return (
            f"dstack: no project is configured; run {PROJECT_ADD} (or set DSTACK_SERVER_URL, "
            "DSTACK_TOKEN and DSTACK_PROJECT)"
        )
    return f"dstack: {text}"


def _not_found(exc: BaseException, target: Target) -> str:
    text = one_line(exc)
    volumes = re.match(r"Volume \[(.*)\] not found", text)
    if volumes:
        names = ", ".join(n.strip(" '\"") for n in volumes.group(1).split(","))
        return (
            f"dstack: volume {names} does not exist in project {target.project}; create it "
            f"(see {VOLUME_DOCS}, then `dstack apply -f VOLUME.yml`) or remove it from the "
            "recipe's volumes"
        )
    if text.startswith("Run"):
        return f"dstack: no run {target.run} in project {target.project}; see `dstack ps -a`"
    if text.startswith("Project"):
        return f"dstack: project {target.project} does not exist on {target.url} ({text})"
    return f"dstack: {text}; see `dstack ps -a`"


def _url_not_found(exc: BaseException, target: Target) -> str:
    if f"/api/project/{target.project}/" in str(exc):
        return (
            f"dstack: project {target.project} does not exist on {target.url}; pick one from "
            "`dstack project list` (or set DSTACK_PROJECT)"
        )
    return f"dstack: {target.url} does not answer like a dstack server ({one_line(exc)})"


def _server_refused(exc: BaseException, target: Target) -> str:
    return f"dstack: the server refused run {target.run}: {one_line(exc)}"


def _server_failed(exc: BaseException, target: Target) -> str:
    return f"dstack: the server at {target.url} failed ({one_line(exc)}); see its log"


EXPLAIN: dict[str, Callable[[BaseException, Target], str]] = {
    "dstack._internal.core.errors.ResourceNotExistsError": _not_found,
    "dstack._internal.core.errors.ServerClientError": _server_refused,
    "dstack._internal.core.errors.ServerError": _server_failed,
    "dstack._internal.core.errors.URLNotFoundError": _url_not_found,
    "dstack._internal.core.errors.ClientError": _client_error,
    "dstack._internal.core.errors.ConfigurationError": _configuration,
}


def _unknown(exc: BaseException, target: Target) -> str:
    return f"dstack failed: {one_line(exc)}; see `dstack ps -a` and the server's log"


ERRORS = ErrorTable(EXPLAIN, _unknown)


def no_capacity(nodes: int, fleets: Sequence[str], server_says: str, run: str = "") -> str:
    """The server found no instance for the run. In the fleet the job brought (named after
    it), no backend of the server offered what it asks for; for a multi-node task in no fleet
    the usual cause is that no fleet with `placement: cluster` exists (dstack places such
    tasks on fleets only)."""
    if run and list(fleets) == [run]:
        return (
            f"dstack: no offer can run this {nodes}-node job in its fleet {run} ({server_says}); "
            "see what the server's backends offer with `dstack offer`, or ask for other GPUs, "
            "places or spot"
        )
    if fleets:
        kind = "a fleet with placement: cluster" if nodes > 1 else "a fleet"
        return (
            f"dstack: fleet {', '.join(fleets)} (under dstack.fleets) cannot run this "
            f"{nodes}-node job ({server_says}); check it with `dstack fleet`, or create "
            f"{kind} (see {FLEET_DOCS})"
        )
    if nodes > 1:
        return (
            f"dstack: no fleet can run this {nodes}-node job; create a fleet with placement: "
            f"cluster (see {FLEET_DOCS}) or name one under dstack.fleets"
        )
    return (
        f"dstack: no fleet or offer can run this job ({server_says}); create a fleet (see "
        f"{FLEET_DOCS}) or check `dstack offer`"
    )
