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
    # Several members of a union fail for one value (bool and 'auto'): one finding per place.
    by_path: dict[Path_, list[Any]] = {}
    for error in exc.errors(include_url=False):
        by_path.setdefault(_real_path(error["loc"], data, error["type"]), []).append(error)
    findings = [
        Finding(file, positions.line_of(path), "error", dotted(path), _message(errors, path))
        for path, errors in by_path.items()
    ]
    return sorted(findings, key=lambda f: (f.line, f.field))


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


# Pydantic's errors for a value of the right kind outside its bounds (0 where 1 or more is
# wanted): they say more than "not allowed" would.
_BOUND_ERRORS = {
    "greater_than",
    "greater_than_equal",
    "less_than",
    "less_than_equal",
    "multiple_of",
    "too_short",
    "too_long",
    "string_too_short",
    "string_too_long",
}


def _message(errors: list[Any], path: Path_) -> str:
    """One line for the errors pydantic gave at one place (one per union member)."""
    error = next((e for e in errors if e["msg"].startswith("Value error, ")), None)
    error = error or next((e for e in errors if e["type"] in _BOUND_ERRORS), errors[0])
    kind, msg, given = error["type"], error["msg"], error.get("input")
    if kind == "extra_forbidden":
        return _unknown_key(str(path[-1]), _model_at(path[:-1]))
    if kind == "missing":
        return f"required field is missing; add '{path[-1]}:' (see `rlx schema`)"
    if msg.startswith("Value error, "):
        return msg.removeprefix("Value error, ")
    choices = _choices(_annotation_at(path))
    if choices is not None and kind in _BOUND_ERRORS:  # the number is wrong, not its kind
        fixed = [c for c in choices if c.startswith("'")]
        return f"{msg}, got {given!r}" + (f"; or write {_listed(fixed)}" if fixed else "")
    if choices is not None:
        words = [c.strip("'") for c in choices if not c.startswith(("a ", "an "))]
        hint = _closest(str(given), words) if isinstance(given, str | bool) else None
        return f"{_written(given)} is not allowed; write {_listed(choices)}" + (
            f" (did you mean {hint!r}?)" if hint else ""
        )
    if kind in ("literal_error", "enum"):  # a place whose annotation is not found
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


def _listed(choices: list[str]) -> str:
    """'a', 'b' or 'c' ("one of" them when all are values to copy)."""
    text = choices[0] if len(choices) == 1 else f"{', '.join(choices[:-1])} or {choices[-1]}"
    values = all(c.startswith("'") or c in ("true", "false") for c in choices)
    return f"one of {text}" if values and len(choices) > 1 else text


def _written(value: Any) -> str:
    """A value as the recipe's YAML writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return repr(value)


def _choices(annotation: Any) -> list[str] | None:
    """What an enum-like field takes, as a recipe writes it ('auto', true, a whole number
    of 1 or more, ...); None for a field with no fixed values among them."""
    members = [m for m in _members(annotation) if m is not type(None)]
    if len(members) == 1 and typing.get_origin(members[0]) is list:
        item = _choices(typing.get_args(members[0])[0])
        return None if item is None else [f"a list of {_listed(item).removeprefix('one of ')}"]
    if not any(typing.get_origin(m) is typing.Literal for m in members):
        return None
    out: list[str] = []
    for member in members:
        if typing.get_origin(member) is typing.Literal:
            out.extend(_written(v) for v in typing.get_args(member))
        else:
            out.extend(_kind(member))
    return out


def _members(annotation: Any) -> list[Any]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _members(arg)]
    return [annotation]


def _kind(annotation: Any) -> list[str]:
    """How a recipe writes a value of a non-literal union member."""
    bounds: list[str] = []
    if typing.get_origin(annotation) is typing.Annotated:
        base, *extras = typing.get_args(annotation)
        for extra in extras:
            for rule in getattr(extra, "metadata", [extra]):
                bounds.extend(_bound(rule))
        annotation = base
    named = {bool: ["true", "false"], int: ["a whole number"], float: ["a number"]}
    if annotation in named:
        words = named[annotation]
        return [f"{words[0]} ({' and '.join(bounds)})"] if bounds else words
    if typing.get_origin(annotation) is list:
        return ["a list of names"]
    if annotation is str:
        return ["a string"]
    return [f"a {getattr(annotation, '__name__', annotation)}"]


def _bound(rule: Any) -> list[str]:
    for attr, words in (
        ("ge", "{} or more"),
        ("gt", "above {}"),
        ("le", "at most {}"),
        ("lt", "below {}"),
    ):
        value = getattr(rule, attr, None)
        if value is not None:
            return [words.format(value)]
    return []


def _annotation_at(path: Path_) -> Any:
    """The annotation of the field at `path` (of a list's item for an index); None when the
    place is not a model's field."""
    current: Any = Recipe
    for part in path:
        if isinstance(part, int):
            current = _list_item(current)
            continue
        model = _as_model(current)
        if model is None or part not in model.model_fields:
            return None
        current = model.model_fields[part].annotation
    return current


def _unknown_key(key: str, model: type[BaseModel] | None) -> str:
    if model is None:
        return f"unknown field {key!r}"
    fields = sorted(model.model_fields)
    if key in FAMILIAR_KEYS:  # known, where a near name may mislead (gpus is not cpus)
        return f"unknown field {key!r}; in a recipe this is '{FAMILIAR_KEYS[key]}'"
    hint = _closest(key, fields)
    if hint:
        return f"unknown field {key!r}; did you mean {hint!r}?"
    return f"unknown field {key!r}; valid fields here: {', '.join(fields)}"


def _closest(word: str, options: list[str]) -> str | None:
    match = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return match[0] if match else None


def _model_at(path: Path_) -> type[BaseModel] | None:
    """The model class that validates the mapping at `path` (None if not a model)."""
    return _as_model(_annotation_at(path))


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
