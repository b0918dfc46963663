"""YAML loading that remembers where every key and value came from.

Recipes are small, so we compose the node graph once and convert it ourselves: that gives
a line for every field path, rejects duplicate keys (PyYAML silently keeps the last one),
and resolves scalars the YAML 1.2 way: `no`, `on` and `off` stay strings and `1:00:00`
(a Slurm time) is not read as the integer 3600.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import yaml

Path_ = tuple[str | int, ...]

# YAML 1.2 core schema for plain scalars.
_INT = re.compile(r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+")
_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")
_SPECIAL_FLOATS = {
    ".inf": float("inf"),
    "+.inf": float("inf"),
    "-.inf": float("-inf"),
    ".nan": float("nan"),
}
_BOOL = {"true": True, "false": False}
_NULL = {"", "~", "null"}
# Tags PyYAML may resolve plain scalars to; anything else (!!python/..., custom !tags) is
# refused rather than silently read as text.
_SCALAR_TAGS = {
    f"tag:yaml.org,2002:{name}"
    for name in ("str", "int", "float", "bool", "null", "timestamp", "value")
}
_COLLECTION_TAGS = {"tag:yaml.org,2002:map", "tag:yaml.org,2002:seq"}


class YamlError(ValueError):
    """A file that is not valid YAML; carries the 1-based line of the problem."""

    def __init__(self, message: str, line: int):
        super().__init__(message)
        self.line = line


@dataclass
class Positions:
    """Maps a field path (keys and list indices) to the 1-based line it was written on."""

    lines: dict[Path_, int] = field(default_factory=dict)

    def line_of(self, path: Path_) -> int:
        """The line of `path`, or of its nearest written ancestor (a missing field points at
        the section that should hold it)."""
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return self.lines.get((), 1)


def _scalar(node: yaml.ScalarNode) -> Any:
    if node.tag not in _SCALAR_TAGS:
        raise YamlError(f"unsupported YAML tag {node.tag!r}", node.start_mark.line + 1)
    value = node.value
    if node.style:  # quoted or block scalars are strings, whatever they look like
        return value
    lowered = value.lower()
    if lowered in _NULL:
        return None
    if lowered in _BOOL and value in (lowered, lowered.capitalize(), lowered.upper()):
        return _BOOL[lowered]
    if _INT.fullmatch(value):
        if value.startswith(("0o", "0x")):
            return int(value, 0)
        return int(value, 10)
    if _FLOAT.fullmatch(value):
        return float(value)
    if lowered in _SPECIAL_FLOATS:
        return _SPECIAL_FLOATS[lowered]
    return value


def _convert(node: yaml.Node, path: Path_, pos: Positions) -> Any:
    pos.lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.ScalarNode):
        return _scalar(node)
    if isinstance(node, yaml.SequenceNode | yaml.MappingNode) and node.tag not in _COLLECTION_TAGS:
        raise YamlError(f"unsupported YAML tag {node.tag!r}", node.start_mark.line + 1)
    if isinstance(node, yaml.SequenceNode):
        return [_convert(item, (*path, i), pos) for i, item in enumerate(node.value)]
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise YamlError("mapping keys must be plain scalars", key_node.start_mark.line + 1)
            key = key_node.value
            if key == "<<":
                raise YamlError(
                    "YAML merge keys (<<) are not supported in recipes; write the fields out",
                    key_node.start_mark.line + 1,
                )
            if key in out:
                first = pos.lines.get((*path, key), 0)
                raise YamlError(
                    f"duplicate key {key!r} (first written on line {first}); keep one",
                    key_node.start_mark.line + 1,
                )
            pos.lines[(*path, key)] = key_node.start_mark.line + 1
            out[key] = _convert(value_node, (*path, key), pos)
        return out
    raise YamlError(f"unsupported YAML node {type(node).__name__}", node.start_mark.line + 1)


def load_yaml(text: str) -> tuple[Any, Positions]:
    """Parse one YAML document into plain Python values plus the line of every field."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 1
        problem = exc.problem or exc.context or "invalid YAML"
        raise YamlError(f"invalid YAML: {problem}", line) from None
    except yaml.YAMLError as exc:  # e.g. several documents in one file
        raise YamlError(f"invalid YAML: {exc}", 1) from None
    pos = Positions()
    if node is None:
        return None, pos
    return _convert(node, (), pos), pos
