"""Recipes for trainer tests: the quickstart task, small enough for a CPU test."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from rlx.recipe import parse_recipe
from rlx.recipe.model import Recipe, TrainerSettings


def shipped_recipe_data(source: str, **changes: Any) -> dict[str, Any]:
    """A shipped recipe's YAML as data, with dotted fields changed (a__b=value; None removes
    the field)."""
    from tests.conftest import RECIPES

    data = yaml.safe_load((RECIPES / source).read_text())
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        node = data
        for key in parents:
            node = node.setdefault(key, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return data


def write_shipped_variant(tmp_path: Path, source: str, **changes: Any) -> Path:
    """shipped_recipe_data written to a new file under tmp_path."""
    path = tmp_path / f"{source.removesuffix('.yaml')}-{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text(yaml.safe_dump(shipped_recipe_data(source, **changes), sort_keys=False))
    return path


def trainer_section(tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    """The quickstart's trainer settings with outputs under tmp_path; nested dicts merge."""
    section: dict[str, Any] = {
        "algorithm": "grpo",
        "model": {"path": "tiny:qwen2-h64-l2", "dtype": "float32"},
        "data": {"train": "synthetic:letters_or_digits", "max_prompt_length": 64},
        "reward": {"function": "letters_or_digits"},
        "rollout": {"engine": "hf", "n": 16, "max_new_tokens": 32},
        "algo": {"kl": {"coef": 0.0}},
        "optim": {"lr": 2.0e-3},
        "batch": {"prompts_per_step": 4, "micro_batch_size": 64},
        "steps": 3,
        "seed": 0,
        "logging": {"dir": str(tmp_path / "runs"), "tensorboard": False},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(section.get(key), dict):
            section[key] = {**section[key], **value}
        else:
            section[key] = value
    return section


def recipe_dict(tmp_path: Path, name: str = "trainer-test", **overrides: Any) -> dict[str, Any]:
    return {"name": name, "trainer": trainer_section(tmp_path, **overrides)}


def make_recipe(tmp_path: Path, name: str = "trainer-test", **overrides: Any) -> Recipe:
    text = yaml.safe_dump(recipe_dict(tmp_path, name, **overrides))
    return parse_recipe(text, f"{name}.yaml").recipe


def write_recipe(tmp_path: Path, name: str = "trainer-test", **overrides: Any) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe_dict(tmp_path, name, **overrides)))
    return path


def small_trainer(tmp_path: Path, **overrides: Any) -> TrainerSettings:
    """The trainer section of a small GRPO recipe (4 prompts x 4 samples of at most 12
    tokens, one micro-batch), with section-wise overrides: what the Learner tests build."""
    base: dict[str, Any] = {
        "rollout": {"n": 4, "max_new_tokens": 12},
        "batch": {"prompts_per_step": 4, "micro_batch_size": 16},
    }
    for key, value in overrides.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    trainer = make_recipe(tmp_path, **base).trainer
    assert trainer is not None
    return trainer
