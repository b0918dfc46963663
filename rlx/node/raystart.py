"""`ray start` through Ray's own CLI, less the command groups it never uses.

Ray's `ray` command imports its state, job and Serve command groups to register them (Serve's
pulls in pandas): about 2 CPU-s of every node start, where `ray start` itself needs 0.7. The
CLI registers each of those groups only if its import works, so this blocks the three imports
in this process alone (the daemons `ray start` leaves are processes of their own) and runs
the same `main` with the same arguments: `python -m rlx.node.raystart start --head ...`.
"""

from __future__ import annotations

import sys

UNUSED = ("ray.serve.scripts", "ray.dashboard.modules.job.cli", "ray.util.state.state_cli")


def block_unused() -> None:
    for name in UNUSED:
        sys.modules[name] = None  # type: ignore[assignment]  # import fails, CLI skips it


def main() -> int:
    block_unused()
    from ray.scripts.scripts import main as ray_main

    sys.argv[0] = "ray"
    return ray_main()


if __name__ == "__main__":
    sys.exit(main())
