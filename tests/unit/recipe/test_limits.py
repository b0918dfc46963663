"""resources.max_duration, start_deadline and idle_minutes: what the model accepts, the one
line it gives for anything else, and the form the nodes read back."""

from __future__ import annotations

import pytest

from rlx.errors import RecipeError
from rlx.node.env import recipe_from_env, recipe_json
from rlx.recipe.load import parse_recipe
from rlx.recipe.model import IDLE_MINUTES, duration_seconds


def resources(lines: str):
    return parse_recipe(f"name: job\ncommand: [echo]\nresources:\n{lines}").recipe.resources


def refused(lines: str) -> str:
    with pytest.raises(RecipeError) as caught:
        resources(lines)
    (finding,) = caught.value.findings
    return finding.format()


def test_durations_are_a_number_and_a_unit():
    res = resources("  max_duration: 8h\n  start_deadline: 90m\n")
    assert duration_seconds(res.max_duration) == 8 * 3600
    assert duration_seconds(res.start_deadline) == 90 * 60
    assert duration_seconds("2d") == 2 * 86400 and duration_seconds("1w") == 7 * 86400


@pytest.mark.parametrize("value", ["-1h", "0m", "3600", "8 hours", "1h30m"])
def test_a_duration_that_is_not_one_is_one_line(value: str):
    line = refused(f"  start_deadline: {value!r}\n")
    assert line.startswith("<recipe>:4: error: resources.start_deadline: ")
    assert "is not a positive duration" in line and "'8h'" in line


def test_idle_minutes_default_and_by_name():
    assert resources("  nodes: 1\n").idle_minutes == IDLE_MINUTES == 30
    assert resources("  idle_minutes: 5\n").idle_minutes == 5
    assert resources("  idle_minutes: none\n").idle_minutes == "none"


@pytest.mark.parametrize("value", ["-5", "0", "null", "true", "forever", "2.5"])
def test_an_idle_limit_that_is_not_one_is_one_line(value: str):
    line = refused(f"  idle_minutes: {value}\n")
    assert line.startswith("<recipe>:4: error: resources.idle_minutes: ")
    assert "at least 1" in line and "none" in line


def test_the_nodes_read_back_the_same_recipe():
    plain = parse_recipe("name: job\ncommand: [echo]\n").recipe
    dumped = plain.model_dump(mode="json")["resources"]
    # unset limits stay out of the recipe the nodes read (so the goldens hold no new keys)
    assert not {"max_duration", "start_deadline", "idle_minutes"} & set(dumped)
    limited = parse_recipe(
        "name: job\ncommand: [echo]\nresources:\n  max_duration: 2d\n  start_deadline: 1h\n"
        "  idle_minutes: none\n"
    ).recipe
    assert recipe_from_env({"RLX_RECIPE_JSON": recipe_json(limited)}) == limited
    assert recipe_from_env({"RLX_RECIPE_JSON": recipe_json(plain)}) == plain
