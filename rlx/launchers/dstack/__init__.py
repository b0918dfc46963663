"""dstack: render a task YAML (render.py, pure), operate runs through dstack's Python API
(ops.py), explain dstack's answers in one line (errors.py); checks.py holds its lint checks."""

from __future__ import annotations

from rlx.launchers.spec import BackendSpec

# A dstack network volume is one cloud disk (EBS, a persistent disk): one node attaches it.
# Several nodes get one each when its name carries the node's rank.
NODE_RANK = "${{ dstack.node_rank }}"


def per_node(name: str | None) -> bool:
    return name is not None and NODE_RANK.replace(" ", "") in name.replace(" ", "")


def _tunnel(run: str, remote: int, local: int) -> str:
    # `dstack attach` makes the run an ssh host of its name while it stays open.
    return f"dstack attach {run} (keep it open), then: ssh -N -L {local}:127.0.0.1:{remote} {run}"


BACKEND = BackendSpec(
    name="dstack",
    title="dstack",
    section="dstack",
    suffix=".dstack.yml",
    renders=True,
    launch_options=frozenset({"keep"}),
    checks="rlx.launchers.dstack.checks",
    restart_setting="dstack.retry",
    volumes_by_name=True,
    env_prefix="DSTACK_",
    tunnel_hint=_tunnel,
)
