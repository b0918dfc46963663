"""Local: the whole job on this machine, in the foreground, with a private Ray (the default).
render.py describes what would run (`rlx launch --dry-run`); ops.py runs and operates it."""

from __future__ import annotations

from rlx.launchers.spec import BackendSpec

BACKEND = BackendSpec(
    name="local",
    title="this machine",
    stays_up="nothing stays up after this run: its Ray and every process it starts end with it",
)
