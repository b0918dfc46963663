"""Reading a recipe file into a `Recipe`, with errors that point at the line to fix."""

from __future__ import annotations

import difflib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from rlx.errors import Finding, RecipeError, RlxError
from rlx.recipe.model import Recipe
from rlx.recipe.yamlpos import Path_, Positions, YamlError, load_yaml

# Keys people bring from SkyPilot and dstack files, and where they live in a recipe (named
# wherever they are written: at the top, under resources or under sky).
FAMILIAR_KEYS = {
    "num_nodes": "resources.nodes",
    "nodes": "resources.nodes",
    "accelerator": "resources.accelerators",
    "gpu": "resources.accelerators",
    "gpus": "resources.accelerators",
    "use_spot": "resources.spot",
    "network_tier": "resources.fabric",
    "image_id": "resources.image",
    "image": "resources.image",
    "envs": "env",
    "run": "command",
    "commands": "command",
    "entrypoint": "command",
}


@dataclass(frozen=True)
class LoadedRecipe:
    """A validated recipe and where its fields were written."""

    recipe: Recipe
    positions: Positions
    file: str

    def finding(self, path: Path_, severity: str, message: str) -> Finding:
        return Finding(self.file, self.positions.line_of(path), severity, dotted(path), message)


def dotted(path: Path_) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(recipe)"


def load_recipe(path: str | Path) -> LoadedRecipe:
    """Load and validate one recipe file; raise RecipeError with every problem found."""
    file = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RlxError(f"{file}: no such file; check the path to the recipe") from None
    except IsADirectoryError:
        raise RlxError(
            f"{file}: is a folder; give a recipe file (rlx lint takes folders)"
        ) from None
    except UnicodeDecodeError:
        raise RlxError(f"{file}: not UTF-8 text; save the recipe as UTF-8") from None
    except OSError as exc:
        raise RlxError(f"{file}: cannot read: {exc.strerror}") from None
    return parse_recipe(text, file)


def parse_recipe(text: str, file: str = "<recipe>") -> LoadedRecipe:
    try:
        data, positions = load_yaml(text)
    except YamlError as exc:
        raise RecipeError([Finding(file, exc.line, "error", "(recipe)", str(exc))]) from None
    if not isinstance(data, dict):
        raise RecipeError(
            [
                Finding(
                    file,
                    1,
                    "error",
                    "(recipe)",
                    "a recipe is a mapping of fields; start with e.g. "
                    "'name: my-job' (see `rlx schema`)",
                )
            ]
        )
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(_findings(exc, data, positions, file)) from None
    return LoadedRecipe(recipe, positions, file)


def _findings(exc: ValidationError, data: Any, positions: Positions, file: str) -> list[Finding]:
    seen: dict[Path_, Finding] = {}
    for error in exc.errors(include_url=False):
        path = _real_path(error["loc"], data, error["type"])
        if path in seen:  # several members of a union failed for the same value
            continue
        message = _message(error, path)
        seen[path] = Finding(file, positions.line_of(path), "error", dotted(path), message)
    return sorted(seen.values(), key=lambda f: (f.line, f.field))


def _real_path(loc: tuple[Any, ...], data: Any, kind: str) -> Path_:
    """Drop pydantic's union-member tags (e.g. 'literal[...]', 'str') from an error path."""
    path: list[str | int] = []
    node = data
    for i, part in enumerate(loc):
        last = i == len(loc) - 1
        if (isinstance(node, dict) and part in node) or (
            isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        ):
            path.append(part)
            node = node[part]
        elif last and kind == "missing":
            path.append(part)
        elif part == "[key]":  # the key itself of a mapping was invalid
            continue
    return tuple(path)


def _message(error: Any, path: Path_) -> str:
    kind, msg, given = error["type"], error["msg"], error.get("input")
    if kind == "extra_forbidden":
        return _unknown_key(str(path[-1]), _model_at(path[:-1]))
    if kind == "missing":
        return f"required field is missing; add '{path[-1]}:' (see `rlx schema`)"
    if msg.startswith("Value error, "):
        return msg.removeprefix("Value error, ")
    if kind in ("literal_error", "enum"):
        expected = error.get("ctx", {}).get("expected", "")
        hint = _closest(
            str(given), [s.strip(" '") for s in expected.replace(" or ", ",").split(",")]
        )
        return f"{given!r} is not allowed; write one of {expected}" + (
            f" (did you mean {hint!r}?)" if hint else ""
        )
    if isinstance(given, dict | list):
        return f"{msg}"
    return f"{msg}, got {given!r}"


def _unknown_key(key: str, model: type[BaseModel] | None) -> str:
    if model is None:
        return f"unknown field {key!r}"
    fields = sorted(model.model_fields)
    hint = _closest(key, fields)
    if hint:
        return f"unknown field {key!r}; did you mean {hint!r}?"
    if key in FAMILIAR_KEYS:
        return f"unknown field {key!r}; in a recipe this is '{FAMILIAR_KEYS[key]}'"
    return f"unknown field {key!r}; valid fields here: {', '.join(fields)}"


def _closest(word: str, options: list[str]) -> str | None:
    match = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return match[0] if match else None


def _model_at(path: Path_) -> type[BaseModel] | None:
    """The model class that validates the mapping at `path` (None if not a model)."""
    current: Any = Recipe
    for part in path:
        if isinstance(part, int):
            current = _list_item(current)
            continue
        model = _as_model(current)
        if model is None or part not in model.model_fields:
            return None
        current = model.model_fields[part].annotation
    return _as_model(current)


def _list_item(annotation: Any) -> Any:
    """X for list[X] or list[X] | None."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(candidate) is list:
            return typing.get_args(candidate)[0]
    return None


def _as_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            model = _as_model(arg)
            if model is not None:
                return model
    return None
