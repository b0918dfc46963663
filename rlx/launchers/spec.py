"""What a backend declares about itself (as TorchX schedulers declare their run options): its
name and file, the `rlx launch` options it takes, the recipe section it reads, the lint checks
that concern it, and the facts about it that checks and commands need (ports its own software
holds, the setting that restarts a job, how to reach a head's dashboard).

Each backend package's __init__ holds one BackendSpec named BACKEND and imports nothing
heavy: the CLI reads the specs to build its choices, so `rlx --help` stays instant.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

# Options of `rlx launch` that only some backends take: option -> what it does.
LAUNCH_OPTIONS = {
    "managed": "managed jobs that recover from preemption",
    "keep": "a cluster kept up with no trainer",
    "address": "submitting to a running Ray cluster",
    "detach": "submitting without following the job",
}


@dataclass(frozen=True)
class BackendSpec:
    name: str  # as in --backend
    title: str  # as users know it, for messages
    section: str | None = None  # the recipe's section of this backend's settings
    suffix: str = ""  # of the rendered file
    renders: bool = False  # `rlx render` writes a native file (else: launch describes the run)
    executable: bool = False  # the rendered file is a script to run
    launch_options: frozenset[str] = frozenset()  # of LAUNCH_OPTIONS
    checks: str | None = None  # module with this backend's lint CHECKS (imported by lint)
    restart_setting: str | None = None  # dotted recipe field that restarts a failed job
    volumes_by_name: bool = False  # attaches volumes by name (not by path)
    env_prefix: str | None = None  # the variables its software sets on the nodes
    ray_ports: Mapping[int, str] = field(default_factory=dict)  # held on every node: port -> what
    ray_worker_ports: range | None = None  # its own Ray's worker ports, held on every node
    can_attach: bool = False  # `rlx attach`: a shell in the job's allocation (ops.attach)
    forwards: bool = False  # `rlx tunnel` forwards the head's dashboard itself (ops.tunnel)
    # Else the command that forwards it, for the user to run: (job handle, remote, local).
    tunnel_hint: Callable[[str, int, int], str] | None = None
    # What is still up once a job ends, in one line `rlx launch` says, for a backend whose
    # rendered file does not say it (the native files' headers do).
    stays_up: str = ""

    def tunnel_command(self, job: str, handle: str, remote: int, local: int) -> str | None:
        """How to bring job `job`'s dashboard (port `remote` on its head) to local port
        `local`; None where a job of this backend has no remote dashboard."""
        if self.forwards:
            return f"rlx tunnel {job} --port {local}"
        return self.tunnel_hint(handle, remote, local) if self.tunnel_hint else None

    def takes(self, option: str) -> bool:
        return option in self.launch_options

    def restarts(self, recipe: object) -> str | None:
        """The recipe setting that makes this backend restart a failed job, when it is set."""
        if self.restart_setting is None:
            return None
        value: object = recipe
        for part in self.restart_setting.split("."):
            value = getattr(value, part, None)
            if value is None:
                return None
        return self.restart_setting if value else None
