"""Checks of what a run reads besides its model: the prompt files or hub datasets
(trainer.data.train, trainer.validation.data), the chat template file, the reward functions
(trainer.reward.function, trainer.rewards[].function) and the context window they fill
with the model's positions.

source_problems() is the rule, one for lint and for the trainer's start-up: lint calls it
with the folder the job will run in (check_sources), the trainer with the folder it runs in,
before it reads any of them (rlx.trainer.main). Files are read, never run: a reward file's
function is found in its source (ast); its module is imported on the head only. A hub
dataset (hf://org/name) is looked up in the hub cache: by lint where this machine's cache
holds it (or HF_HUB_OFFLINE says it never will), at start-up fetched first (rlx.hub), then
its configuration, split and columns are checked the same way.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from rlx.errors import RlxError, first_line
from rlx.lint.core import ERROR, Check, Problem
from rlx.recipe import Recipe
from rlx.recipe.model import TrainerSettings, episode_token_budget
from rlx.recipe.specs import HUB_DATA_PREFIX, SYNTHETIC_PREFIX
from rlx.storage import is_store_url, url_problem

# The engine's context holds one token more than a prompt and its response or episode: the
# probe request that checks an engine at start-up generates one
# (rlx.trainer.actors.workers.max_model_len).
PROBE_TOKENS = 1
REWARD_SIGNATURE = "fn(prompt: str, response: str, answer: str | None) -> float"
# A hub id as people write them: owner/name, no suffix (openai/gsm8k, HuggingFaceH4/MATH-500).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def source_problems(
    settings: TrainerSettings, base_dir: Path, *, local_missing: bool = True, fetch: bool = True
) -> list[Problem]:
    """What is wrong with the run's prompt files, chat template and reward function as
    found in base_dir (the folder the job runs in: relative paths start there).
    local_missing: whether a relative path that is not there is a problem (at start-up it
    is; lint leaves it to the data that is made before launch, as the shipped recipes'
    comments say). fetch: whether a hub dataset missing from the hub cache is fetched (at
    start-up) or left unsaid (lint, unless HF_HUB_OFFLINE)."""
    problems = list(_data_problems(settings, base_dir, local_missing, fetch))
    problems.extend(_template_problems(settings, base_dir, local_missing))
    for term, where in zip(settings.reward_terms(), settings.reward_term_fields(), strict=True):
        if term.function is not None:
            problems.extend(_reward_problems(term.function, base_dir, settings, where))
    return problems


def check_sources(recipe: Recipe) -> Iterator[Problem]:
    """source_problems() as lint sees it: paths start in the folder `rlx launch` runs in,
    and in the recipe's workdir under it when it sets one; hub datasets in this machine's
    cache."""
    if recipe.trainer is None:
        return
    base_dir = Path.cwd() / (recipe.workdir or "")
    yield from source_problems(recipe.trainer, base_dir, local_missing=False, fetch=False)


def check_context_window(recipe: Recipe) -> Iterator[Problem]:
    """context_problems() with the model's positions as `rlx plan` finds them (its config in
    a local folder or the hub cache, a tiny spec, the built-in table); nothing when none
    knows them."""
    trainer = recipe.trainer
    if trainer is None or trainer.environment is not None:
        return  # an environment's episode: rlx.lint.environment says it
    from rlx.plan.shapes import PlanError, find_shape

    try:
        positions = find_shape(trainer.model.path).max_positions
    except PlanError:  # check_memory_plan says the model is unknown
        return
    if positions is not None:
        yield from context_problems(trainer, positions)


def context_problems(settings: TrainerSettings, max_positions: int) -> list[Problem]:
    """A prompt and its longest response (and the engine's probe token) must fit in the
    model's positions (max_position_embeddings). With an environment, rlx.lint.environment
    counts the episode instead."""
    if settings.environment is not None:
        return []
    prompt, response = settings.data.max_prompt_length, episode_token_budget(settings)
    needed = prompt + response + PROBE_TOKENS
    if needed <= max_positions:
        return []
    room = max_positions - prompt - PROBE_TOKENS
    if room >= 1:
        where = ("trainer", "rollout", "max_new_tokens")
        instead = f"write rollout.max_new_tokens: {room} or less"
    else:
        where = ("trainer", "data", "max_prompt_length")
        instead = (
            "lower data.max_prompt_length and rollout.max_new_tokens so that a prompt and a "
            f"response fit in {max_positions - PROBE_TOKENS} tokens"
        )
    return [
        Problem(
            where,
            ERROR,
            f"data.max_prompt_length {prompt} + rollout.max_new_tokens {response} + "
            f"{PROBE_TOKENS} for the engine's probe = {needed} positions, more than "
            f"{settings.model.path}'s {max_positions} (max_position_embeddings); {instead}",
        )
    ]


# ----------------------------------------------------------------------------- data


class _DataField(NamedTuple):
    where: tuple[str | int, ...]
    spec: str
    config: str | None  # a hub dataset's part: its configuration and split
    split: str
    part_fields: tuple[str, str]  # the fields that choose them, as the messages name them


def _data_fields(settings: TrainerSettings) -> list[_DataField]:
    data = settings.data
    fields = [
        _DataField(
            ("trainer", "data", "train"),
            data.train,
            data.config,
            data.split,
            ("data.config", "data.split"),
        )
    ]
    for i, source in enumerate(data.mix):
        fields.append(
            _DataField(
                ("trainer", "data", "mix", i, "train"),
                source.train,
                source.config,
                source.split,
                (f"data.mix[{i}].config", f"data.mix[{i}].split"),
            )
        )
    validation = settings.validation
    if validation is not None:
        fields.append(
            _DataField(
                ("trainer", "validation", "data"),
                validation.data,
                validation.config or data.config,
                validation.split,
                ("validation.config" if validation.config else "data.config", "validation.split"),
            )
        )
    return fields


def _data_problems(
    settings: TrainerSettings, base_dir: Path, local_missing: bool, fetch: bool
) -> Iterator[Problem]:
    from rlx.trainer.tasks.data import FORMATS

    data = settings.data
    suffixes = [s for group in FORMATS.values() for s in group]
    readable = f"a {', '.join(suffixes[:-1])} or {suffixes[-1]} file"
    for field in _data_fields(settings):
        where, spec = field.where, field.spec
        if spec.startswith(SYNTHETIC_PREFIX):
            continue  # check_trainer_specs checks the task's name
        if spec.startswith(HUB_DATA_PREFIX):
            problem = _hub_data_problem(field, data.prompt_key, data.answer_key, fetch)
            if problem is not None:
                yield Problem(where, ERROR, problem)
            continue
        if is_store_url(spec) or url_problem(spec) is not None:
            continue  # rlx.lint.storage: a URL is read from no store, or is malformed
        path = Path(spec).expanduser()
        found = path if path.is_absolute() else base_dir / path
        if not found.exists() and not path.suffix and _HUB_ID.fullmatch(spec):
            yield Problem(
                where,
                ERROR,
                f"{spec!r} looks like a hub dataset id, and a bare name is read as a local "
                f"file; write hf://{spec} for the hub's dataset (with data.config and "
                f"data.split where it has several), or name {readable}",
            )
            continue
        if found.is_dir():  # before the suffix: a folder has none, and that is not the news
            yield Problem(where, ERROR, f"{spec} is a folder; name {readable} in it")
            continue
        if data.format == "auto" and path.suffix.lower() not in suffixes:
            suffix = f"the suffix {path.suffix!r} is neither" if path.suffix else "it has no suffix"
            yield Problem(
                where,
                ERROR,
                f"{spec}: rlx reads jsonl and parquet files, and {suffix}; convert it to "
                f"{readable} (jsonl: one JSON object per line), or write data.format: jsonl or "
                "parquet if it is one",
            )
            continue
        if not found.is_file():
            if path.is_absolute() or local_missing:
                yield Problem(
                    where,
                    ERROR,
                    f"{spec} does not exist{_looked_in(path, base_dir)}; give {readable}, "
                    "or synthetic:letters_or_digits",
                )
            continue
        problem = _columns_problem(found, spec, data.prompt_key, data.answer_key, data.format)
        if problem is not None:
            yield Problem(where, ERROR, problem)


def _hub_data_problem(
    field: _DataField, prompt_key: str, answer_key: str | None, fetch: bool
) -> str | None:
    """What is wrong with an hf:// dataset: its id (not resolvable: not in the cache offline,
    not on the hub), its configuration and split, the prompt and answer columns of its first
    row. Nothing when lint's cache does not hold it (the job's node fetches it)."""
    from rlx.recipe.load import dotted
    from rlx.trainer.tasks.data import hub_first_row, hub_part_problem, hub_source

    named = dotted(field.where)
    try:
        source = hub_source(field.spec, field.config, field.split, field=named, fetch=fetch)
    except RlxError as exc:
        return str(exc).removeprefix(f"{named}: ")
    if source is None:
        return None
    problem = hub_part_problem(source, field.part_fields)
    if problem is not None:
        return problem
    try:
        row = hub_first_row(source)
    except Exception as exc:  # a file datasets cannot read: say so, not a traceback
        first = first_line(exc)
        return f"{source}: the datasets library cannot read it: {first}"
    if row is None:
        return f"{source}: the split holds no rows; choose another with {field.part_fields[1]}"
    return _row_columns_problem(row, str(source), prompt_key, answer_key)


def _template_problems(
    settings: TrainerSettings, base_dir: Path, local_missing: bool
) -> Iterator[Problem]:
    """A chat template given as a file must be there (Jinja text is taken as it is)."""
    from rlx.trainer.tasks.data import is_template_text, template_file

    value = settings.data.chat_template_override
    if value is None or is_template_text(value):
        return
    path = Path(value).expanduser()
    found = template_file(value, base_dir)
    if found.is_file() or not (path.is_absolute() or local_missing):
        return
    yield Problem(
        ("trainer", "data", "chat_template_override"),
        ERROR,
        f"{value} does not exist{_looked_in(path, base_dir)}; give a Jinja template file, or "
        "the template itself (text with {{ or {%)",
    )


def file_of_spec(spec: str, base_dir: Path) -> tuple[str, str, Path] | None:
    """(file as written, name in it, where it is looked for) of a 'path/to/file.py:name'
    spec (a reward function, an environment class); None for 'package.module:name'."""
    target, _, name = spec.rpartition(":")
    if not target.endswith(".py"):
        return None
    path = Path(target).expanduser()
    return target, name, path if path.is_absolute() else base_dir / path


def missing_file(kind: str, spec: str, target: str, base_dir: Path, what: str) -> str:
    """The line for a spec whose file is not there: where it was looked for, and the way
    to name an installed module instead."""
    where = _looked_in(Path(target).expanduser(), base_dir)
    return (
        f"{kind} {spec!r}: file {target!r} does not exist{where}; fix the path, or write "
        f"'package.module:{what}' for an installed module"
    )


def _looked_in(path: Path, base_dir: Path) -> str:
    """Where a missing relative path was looked for (nothing to add for an absolute one)."""
    if path.is_absolute():
        return ""
    return f" in {base_dir} (relative paths start in the folder the job runs in)"


def _first_row(path: Path, data_format: str) -> Mapping[str, Any] | None:
    """The file's first row, or None when it cannot be read here (the trainer's reading
    says what is wrong with it then)."""
    from rlx.trainer.tasks.data import detect_format

    try:
        fmt = detect_format(path, None if data_format == "auto" else data_format)
        if fmt == "jsonl":
            with path.open(encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        row = json.loads(line)
                        return row if isinstance(row, Mapping) else None
            return None
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(batch_size=1):
            rows = batch.to_pylist()
            if rows:
                return rows[0]
        return None
    except Exception:  # unreadable here: not this rule's to say
        return None


def _columns_problem(
    path: Path, spec: str, prompt_key: str, answer_key: str | None, data_format: str
) -> str | None:
    """The prompt and answer keys must be in the file's first row."""
    row = _first_row(path, data_format)
    if row is None:
        return None
    return _row_columns_problem(row, spec, prompt_key, answer_key)


