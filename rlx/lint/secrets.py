"""Checks that secrets stay secrets: names only under secrets, no credential in env, no name
that the backends or rlx set themselves."""

from __future__ import annotations

import re
from collections.abc import Iterator

from rlx.launchers import specs
from rlx.lint.core import ERROR, Check, Problem
from rlx.recipe import Recipe

SECRET_WORDS = {"TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIALS", "APIKEY"}


SECRET_SUFFIXES = ("API_KEY", "ACCESS_KEY", "SECRET_KEY", "PRIVATE_KEY", "AUTH_KEY")


SECRET_LIKE_VALUE = re.compile(
    r"^(hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,}|gh[pousr]_[A-Za-z0-9]{20,}"
    r"|AKIA[0-9A-Z]{16}|xox[abp]-[A-Za-z0-9-]{10,})"
)


def _reserved_prefixes() -> tuple[str, ...]:
    """Prefixes of the variables the backends' software and rlx set on the nodes."""
    return (*(b.env_prefix for b in specs() if b.env_prefix), "RLX_")


def _secret_like_name(name: str) -> bool:
    """HF_TOKEN or WANDB_API_KEY, but not TOKENIZERS_PARALLELISM."""
    upper = name.upper()
    return bool(SECRET_WORDS & set(upper.split("_"))) or upper.endswith(SECRET_SUFFIXES)


def check_secrets_in_env(recipe: Recipe) -> Iterator[Problem]:
    for i, name in enumerate(recipe.secrets):
        if SECRET_LIKE_VALUE.match(name):
            # Never echo it: it is most likely a real credential.
            yield Problem(
                ("secrets", i),
                ERROR,
                f"entry {i} looks like a credential, not a "
                "name; list secret NAMES only (e.g. HF_TOKEN) and revoke that one",
            )
    for name, value in recipe.env.items():
        where = ("env", name)
        if name in recipe.secrets:
            yield Problem(
                where,
                ERROR,
                f"{name} is listed under secrets; remove its value "
                "from env (secret values are read from your environment at launch)",
            )
        elif SECRET_LIKE_VALUE.match(value):
            yield Problem(
                where,
                ERROR,
                "this value looks like a credential; remove it, "
                f"list '{name}' under secrets and export it before launch",
            )
        elif _secret_like_name(name) and value:
            yield Problem(
                where,
                ERROR,
                f"{name} looks like a secret written in plain text; "
                "list the name under secrets and export the value before launch",
            )
        if "${{" in value:
            yield Problem(
                where,
                ERROR,
                "'${{ ... }}' is dstack interpolation and is passed "
                "literally here; list the variable under secrets instead",
            )


def check_reserved_env(recipe: Recipe) -> Iterator[Problem]:
    for name in [*recipe.env, *recipe.secrets]:
        section = "env" if name in recipe.env else "secrets"
        where = (section, name) if section == "env" else (section,)
        if name.startswith(_reserved_prefixes()) or name in (
            "RAY_ADDRESS",
            "RAY_AUTH_TOKEN",
            "RAY_AUTH_MODE",
        ):
            yield Problem(where, ERROR, f"{name} is set by the backend or by rlx; remove it")


CHECKS: list[Check] = [
    check_secrets_in_env,
    check_reserved_env,
]
