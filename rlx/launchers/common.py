"""Pieces every renderer shares. Everything here is pure: no clock, env, I/O or subprocess."""

from __future__ import annotations

import shlex
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import yaml

from rlx import __version__
from rlx.errors import RlxError
from rlx.node.env import RAY_TOKEN_SECRET, WHEEL_ENV
from rlx.recipe import Recipe

if TYPE_CHECKING:
    from rlx.lint.core import Check

# Minutes a job's machines stay up once it has ended, on backends that keep them otherwise
# (SkyPilot's autostop with down, dstack's idle_duration): SkyPilot's least.
ENDED_IDLE_MINUTES = 1

NOT_INSTALLED = "rlx: rlx is not installed on this node; add: pip install rlx[train] to setup"

# What rlx this node runs, to compare with the shipped wheel's version (which is the hash
# of rlx's files): the same hash when this rlx can compute it, else its package version.
NODE_RLX_VERSION = """\
rlx_have=$(python3 -c 'import importlib.metadata as m
try:
    from rlx.launchers.ship import shipped_version as v
except ImportError:
    v = lambda: m.version("rlx")
print(v())' 2>/dev/null || true)
"""

# Run on every node before `rlx node`: install the shipped wheel when this node's rlx is
# another version. A hand launch sets no RLX_WHEEL and uses the rlx that setup installed.
INSTALL_SHIPPED = (
    """\
if [ -n "${RLX_WHEEL:-}" ]; then
  rlx_wheel="${RLX_WHEEL/#\\~/$HOME}"
  rlx_want=$(basename "$rlx_wheel" | cut -d- -f2)
  """
    + NODE_RLX_VERSION
    + """\
  if [ "$rlx_have" != "$rlx_want" ]; then
    echo "rlx: installing the launching rlx $rlx_want (this node has ${rlx_have:-none})"
    python3 -m pip install --quiet --disable-pip-version-check "$rlx_wheel" || exit 1
  fi
  export RLX_WHEEL="$rlx_wheel"
fi
"""
)


def header_lines(recipe: Recipe, source: str, how_to_run: list[str]) -> list[str]:
    """Comment lines that head every rendered file."""
    lines = [
        f"Rendered by rlx {__version__} from {source} (recipe '{recipe.name}').",
        "Edit the recipe and render again rather than editing this file.",
        *how_to_run,
        f"rlx launch ships its own rlx (a wheel, {WHEEL_ENV}) to the nodes; launched by hand, "
        f"the nodes need rlx {__version__} installed by setup.",
    ]
    return [f"# {_printable(line)}".rstrip() for line in lines]


def _printable(text: str) -> str:
    # A recipe path with a newline in it must not end the comment it is quoted in.
    return "".join(c if c.isprintable() else "?" for c in text)


def secret_names(recipe: Recipe) -> list[str]:
    names = list(recipe.secrets)
    if recipe.ray.auth == "token":
        names.append(RAY_TOKEN_SECRET)
    return names


def setup_script(recipe: Recipe) -> str:
    """The recipe's setup commands as one bash script that stops at the first failure."""
    if not recipe.setup:
        return ""
    return "set -euo pipefail\n" + "\n".join(cmd.rstrip("\n") for cmd in recipe.setup) + "\n"


def node_command(backend: str) -> str:
    """The run block's body: check rlx is there, then hand over to the node bootstrap."""
    return INSTALL_SHIPPED + (
        "if ! command -v rlx >/dev/null 2>&1; then\n"
        f"  echo {shlex.quote(NOT_INSTALLED)} >&2\n"
        "  exit 127\n"
        "fi\n"
        f"exec rlx node --backend {backend}\n"
    )


class _Dumper(yaml.SafeDumper):
    """Block scalars for multi-line strings; never wrap long lines."""


def _str_representer(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    if "\n" in value:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|")
    return dumper.represent_scalar("tag:yaml.org,2002:str", value)


_Dumper.add_representer(str, _str_representer)


def dump_yaml(data: dict[str, Any]) -> str:
    return yaml.dump(
        data,
        Dumper=_Dumper,
        sort_keys=False,
        default_flow_style=False,
        allow_unicode=False,
        width=2**31 - 1,
    )


def drop_empty(data: dict[str, Any]) -> dict[str, Any]:
    """Leave out unset fields so the rendered file shows only what the recipe asks for."""
    return {k: v for k, v in data.items() if v not in (None, [], {}, "")}


def refuse(recipe: Recipe, checks: Iterable[Check]) -> None:
    """Raise RlxError with the first error of `checks`: what this backend cannot express is
    refused when it is rendered, in the words lint uses, whether or not the recipe has the
    backend's section (lint runs a backend's checks only when it has)."""
    from rlx.recipe.load import dotted

    for check in checks:
        for problem in check(recipe):
            if problem.severity == "error":
                raise RlxError(f"{dotted(problem.field)}: {problem.message}")
