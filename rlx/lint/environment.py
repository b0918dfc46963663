"""Checks of trainer.environment: its spec names a class that exists (read, never imported),
an episode fits the model's context and holds a first turn, and trainer.reward, which the
environment's reward replaces, is not written beside it.

environment_problems() is the rule, and the trainer's start-up asks it too (with the folder
the job runs in); check_environment is lint's view of it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from rlx.lint.core import ERROR, WARNING, Check, Problem
from rlx.lint.sources import PROBE_TOKENS, file_of_spec, missing_file
from rlx.recipe import Recipe
from rlx.recipe.model import TrainerSettings, episode_token_budget
from rlx.trainer.episodes.env import builtin_environments, environment_spec_problem

WHERE = ("trainer", "environment")


def environment_problems(
    settings: TrainerSettings, base_dir: Path, max_positions: int | None = None
) -> list[Problem]:
    """What is wrong with settings.environment (nothing without one). base_dir: the folder
    the job runs in, where a 'path/to/file.py:Class' spec's relative path starts.
    max_positions: the model's max_position_embeddings when the caller has read its config;
    None looks it up as `rlx plan` does, and skips the context check when nothing knows it."""
    environment = settings.environment
    if environment is None:
        return []
    problems = list(_spec_problems(environment.function, base_dir))
    rollout = settings.rollout
    if environment.max_tokens is not None and environment.max_tokens < rollout.max_new_tokens:
        problems.append(
            Problem(
                (*WHERE, "max_tokens"),
                ERROR,
                f"max_tokens {environment.max_tokens} is less than rollout.max_new_tokens "
                f"{rollout.max_new_tokens}, so a first turn may not fit; write max_tokens: "
                f"{rollout.max_new_tokens} or more (the model's turns and the environment's "
                "messages together)",
            )
        )
    if max_positions is None:
        max_positions = _model_max_positions(settings)
    if max_positions is not None:
        problems.extend(_context_problems(settings, max_positions))
    return problems


def check_environment(recipe: Recipe) -> Iterator[Problem]:
    """environment_problems() as lint sees it: paths start in the folder `rlx launch` runs
    in, and in the recipe's workdir under it when it sets one (the job's working folder on
    the backends that sync it)."""
    if recipe.trainer is None:
        return
    base_dir = Path.cwd() / (recipe.workdir or "")
    yield from environment_problems(recipe.trainer, base_dir)


def check_reward_beside_environment(recipe: Recipe) -> Iterator[Problem]:
    """A reward the recipe writes beside an environment does nothing. Lint's alone: a
    recipe read back from RLX_RECIPE_JSON on the head has every field set."""
    trainer = recipe.trainer
    if trainer is None or trainer.environment is None:
        return
    if "reward" in trainer.model_fields_set:
        yield Problem(
            ("trainer", "reward"),
            WARNING,
            f"the environment's reward replaces trainer.reward, so reward "
            f"{trainer.reward.function!r} is never used; remove trainer.reward (or "
            "trainer.environment to score with it)",
        )
    if trainer.rewards is not None:
        yield Problem(
            ("trainer", "rewards"),
            WARNING,
            "the environment's reward replaces trainer.rewards, so its terms are never "
            "scored; remove trainer.rewards (or trainer.environment to score with them)",
        )


def _model_max_positions(settings: TrainerSettings) -> int | None:
    """The policy's max_position_embeddings as the planner finds its shape (config.json,
    the hub cache, a tiny spec, the built-in table); None when nothing knows it."""
    from rlx.plan.shapes import PlanError, find_shape

    try:
        return find_shape(settings.model.path).max_positions
    except PlanError:  # check_memory_plan says the model is unknown
        return None


def _context_problems(settings: TrainerSettings, max_positions: int) -> Iterator[Problem]:
    environment = settings.environment
    assert environment is not None
    prompt, turn = settings.data.max_prompt_length, settings.rollout.max_new_tokens
    budget = episode_token_budget(settings)
    needed = prompt + budget + PROBE_TOKENS
    if needed <= max_positions:
        return
    room = max_positions - prompt - PROBE_TOKENS  # the most an episode may hold
    if environment.max_tokens is None:
        field = "max_turns"
        episode = (
            f"an episode of {budget} tokens (max_turns {environment.max_turns} x 2 x "
            f"rollout.max_new_tokens {turn}; max_tokens unset)"
        )
        turns = room // (2 * turn)
        instead = f"set max_tokens: {room} or less" + (
            f", or max_turns: {turns} or fewer" if turns else ""
        )
    else:
        field, episode = "max_tokens", f"max_tokens {budget}"
        instead = f"write max_tokens: {room} or less"
    if room < turn:  # not even a first turn fits
        instead = (
            "lower data.max_prompt_length or rollout.max_new_tokens so that a prompt and a "
            f"first turn fit in {max_positions - PROBE_TOKENS} tokens"
        )
    yield Problem(
        (*WHERE, field),
        ERROR,
        f"data.max_prompt_length {prompt} + {episode} + {PROBE_TOKENS} for the engine's "
        f"probe = {needed} positions, more than {settings.model.path}'s {max_positions} "
        f"(max_position_embeddings); {instead}",
    )


def _spec_problems(spec: str, base_dir: Path) -> Iterator[Problem]:
    field = (*WHERE, "function")
    problem = environment_spec_problem(spec)
    if problem is not None:
        yield Problem(field, ERROR, problem)
        return
    if spec in builtin_environments():
        return
    located = file_of_spec(spec, base_dir)
    if located is None:
        return  # a module: imported on the head only, like a reward's (its form is checked)
    target, name, found = located
    if not found.is_file():
        yield Problem(field, ERROR, missing_file("environment", spec, target, base_dir, "Class"))
        return
    problem = _class_problem(found, target, name)
    if problem is not None:
        yield Problem(field, ERROR, f"environment {spec!r}: {problem}")


def _class_problem(path: Path, target: str, name: str) -> str | None:
    """What the file's source says is wrong with class `name` (read with ast, never run):
    it must be a class with reset and step methods. None when it is one, or when the source
    cannot tell (the name bound by an import or an assignment, a method inherited from a
    class defined elsewhere)."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except SyntaxError as exc:
        return f"{target!r} is not valid Python (line {exc.lineno}: {exc.msg}); fix it"
    except (OSError, ValueError) as exc:
        return f"cannot read {target!r} ({exc})"
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    functions = {
        node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    }
    others = _other_bindings(tree)
    if "*" in others or (name in others and name not in classes):
        return None  # bound some other way: only importing the file would tell
    if name in functions and name not in classes:
        return (
            f"{name!r} in {target!r} is a function; an environment is a class with "
            "reset(self, row) and step(self, turn) methods"
        )
    if name not in classes:
        public = sorted(n for n in classes if not n.startswith("_"))
        return f"{target!r} defines no class {name!r}; its classes: {', '.join(public) or '(none)'}"
    missing = _missing_methods(classes[name], classes, ("reset", "step"))
    if missing:
        return (
            f"class {name!r} in {target!r} has no {' or '.join(missing)} method; an "
            "environment needs reset(self, row) and step(self, turn)"
        )
    return None