def _row_columns_problem(
    row: Mapping[str, Any], spec: str, prompt_key: str, answer_key: str | None
) -> str | None:
    from rlx.trainer.tasks.data import get_field

    for field, key in (("prompt_key", prompt_key), ("answer_key", answer_key)):
        if key is None:
            continue
        try:
            get_field(row, key)
        except KeyError:
            columns = ", ".join(map(str, row))
            return (
                f"{spec} has no {key!r} in its first row (data.{field}); its columns: "
                f"{columns}; write data.{field}: one of them (dotted for nested fields)"
                + (", or answer_key: null when there is no answer" if field == "answer_key" else "")
            )
    return None


# ----------------------------------------------------------------------------- rewards


def reward_arity_problem(
    spec: str, positional: int, required: int, varargs: bool, required_keywords: list[str]
) -> str | None:
    """Whether a function called fn(prompt, response, answer) accepts the call: it takes
    `positional` positional parameters, the first `required` without a default, *args when
    varargs, and keyword-only parameters without a default (required_keywords)."""
    takes_three = varargs or positional >= 3
    if takes_three and required <= 3 and not required_keywords:
        return None
    if required_keywords:
        wrong = f"needs keyword argument {', '.join(map(repr, required_keywords))}"
    elif required > 3:
        wrong = f"needs {required} arguments"
    else:
        wrong = f"takes {positional} argument{'s' if positional != 1 else ''}"
    return (
        f"reward {spec!r} {wrong}, and rlx calls it with 3 (prompt, response, answer); "
        f"write it as {REWARD_SIGNATURE}"
    )


