"""Checks that secrets stay secrets: names only under secrets, no credential in env, no name
that the backends or rlx set themselves."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from rlx.launchers import specs
from rlx.lint.core import ERROR, Check, Problem
from rlx.recipe import Recipe

SECRET_WORDS = {"TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIALS", "APIKEY"}


SECRET_SUFFIXES = ("API_KEY", "ACCESS_KEY", "SECRET_KEY", "PRIVATE_KEY", "AUTH_KEY")


SECRET_LIKE_VALUE = re.compile(
    r"^(hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,}|gh[pousr]_[A-Za-z0-9]{20,}"
    r"|AKIA[0-9A-Z]{16}|xox[abp]-[A-Za-z0-9-]{10,})"
)

# The shapes of keys people paste, anywhere in a value: Hugging Face, OpenAI, GitHub (classic
# and fine-grained), AWS access key ids, Slack, and PEM private key blocks (a GCP service
# account's JSON holds one).
KEY_SHAPES = re.compile(
    r"(?<![A-Za-z0-9])(hf_[A-Za-z0-9]{30,}|sk-[A-Za-z0-9_-]{20,}|gh[pousr]_[A-Za-z0-9]{30,}"
    r"|github_pat_[A-Za-z0-9_]{40,}|(AKIA|ASIA)[0-9A-Z]{16}|xox[abposr]-[A-Za-z0-9-]{10,})"
    r"|-----BEGIN [A-Z ]*PRIVATE KEY-----"
)
# A value that is one long random-looking word: 32+ letters, digits and + / _ = - with at
# least 3.5 bits of entropy per character (a 40-hex W&B key has about 3.7; words, paths and
# version pins far less, and they hold dots, slashes or few distinct characters).
_TOKEN_LIKE = re.compile(r"[A-Za-z0-9+/=_-]{32,}")
ENTROPY_BITS = 3.5


def high_entropy(value: str) -> bool:
    """Whether the value looks like a generated key: one long token of random characters."""
    import math
    from collections import Counter

    if not _TOKEN_LIKE.fullmatch(value) or "/" in value.strip("/=+"):
        return False
    counts = Counter(value)
    bits = -sum(n / len(value) * math.log2(n / len(value)) for n in counts.values())
    return bits >= ENTROPY_BITS and any(c.isdigit() for c in value)


# A git commit or a content hash (40 or 64 hex digits) under a name that says so is a pin,
# not a key: GIT_COMMIT, MODEL_REVISION, DATA_SHA256.
_HEX_DIGEST = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
PIN_WORDS = {"SHA", "SHA1", "SHA256", "COMMIT", "REVISION", "REV", "HASH", "DIGEST", "CHECKSUM"}


def names_a_pin(name: str, value: str) -> bool:
    """Whether env NAME=VALUE is a commit or hash pinned by name, e.g. GIT_SHA=<40 hex>."""
    words = set(name.upper().split("_"))
    return (
        bool(_HEX_DIGEST.fullmatch(value))
        and bool(PIN_WORDS & words)
        and not _secret_like_name(name)
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
        elif (
            SECRET_LIKE_VALUE.match(value)
            or KEY_SHAPES.search(value)
            or (high_entropy(value) and not names_a_pin(name, value))
        ):
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


def _strings(node: Any, path: tuple[str | int, ...]) -> Iterator[tuple[tuple, str]]:
    if isinstance(node, str):
        yield path, node
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _strings(value, (*path, key))
    elif isinstance(node, list | tuple):
        for i, value in enumerate(node):
            yield from _strings(value, (*path, i))


def check_inline_keys(recipe: Recipe) -> Iterator[Problem]:
    """A key pasted anywhere else in the recipe (setup, a command, a URL, a path): it would
    travel in the rendered files and the job's logs. env and secrets are check_secrets_in_env's."""
    written = recipe.model_dump(exclude_unset=True, exclude={"env", "secrets"})
    for where, value in _strings(written, ()):
        if KEY_SHAPES.search(value):
            # Never echo it: it is most likely a real credential.
            yield Problem(
                where,
                ERROR,
                "this value holds what looks like a credential; remove it, list a name "
                "under secrets (e.g. HF_TOKEN), export it before launch and refer to it "
                "by that name ($HF_TOKEN in setup: or command:)",
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
    check_inline_keys,
    check_reserved_env,
]