def _missing_methods(
    node: ast.ClassDef, classes: dict[str, ast.ClassDef], wanted: tuple[str, ...]
) -> list[str]:
    """The wanted methods neither the class nor its bases in this file define; [] when a
    base is defined elsewhere (it may define them)."""
    defined: set[str] = set()
    seen: set[str] = set()
    todo = [node]
    while todo:
        cls = todo.pop()
        if cls.name in seen:
            continue
        seen.add(cls.name)
        defined |= _body_names(cls)
        for base in cls.bases:
            if isinstance(base, ast.Name) and base.id == "object":
                continue
            if isinstance(base, ast.Name) and base.id in classes:
                todo.append(classes[base.id])
            else:
                return []  # inherits from a class this file does not hold
    return [method for method in wanted if method not in defined]


def _body_names(cls: ast.ClassDef) -> set[str]:
    """Names a class body binds: its methods and its assignments."""
    names: set[str] = set()
    for statement in cls.body:
        if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(statement.name)
        elif isinstance(statement, ast.Assign):
            names |= {t.id for t in statement.targets if isinstance(t, ast.Name)}
        elif isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            names.add(statement.target.id)
    return names


def _other_bindings(tree: ast.Module) -> set[str]:
    """Module-level names bound other than by a top-level class or function statement:
    imports ('*' for a star import), assignments, and whatever an if, try, with or loop at
    the top level binds (a class defined there may or may not be)."""
    names: set[str] = set()
    for statement in tree.body:
        if isinstance(statement, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in _walk_module_level(statement):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names |= {(a.asname or a.name).split(".")[0] for a in node.names}
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                names.add(node.name)
    return names


def _walk_module_level(node: ast.AST) -> Iterator[ast.AST]:
    """node and what it holds, not descending into class or function bodies (their names
    are not the module's)."""
    yield node
    if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
        return
    for child in ast.iter_child_nodes(node):
        yield from _walk_module_level(child)


CHECKS: list[Check] = [
    check_environment,
    check_reward_beside_environment,
]