def signature_problem(spec: str, fn: Any) -> str | None:
    """reward_arity_problem for an imported callable (the trainer's side)."""
    import inspect

    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: its call will tell
        return None
    kinds = inspect.Parameter
    params = list(signature.parameters.values())
    by_position = (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
    positional = [p for p in params if p.kind in by_position]
    return reward_arity_problem(
        spec,
        len(positional),
        sum(p.default is kinds.empty for p in positional),
        any(p.kind is kinds.VAR_POSITIONAL for p in params),
        [p.name for p in params if p.kind is kinds.KEYWORD_ONLY and p.default is kinds.empty],
    )


def _reward_problems(
    spec: str, base_dir: Path, settings: TrainerSettings, where: tuple[str | int, ...]
) -> Iterator[Problem]:
    from rlx.trainer.tasks.rewards import REWARD_FUNCTIONS, reward_spec_problem

    field = (*where, "function")
    if settings.environment is not None or spec in REWARD_FUNCTIONS:
        return  # the environment's reward replaces it; built-ins take the call
    if reward_spec_problem(spec) is not None:
        return  # check_trainer_specs says it
    located = file_of_spec(spec, base_dir)
    if located is None:
        return  # a module: installed on the nodes by setup:, imported on the head only
    target, name, found = located
    if not found.is_file():
        yield Problem(field, ERROR, missing_file("reward", spec, target, base_dir, "function"))
        return
    problem = _function_problem(found, spec, target, name)
    if problem is not None:
        yield Problem(field, ERROR, problem)


def _function_problem(path: Path, spec: str, target: str, name: str) -> str | None:
    """What the file's source says about function `name` (read with ast, never run); None
    when it is fine or when the source cannot tell (bound by an import or an assignment)."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except SyntaxError as exc:
        return (
            f"reward {spec!r}: {target!r} is not valid Python (line {exc.lineno}: {exc.msg}); "
            "fix it"
        )
    except (OSError, ValueError) as exc:
        return f"reward {spec!r}: cannot read {target!r} ({exc})"
    functions = {
        node.name: node
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    }
    if name not in functions:
        if _bound_otherwise(tree, name):
            return None
        public = sorted(n for n in functions if not n.startswith("_"))
        return (
            f"reward {spec!r}: {target!r} defines no function {name!r}; its functions: "
            f"{', '.join(public) or '(none)'}"
        )
    args = functions[name].args
    positional = [*args.posonlyargs, *args.args]
    keywords = zip(args.kwonlyargs, args.kw_defaults, strict=True)
    required_keywords = [a.arg for a, default in keywords if default is None]
    return reward_arity_problem(
        spec,
        len(positional),
        len(positional) - len(args.defaults),
        args.vararg is not None,
        required_keywords,
    )


def _bound_otherwise(tree: ast.Module, name: str) -> bool:
    """Whether a module-level statement other than a def may bind `name` (an import, an
    assignment, a class, a star import, a def inside an if or try)."""
    for statement in tree.body:
        if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if isinstance(statement, ast.ClassDef):
            if statement.name == name:
                return True
            continue
        for node in ast.walk(statement):
            imported = isinstance(node, ast.Import | ast.ImportFrom) and node.names
            if imported and any(
                (a.asname or a.name).split(".")[0] in (name, "*") for a in imported
            ):
                return True
            bound = None
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                bound = node.id
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                bound = node.name
            if bound == name:
                return True
    return False


CHECKS: list[Check] = [
    check_sources,
    check_context_window,
]
