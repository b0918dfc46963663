"""trainer.environment in lint: the spec's form, a file spec's class read from its source
(never imported), an episode within the model's context and holding a first turn, and a
reward written beside an environment. environment_problems() is the trainer's rule too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from rlx.cli import app
from rlx.lint import ERROR, WARNING, Problem, all_checks, lint_file
from rlx.lint.environment import (
    PROBE_TOKENS,
    check_environment,
    check_reward_beside_environment,
    environment_problems,
)
from rlx.recipe import load_recipe, parse_recipe
from rlx.recipe.model import TrainerSettings, episode_token_budget

runner = CliRunner()

BASE: dict[str, Any] = {
    "name": "tools",
    "resources": {"nodes": 1},
    "trainer": {
        "algorithm": "grpo",
        "model": {"path": "tiny:qwen2-h64-l2", "dtype": "float32"},
        "data": {"train": "synthetic:tool_lookup", "max_prompt_length": 64},
        "environment": {"function": "tool_lookup", "max_turns": 3},
        "rollout": {"engine": "hf", "n": 4, "max_new_tokens": 16},
        "batch": {"prompts_per_step": 8, "micro_batch_size": 4},
    },
}

GAME_OK = """\
class Game:
    def reset(self, row):
        self.answer = row.answer

    async def step(self, turn):
        return {"reward": 1.0, "done": True}
