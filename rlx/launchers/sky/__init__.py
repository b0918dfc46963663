"""SkyPilot: render a task YAML (render.py, pure), operate it through SkyPilot's SDK (ops.py),
explain SkyPilot's errors in one line (errors.py); checks.py holds its lint checks."""

from __future__ import annotations

from rlx.launchers.spec import BackendSpec


def _tunnel(cluster: str, remote: int, local: int) -> str:
    # SkyPilot makes every cluster an ssh host of its name.
    return f"ssh -N -L {local}:127.0.0.1:{remote} {cluster}"


BACKEND = BackendSpec(
    name="sky",
    title="SkyPilot",
    section="sky",
    suffix=".sky.yaml",
    renders=True,
    launch_options=frozenset({"managed", "keep"}),
    checks="rlx.launchers.sky.checks",
    restart_setting="sky.recovery",
    volumes_by_name=True,
    env_prefix="SKYPILOT_",
    # SkyPilot runs its own Ray on every node of its clusters; rlx's must avoid its ports.
    ray_ports={
        6380: "SkyPilot's Ray GCS",
        8266: "SkyPilot's Ray dashboard",
        8076: "SkyPilot's Ray object manager",
        10001: "SkyPilot's Ray client server",
        52365: "SkyPilot's Ray dashboard agent",
    },
    ray_worker_ports=range(11002, 20000),
    tunnel_hint=_tunnel,
)
