"""A schema error is one line per field, and a field with fixed values lists all it takes
(its fixed values and the kinds of value beside them: true/false, a number, a list)."""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from rlx.errors import RecipeError
from rlx.recipe import parse_recipe
from rlx.recipe.model import Recipe

TRAINER = {"model": {"path": "Qwen/Qwen2.5-0.5B"}, "data": {"train": "data.jsonl"}}


def _errors(**sections: Any) -> dict[str, str]:
    """{field: message} of the recipe with these sections over a minimal one."""
    data: dict[str, Any] = {"name": "job", "trainer": dict(TRAINER)}
    for name, section in sections.items():
        if name == "trainer":
            data["trainer"].update(section)
        else:
            data[name] = section
    with pytest.raises(RecipeError) as refusal:
        parse_recipe(yaml.safe_dump(data))
    return {f.field: f.message for f in refusal.value.findings}


CASES = [
    (
        {"resources": {"spot": "maybe"}},
        "resources.spot",
        "'maybe' is not allowed; write one of true, false or 'auto'",
    ),
    (
        {"resources": {"spot": "Auto"}},
        "resources.spot",
        "'Auto' is not allowed; write one of true, false or 'auto' (did you mean 'auto'?)",
    ),
    (
        {"trainer": {"rollout": {"tensor_parallel_size": "two"}}},
        "trainer.rollout.tensor_parallel_size",
        "'two' is not allowed; write a whole number (1 or more) or 'auto'",
    ),
    (
        {"trainer": {"rollout": {"tensor_parallel_size": 0}}},
        "trainer.rollout.tensor_parallel_size",
        "Input should be greater than or equal to 1, got 0; or write 'auto'",
    ),
    (
        {"trainer": {"rollout": {"gpu_memory_utilization": "most"}}},
        "trainer.rollout.gpu_memory_utilization",
        "'most' is not allowed; write a number (above 0 and at most 1) or 'auto'",
    ),
    (
        {"trainer": {"rollout": {"gpu_memory_utilization": 1.5}}},
        "trainer.rollout.gpu_memory_utilization",
        "Input should be less than or equal to 1, got 1.5; or write 'auto'",
    ),
    (
        {"trainer": {"batch": {"micro_batch_size": "max"}}},
        "trainer.batch.micro_batch_size",
        "'max' is not allowed; write a whole number (1 or more) or 'auto'",
    ),
    (
        {"trainer": {"algo": {"rollout_correction": {"on": "maybe"}}}},
        "trainer.algo.rollout_correction.on",
        "'maybe' is not allowed; write one of 'auto', true or false",
    ),
    (
        {"trainer": {"model": {**TRAINER["model"], "lora": {"rank": 8, "target_modules": "all"}}}},
        "trainer.model.lora.target_modules",
        "'all' is not allowed; write 'all-linear' or a list of names",
    ),
    (
        {"dstack": {"retry": {"on_events": "error"}}},
        "dstack.retry.on_events",
        "'error' is not allowed; write a list of 'no-capacity', 'interruption' or 'error'",
    ),
    (
        {"dstack": {"retry": {"on_events": ["no-capacity", "interupt"]}}},
        "dstack.retry.on_events[1]",
        "'interupt' is not allowed; write one of 'no-capacity', 'interruption' or 'error' "
        "(did you mean 'interruption'?)",
    ),
    (
        {"resources": {"fabric": True}},
        "resources.fabric",
        "true is not allowed; write one of 'efa', 'infiniband' or 'tcp'",
    ),
    (
        {"trainer": {"algorithm": "gpro"}},
        "trainer.algorithm",
        "'gpro' is not allowed; write one of 'grpo', 'ppo', 'rloo' or 'reinforce_pp' (did you "
        "mean 'grpo'?)",
    ),
]


@pytest.mark.parametrize("sections,field,message", CASES, ids=[c[1] for c in CASES])
def test_the_line_lists_what_the_field_takes(sections, field, message):
    assert _errors(**sections) == {field: message}


# ----------------------------------------------------------------- every enum-like field


def _literals(annotation: Any) -> list[Any]:
    """The fixed values among a field's union members (a list's items included)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return list(typing.get_args(annotation))
    if origin in (list, typing.Union, types.UnionType):
        return [v for arg in typing.get_args(annotation) for v in _literals(arg)]
    return []


def _enum_fields(model: type[BaseModel], path: tuple[str, ...]) -> Iterator[tuple]:
    for name, field in model.model_fields.items():
        annotation = field.annotation
        members = (annotation, *typing.get_args(annotation))
        nested = [m for m in members if isinstance(m, type) and issubclass(m, BaseModel)]
        if nested:
            yield from _enum_fields(nested[0], (*path, name))
        elif _literals(annotation) and not _any_string(annotation):
            yield (*path, name), _literals(annotation)


def _any_string(annotation: Any) -> bool:
    """Whether a plain string is among the members (checkpoint.resume: 'auto' or a path)."""
    if typing.get_origin(annotation) is typing.Annotated:
        return _any_string(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_any_string(arg) for arg in typing.get_args(annotation))
    return annotation is str


ENUM_FIELDS = list(_enum_fields(Recipe, ()))


# The fields a section needs beside the one under test.
REQUIRED = {"lora": {"rank": 8}, "critic_model": {"path": "x"}, "container": {"image": "x"}}


def test_the_sweep_finds_the_enum_like_fields():
    names = {".".join(path) for path, _ in ENUM_FIELDS}
    assert {"resources.spot", "trainer.algorithm", "dstack.retry.on_events"} <= names
    assert len(ENUM_FIELDS) >= 30


@pytest.mark.parametrize("path,values", ENUM_FIELDS, ids=[".".join(p) for p, _ in ENUM_FIELDS])
def test_every_enum_like_field_lists_its_values(path, values):
    data: dict[str, Any] = {"name": "job", "trainer": dict(TRAINER)}
    node = data
    for part in path[:-1]:
        node = node.setdefault(part, {})
        node.update(REQUIRED.get(part, {}))
    node[path[-1]] = "not-a-value"
    with pytest.raises(RecipeError) as refusal:
        parse_recipe(yaml.safe_dump(data))
    message = {f.field: f.message for f in refusal.value.findings}[".".join(path)]
    assert message.startswith("'not-a-value' is not allowed; write "), message
    for value in values:
        written = {True: "true", False: "false"}.get(value, repr(value))
        assert written in message, (value, message)
