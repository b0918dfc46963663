"""The README says what the CLI and the trainer do: its commands table names every command,
and its reward function example is one the trainer loads and scores with."""

from __future__ import annotations

import re

import typer.main

from rlx.cli import app
from rlx.trainer.tasks.rewards import resolve_reward
from tests.conftest import REPO

README = (REPO / "README.md").read_text()


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end != -1 else len(README)]


def test_the_commands_table_names_every_command() -> None:
    commands = set(typer.main.get_command(app).commands)  # type: ignore[attr-defined]
    rows = re.findall(r"^\| `rlx (\w+)", _section("Commands"), flags=re.MULTILINE)
    assert commands - set(rows) == set(), "commands missing from README's Commands table"
    assert set(rows) - commands == set(), "README's Commands table names unknown commands"


def test_the_reward_example_loads_and_scores(tmp_path, monkeypatch) -> None:
    example = re.search(r"```python\n# rewards\.py[^\n]*\n(.*?)```", README, flags=re.DOTALL)
    assert example is not None, "README's reward function example is gone"
    (tmp_path / "rewards.py").write_text(example.group(1))
    monkeypatch.chdir(tmp_path)
    fn = resolve_reward("rewards.py:ends_with_answer")
    assert fn("Q", "so it is 42", "42") == 1.0
    assert fn("Q", "so it is 41", "42") == 0.0
    assert fn("Q", "anything", None) == 0.0