"""


def _recipe(tmp_path: Path, **trainer: Any) -> Path:
    """BASE with these trainer sections replaced (None removes one), written to a file."""
    data = yaml.safe_load(yaml.safe_dump(BASE))
    for key, value in trainer.items():
        if value is None:
            data["trainer"].pop(key, None)
        else:
            data["trainer"][key] = value
    path = tmp_path / f"recipe-{len(list(tmp_path.glob('recipe-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def _settings(**trainer: Any) -> TrainerSettings:
    data = yaml.safe_load(yaml.safe_dump(BASE["trainer"]))
    data.update(trainer)
    return TrainerSettings.model_validate(data)


def _env(function: str, **more: Any) -> dict[str, Any]:
    return {"function": function, "max_turns": 3, **more}


def _messages(settings: TrainerSettings, base_dir: Path, **kw: Any) -> list[tuple[str, str, str]]:
    return [
        (".".join(map(str, p.field)), p.severity, p.message)
        for p in environment_problems(settings, base_dir, **kw)
    ]


def test_lint_runs_the_environment_checks():
    assert {check_environment, check_reward_beside_environment} <= set(all_checks())


def test_no_environment_no_problems(tmp_path: Path):
    assert environment_problems(_settings(environment=None), tmp_path) == []


@pytest.mark.parametrize("spec", ["tool_lookup", "calculator", "no_such_pkg.envs:Game"])
def test_builtins_and_modules_pass_without_an_import(spec: str, tmp_path: Path):
    # A module spec is only read for its form, as a module reward is: nothing imports it.
    assert environment_problems(_settings(environment=_env(spec)), tmp_path) == []


def test_unknown_name_is_one_line_with_its_line(tmp_path: Path):
    path = _recipe(tmp_path, environment=_env("calculater"))
    result = runner.invoke(app, ["lint", str(path)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    line = next(
        n for n, text in enumerate(path.read_text().splitlines(), 1) if "calculater" in text
    )
    assert (
        f"{path}:{line}: error: trainer.environment.function: unknown environment "
        "'calculater'; valid: calculator, tool_lookup, or a class as 'package.module:Class' "
        "or 'path/to/file.py:Class'"
    ) in result.output.splitlines()


def test_bad_form(tmp_path: Path):
    assert _messages(_settings(environment=_env("envs.py:not-a-name")), tmp_path) == [
        (
            "trainer.environment.function",
            ERROR,
            "bad environment spec 'envs.py:not-a-name'; expected a built-in name, "
            "'package.module:Class' or 'path/to/file.py:Class'",
        )
    ]


# ------------------------------------------------------------------------ file specs


def test_missing_file_names_the_folder(tmp_path: Path):
    assert _messages(_settings(environment=_env("envs/game.py:Game")), tmp_path) == [
        (
            "trainer.environment.function",
            ERROR,
            f"environment 'envs/game.py:Game': file 'envs/game.py' does not exist in "
            f"{tmp_path} (relative paths start in the folder the job runs in); fix the path, "
            "or write 'package.module:Class' for an installed module",
        )
    ]


def test_a_class_with_reset_and_step_passes(tmp_path: Path):
    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "game.py").write_text(GAME_OK)
    assert environment_problems(_settings(environment=_env("envs/game.py:Game")), tmp_path) == []
    absolute = f"{tmp_path / 'envs' / 'game.py'}:Game"
    assert environment_problems(_settings(environment=_env(absolute)), Path("/nowhere")) == []


def test_the_file_is_read_never_run(tmp_path: Path):
    marker = tmp_path / "ran"
    (tmp_path / "game.py").write_text(f"open({str(marker)!r}, 'w').close()\n" + GAME_OK)
    assert environment_problems(_settings(environment=_env("game.py:Game")), tmp_path) == []
    assert not marker.exists()


@pytest.mark.parametrize(
    "source,message",
    [
        (
            "class Game:\n    def reset(self, row): ...\n",
            "class 'Game' in 'game.py' has no step method; an environment needs "
            "reset(self, row) and step(self, turn)",
        ),
        (
            "class Game:\n    pass\n",
            "class 'Game' in 'game.py' has no reset or step method; an environment needs "
            "reset(self, row) and step(self, turn)",
        ),
        (
            "class Base:\n    def reset(self, row): ...\n\nclass Game(Base):\n    pass\n",
            "class 'Game' in 'game.py' has no step method; an environment needs "
            "reset(self, row) and step(self, turn)",
        ),
        (
            "class Board:\n    pass\n\nclass _Helper:\n    pass\n",
            "'game.py' defines no class 'Game'; its classes: Board",
        ),
        ("x = 1\n", "'game.py' defines no class 'Game'; its classes: (none)"),
        (
            "def Game():\n    return None\n",
            "'Game' in 'game.py' is a function; an environment is a class with "
            "reset(self, row) and step(self, turn) methods",
        ),
        ("class Game(:\n", "'game.py' is not valid Python (line 1: invalid syntax); fix it"),
    ],
    ids=[
        "no-step",
        "no-methods",
        "base-lacks-step",
        "no-such-class",
        "no-class",
        "function",
        "syntax",
    ],
)
def test_what_the_source_says(source: str, message: str, tmp_path: Path):
    (tmp_path / "game.py").write_text(source)
    assert _messages(_settings(environment=_env("game.py:Game")), tmp_path) == [
        ("trainer.environment.function", ERROR, f"environment 'game.py:Game': {message}")
    ]


@pytest.mark.parametrize(
    "source",
    [
        "class Base:\n    def reset(self, row): ...\n    def step(self, turn): ...\n\n"
        "class Game(Base):\n    pass\n",
        "from gym_like import Env\n\nclass Game(Env):\n    pass\n",  # may inherit them
        "from games import Chess as Game\n",
        "import games\nGame = games.make('chess')\n",
        "from games import *\n",
        "try:\n    from fast import Game\nexcept ImportError:\n    class Game:\n        pass\n",
        "class Game:\n    reset = step = lambda self, x: None\n",
    ],
    ids=[
        "inherited",
        "external-base",
        "imported",
        "assigned",
        "star",
        "conditional",
        "assigned-methods",
    ],
)
def test_what_only_an_import_could_tell_passes(source: str, tmp_path: Path):
    (tmp_path / "game.py").write_text(source)
    assert environment_problems(_settings(environment=_env("game.py:Game")), tmp_path) == []


def test_lint_looks_in_the_launch_folder_and_the_workdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "game.py").write_text(GAME_OK)
    monkeypatch.chdir(tmp_path)
    text = yaml.safe_dump(
        {**BASE, "trainer": {**BASE["trainer"], "environment": _env("game.py:Game")}}
    )
    here = parse_recipe(text).recipe
    (problem,) = check_environment(here)
    assert problem.message.startswith(
        f"environment 'game.py:Game': file 'game.py' does not exist in {tmp_path} "
    )
    in_workdir = parse_recipe("workdir: sub\n" + text).recipe
    assert list(check_environment(in_workdir)) == []


# ------------------------------------------------------------------------ token budget


def test_max_tokens_below_a_turn_is_an_error(tmp_path: Path):
    settings = _settings(environment=_env("tool_lookup", max_tokens=8))
    assert _messages(settings, tmp_path) == [
        (
            "trainer.environment.max_tokens",
            ERROR,
            "max_tokens 8 is less than rollout.max_new_tokens 16, so a first turn may not "
            "fit; write max_tokens: 16 or more (the model's turns and the environment's "
            "messages together)",
        )
    ]
    assert (
        environment_problems(_settings(environment=_env("tool_lookup", max_tokens=16)), tmp_path)
        == []
    )


def test_an_episode_fits_the_tiny_models_2048_positions(tmp_path: Path):
    # 64 + 1983 + 1 = 2048: the engine's max_model_len is exactly the model's positions.
    fits = _settings(environment=_env("tool_lookup", max_tokens=1983))
    assert environment_problems(fits, tmp_path) == []
    over = _settings(environment=_env("tool_lookup", max_tokens=1984))
    assert _messages(over, tmp_path) == [
        (
            "trainer.environment.max_tokens",
            ERROR,
            "data.max_prompt_length 64 + max_tokens 1984 + 1 for the engine's probe = 2049 "
            "positions, more than tiny:qwen2-h64-l2's 2048 (max_position_embeddings); write "
            "max_tokens: 1983 or less",
        )
    ]


def test_unset_max_tokens_counts_the_turns(tmp_path: Path):
    # 64 turns x 2 x 16 = 2048 tokens after the prompt; 1983 fit, so 61 turns of 2 x 16.
    settings = _settings(environment=_env("tool_lookup", max_turns=64))
    assert _messages(settings, tmp_path) == [
        (
            "trainer.environment.max_turns",
            ERROR,
            "data.max_prompt_length 64 + an episode of 2048 tokens (max_turns 64 x 2 x "
            "rollout.max_new_tokens 16; max_tokens unset) + 1 for the engine's probe = 2113 "
            "positions, more than tiny:qwen2-h64-l2's 2048 (max_position_embeddings); set "
            "max_tokens: 1983 or less, or max_turns: 61 or fewer",
        )
    ]


def test_no_room_for_a_first_turn_says_what_to_shorten(tmp_path: Path):
    settings = _settings(
        data={"train": "synthetic:tool_lookup", "max_prompt_length": 2040},
        environment=_env("tool_lookup", max_tokens=16),
    )
    assert _messages(settings, tmp_path) == [
        (
            "trainer.environment.max_tokens",
            ERROR,
            "data.max_prompt_length 2040 + max_tokens 16 + 1 for the engine's probe = 2057 "
            "positions, more than tiny:qwen2-h64-l2's 2048 (max_position_embeddings); lower "
            "data.max_prompt_length or rollout.max_new_tokens so that a prompt and a first "
            "turn fit in 2047 tokens",
        )
    ]


def test_the_caller_may_give_the_models_positions(tmp_path: Path):
    # The trainer reads the model's config itself and says how many positions it has.
    settings = _settings(environment=_env("tool_lookup", max_tokens=100))
    assert environment_problems(settings, tmp_path, max_positions=165) == []
    ((field, severity, message),) = _messages(settings, tmp_path, max_positions=164)
    assert field == "trainer.environment.max_tokens" and severity == ERROR
    assert message.endswith(
        "tiny:qwen2-h64-l2's 164 (max_position_embeddings); write max_tokens: 99 or less"
    )


def test_an_unknown_model_skips_the_context_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    settings = _settings(
        model={"path": "acme/secret-13b"}, environment=_env("tool_lookup", max_tokens=10**6)
    )
    assert environment_problems(settings, tmp_path) == []


def test_the_probe_token_is_the_engines():
    from rlx.trainer.rollout.vllm_options import max_model_len

    for environment in (_env("tool_lookup"), _env("calculator", max_tokens=700)):
        settings = _settings(environment=environment)
        prompt = settings.data.max_prompt_length
        assert max_model_len(settings) == prompt + episode_token_budget(settings) + PROBE_TOKENS


# ------------------------------------------------------------------------ reward


def test_a_reward_written_beside_an_environment_is_a_warning(tmp_path: Path):
    path = _recipe(tmp_path, reward={"function": "gsm8k"})
    findings = [f for f in lint_file(path) if f.field.startswith("trainer.reward")]
    assert [(f.severity, f.field, f.message) for f in findings] == [
        (
            WARNING,
            "trainer.reward",
            "the environment's reward replaces trainer.reward, so reward 'gsm8k' is never "
            "used; remove trainer.reward (or trainer.environment to score with it)",
        )
    ]
    assert runner.invoke(app, ["lint", str(path)]).exit_code == 0
    assert runner.invoke(app, ["lint", "--strict", str(path)]).exit_code == 1


def test_a_default_reward_is_no_warning(tmp_path: Path):
    assert lint_file(_recipe(tmp_path)) == []
    without_env = load_recipe(_recipe(tmp_path, environment=None, reward={"function": "gsm8k"}))
    assert list(check_reward_beside_environment(without_env.recipe)) == []


def test_problems_are_lints_problems(tmp_path: Path):
    (problem,) = environment_problems(_settings(environment=_env("nope")), tmp_path)
    assert isinstance(problem, Problem)
