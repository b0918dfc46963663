"""Every refusal the trainer decides from the recipe alone has a lint twin, so a recipe that
`rlx lint` passes is never refused at start-up.

The trainer's user-facing refusals are RlxError (and its kinds); the scan below finds every
place rlx/trainer raises one (plus the ValueErrors of model construction) and SITES must
classify each: a TWIN (a recipe change that makes the start-up code refuse, and the lint
finding that refuses the same recipe), or a reason it cannot be decided from the recipe
alone. A new raise site without an entry here fails the test.
"""

from __future__ import annotations

import ast
import copy
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlx.errors import RlxError
from rlx.lint import lint_loaded
from rlx.lint.trainer import SYNTHETIC_TASKS
from rlx.recipe import load_recipe

REPO = Path(__file__).resolve().parent.parent
TRAINER = REPO / "rlx" / "trainer"
ERROR_KINDS = {"RlxError", "DataError", "RewardSpecError", "RewardError", "StaleEngineError"}
# Model construction runs at start-up in every worker; its ValueErrors count too.
VALUE_ERROR_FILES = {"learner.py", "models.py", "tiny.py", "sharding.py", "workers.py"}

CLUSTER = "needs the Ray cluster as it is at start-up (nodes, GPUs, addresses)"
FILES = "needs the head's files or installed packages"
DATA = "needs the dataset's rows"
RUN = "mid-run or resume: checkpoint contents, engines' weights, reward values"
INTERNAL = "an invariant the schema or the caller already guarantees"


def _message_parts(node: ast.expr) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):  # an f-string: its literal pieces
        return [v.value for v in node.values if isinstance(v, ast.Constant)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _message_parts(node.left) + _message_parts(node.right)
    return []


def _static_text(node: ast.expr) -> str:
    """The literal text of an error message (f-string pieces joined), to name a site."""
    return " ".join(" ".join(_message_parts(node)).split())[:36].strip()


def raise_sites() -> list[str]:
    """'file::function::message text' for every refusal raised under rlx/trainer (file
    relative to it, the message's literal text cut short)."""
    sites: list[str] = []
    for path in sorted(TRAINER.rglob("*.py")):
        relative = path.relative_to(TRAINER).as_posix()
        kinds = ERROR_KINDS | ({"ValueError"} if path.name in VALUE_ERROR_FILES else set())

        def visit(
            node: ast.AST, scope: tuple[str, ...], relative: str = relative, kinds: set = kinds
        ) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    visit(child, (*scope, child.name))
                    continue
                if (
                    isinstance(child, ast.Raise)
                    and isinstance(child.exc, ast.Call)
                    and isinstance(child.exc.func, ast.Name)
                    and child.exc.func.id in kinds
                ):
                    message = child.exc.args[0] if child.exc.args else ast.Constant("")
                    sites.append(f"{relative}::{'.'.join(scope)}::{_static_text(message)}")
                visit(child, scope)

        visit(ast.parse(path.read_text(encoding="utf-8")), ())
    return sites


# --------------------------------------------------------------------------- twins


@dataclass(frozen=True)
class Twin:
    """change: edits the recipe dict; startup: runs the trainer's start-up check on the
    changed recipe (it must raise); lint_field: the field lint must report as an error."""

    change: Callable[[dict[str, Any]], None]
    startup: Callable[[Any, Path, pytest.MonkeyPatch], Any]
    lint_field: str


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(recipe: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = recipe
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value

    return change


def _all(*changes: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def change(recipe: dict[str, Any]) -> None:
        for one in changes:
            one(recipe)

    return change


def _engine_choice(recipe: Any, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    from rlx.trainer.main import engine_choice

    real = importlib.util.find_spec
    # The check after "is vLLM installed?": behave as on a machine that has it.
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name)
    )
    return engine_choice(recipe)


def _plan_actors(recipe: Any, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    from rlx.trainer.actors.placement import plan_actors

    return plan_actors(recipe)


def _batch_split(recipe: Any, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    from rlx.trainer.actors.placement import check_batch_split, plan_actors

    return check_batch_split(recipe, plan_actors(recipe))


def _trainer_settings(recipe: Any, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    from rlx.trainer.resolve import trainer_settings

    return trainer_settings(recipe)


def _model_path(recipe: Any, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    from rlx.trainer.resolve import resolve_model_path

    return resolve_model_path(recipe.trainer.model.path, tmp, recipe.trainer.seed)


def _data_path(recipe: Any, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    from rlx.trainer.resolve import resolve_data_path

    return resolve_data_path(recipe.trainer.data.train, tmp, recipe.trainer.seed)


def _reward(recipe: Any, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    from rlx.trainer.resolve import resolve_reward_fn

    return resolve_reward_fn(recipe.trainer)


GPU = _all(_set("resources.accelerators", "H100:8"), _set("trainer.rollout.engine", "vllm"))

# Each raise site: its lint twin, or why the recipe alone cannot decide it.
SITES: dict[str, Twin | str] = {
    "main.py::engine_choice::trainer.rollout.tensor_parallel_size": Twin(
        _all(GPU, _set("trainer.rollout.tensor_parallel_size", 2)),
        _engine_choice,
        "trainer.rollout.tensor_parallel_size",
    ),
    "main.py::engine_choice::trainer.rollout.engine: hf runs on o": Twin(
        _all(
            _set("resources.accelerators", "H100:8"),
            _set("trainer.rollout.engine", "hf"),
            _set("trainer.layout", "split"),
            _set("trainer.rollout_gpus", 4),
            _set("trainer.rollout.tensor_parallel_size", 2),
        ),
        _engine_choice,
        "trainer.rollout.tensor_parallel_size",
    ),
    "actors/placement.py::check_batch_split::trainer.batch: ; pick sizes that div": Twin(
        _set("trainer.batch.minibatch_size", 24), _batch_split, "trainer.batch.minibatch_size"
    ),
    "actors/placement.py::plan_actors::trainer.rollout_gpus : layout: split": Twin(
        _all(GPU, _set("trainer.layout", "split"), _set("trainer.rollout_gpus", 8)),
        _plan_actors,
        "trainer.rollout_gpus",
    ),
    "resolve.py::build_tiny_cached::trainer. .path: tiny arch is not one": Twin(
        _set("trainer.model.path", "tiny:gpt9-h64-l2"), _model_path, "trainer.model.path"
    ),
    "resolve.py::build_tiny_cached::trainer. .path: tiny models need a h": Twin(
        _set("trainer.model.path", "tiny:qwen2-h66-l2"), _model_path, "trainer.model.path"
    ),
    "resolve.py::resolve_data_path::trainer. : unknown synthetic task ;": Twin(
        _set("trainer.data.train", "synthetic:chess"), _data_path, "trainer.data.train"
    ),
    "resolve.py::resolve_model_path::trainer. .path: is not a tiny model": Twin(
        _set("trainer.model.path", "tiny:qwen2-64-2"), _model_path, "trainer.model.path"
    ),
    "resolve.py::trainer_settings::recipe has no 'trainer:' section, so": Twin(
        lambda recipe: recipe.pop("trainer"), _trainer_settings, "trainer"
    ),
    "tasks/rewards.py::resolve_reward::bad reward spec ; expected": Twin(
        _set("trainer.reward.function", "module:not-a-name"), _reward, "trainer.reward.function"
    ),
    "tasks/rewards.py::resolve_reward::unknown reward ; valid: , or a user": Twin(
        _set("trainer.reward.function", "gsm9k"), _reward, "trainer.reward.function"
    ),
    "checkpoint/resume.py::resolve_resume::checkpoint.resume: does not exist; g": FILES,
    "checkpoint/resume.py::resolve_resume::checkpoint.resume: is not a complete": FILES,
    "checkpoint/resume.py::resolve_resume::checkpoint.resume: is not a folder;": FILES,
    "checkpoint/resume.py::resolve_resume::checkpoint.resume: never, but alread": FILES,
    "checkpoint/resume.py::resolve_run_id::cannot make a run id from recipe nam": INTERNAL,
    "checkpoint/export.py::check_checkpoint::does not exist; give a checkpoint's": FILES,
    "checkpoint/export.py::check_checkpoint::is not a folder; give a checkpoint's": FILES,
    "checkpoint/export.py::check_checkpoint::is not a complete checkpoint:": FILES,
    "checkpoint/export.py::check_checkpoint::has no part: it was written by an ol": FILES,
    "checkpoint/export.py::export_checkpoint::already exists; give a new folder or": FILES,
    "checkpoint/export.py::write_weights::holds no policy weights": RUN,
    "checkpoint/store.py::CheckpointManager.load::is not a complete checkpoint (no val": RUN,
    "checkpoint/store.py::verify_files::checkpoint : is missing or truncated": RUN,
    "checkpoint/store.py::verify_files::checkpoint : does not match its chec": RUN,
    "checkpoint/training.py::load_parts::is not a complete checkpoint (no val": RUN,
    "learn/learner.py::Learner.load_sharded_state::the checkpoint has no (not a PPO run": RUN,
    "learn/learner.py::Learner.load_parts::the checkpoint has no critic_schedul": RUN,
    "loop.py::Trainer.resume::checkpoint is a single-file checkpoi": RUN,
    "actors/workers.py::TrainWorker.load_checkpoint::is a single-file checkpoint of an ol": RUN,
    "learn/models.py::ResponseScorer.__init__::caps its logits (final_logit_softcap": FILES,
    "learn/sharding.py::decoder_layers::names no decoder-layer class (_no_sp": FILES,
    "learn/sharding.py::local_rows::unexpected placements : only Shard(0": INTERNAL,
    "learn/sharding.py::local_rows::local shard of has rows": INTERNAL,
    "learn/sharding.py::load_shards::: the checkpoint has shape , the mod": FILES,
    "actors/cluster.py::gather::": RUN,
    "actors/cluster.py::gather::a": RUN,
    "tasks/data.py::_read_jsonl::: : each line must be a JSON object,": DATA,
    "tasks/data.py::_read_jsonl::: : invalid JSON:": DATA,
    "tasks/data.py::_read_parquet::: not a readable parquet file:": DATA,
    "tasks/data.py::detect_format::: cannot tell the format from the su": FILES,
    "tasks/data.py::detect_format::unknown data format ; valid:": INTERNAL,
    "tasks/data.py::load_prompt_dataset::: all prompts are longer than max_pr": DATA,
    "tasks/data.py::load_prompt_dataset::: row :": DATA,
    "tasks/data.py::load_prompt_dataset::: row : prompt has tokens, more than": DATA,
    "tasks/data.py::load_prompt_dataset::max_prompt_length must be at least 1": INTERNAL,
    "tasks/data.py::load_prompt_dataset::unknown overlong policy ; valid:": INTERNAL,
    "tasks/data.py::read_rows::: the file holds no rows": DATA,
    "tasks/data.py::read_rows::data file does not exist": FILES,
    "tasks/data.py::render_prompt::a prompt must be a string or a list": DATA,
    "tasks/data.py::render_prompt::the tokenizer has no chat template,": FILES,
    "rollout/probe.py::check_engines::received of the tensors of weights v": RUN,
    "rollout/probe.py::check_engines::holds weights version but the policy": RUN,
    "rollout/probe.py::check_engines::scores the probe sequence but the po": RUN,
    "learn/learner.py::Learner.__init__::ppo needs a critic model path": INTERNAL,
    "loop.py::Trainer.resume::cannot resume from :": RUN,
    "loop.py::Trainer.resume::checkpoint is from a run, this recip": RUN,
    "main.py::connect_ray::RAY_ADDRESS= : give the head's expli": CLUSTER,
    "main.py::connect_ray::cannot join the Ray cluster at :": CLUSTER,
    "main.py::engine_choice::trainer.rollout.engine: runs vLLM he": FILES,
    "main.py::engine_choice::trainer.rollout.engine: vllm without": FILES,
    "tasks/validation.py::load_validation_set::trainer.validation.data: every promp": DATA,
    "main.py::resolve_inputs::trainer.data.train: has usable promp": DATA,
    "learn/models.py::lr_multiplier::unknown schedule ; valid: constant,": INTERNAL,
    "actors/placement.py::check_resources::the recipe asks for but the Ray clus": CLUSTER,
    "actors/placement.py::reserve::could not place ( bundles of , ) wit": CLUSTER,
    "actors/placement.py::thread_override::RLX_NUM_THREADS= is not a positive w": FILES,
    "resolve.py::load_tokenizer::trainer.model.path: cannot load a to": FILES,
    "resolve.py::resolve_data_path::trainer. : does not exist; give a .j": FILES,
    "resolve.py::resolve_model_path::trainer. .path: has no config.json;": FILES,
    "resolve.py::resolve_model_path::trainer. .path: is not a folder; giv": FILES,
    "tasks/rewards.py::_load_module_from_file::reward : cannot load as Python": FILES,
    "tasks/rewards.py::_load_module_from_file::reward : file does not exist": FILES,
    "tasks/rewards.py::math_verify::reward math_verify needs the math-ve": FILES,
    "tasks/rewards.py::resolve_reward::reward : cannot import module ( ); i": FILES,
    "tasks/rewards.py::resolve_reward::reward : has no attribute ; its func": FILES,
    "tasks/rewards.py::resolve_reward::reward : is not callable": FILES,
    "tasks/rewards.py::score::reward failed on sample : :": RUN,
    "tasks/rewards.py::score::reward returned for sample ; it must": RUN,
    "learn/tiny.py::build_tiny_model::hidden_size is not divisible by num_": INTERNAL,
    "learn/tiny.py::build_tiny_model::num_heads is not divisible by num_kv": INTERNAL,
    "learn/tiny.py::build_tiny_model::unknown arch ; valid:": INTERNAL,
}

BASE = """
name: twins
resources: {nodes: 1}
trainer:
  algorithm: grpo
  model: {path: "tiny:qwen2-h64-l2", dtype: float32}
  data: {train: "synthetic:letters_or_digits", max_prompt_length: 64}
  reward: {function: letters_or_digits}
  rollout: {engine: hf, n: 4, max_new_tokens: 16}
  batch: {prompts_per_step: 8, micro_batch_size: 4}
"""


def test_every_start_up_refusal_is_classified():
    found = raise_sites()
    unclassified = [site for site in found if site not in SITES]
    stale = [site for site in SITES if site not in found]
    assert not unclassified, (
        "start-up refusals with no entry in SITES: give each a lint twin (a check in "
        "rlx/lint and a Twin here) or the reason the recipe alone cannot decide it:\n"
        + "\n".join(unclassified)
    )
    assert not stale, "SITES names raise sites that no longer exist:\n" + "\n".join(stale)


@pytest.mark.parametrize("site", [s for s, v in SITES.items() if isinstance(v, Twin)])
def test_lint_refuses_what_start_up_refuses(site, tmp_path, monkeypatch, write_recipe):
    twin = SITES[site]
    assert isinstance(twin, Twin)
    base = yaml.safe_load(BASE)
    assert not [f for f in lint_loaded(load_recipe(write_recipe(BASE))) if f.severity == "error"]
    changed = copy.deepcopy(base)
    twin.change(changed)
    loaded = load_recipe(write_recipe(yaml.safe_dump(changed), "changed.yaml"))
    # The trainer's start-up code refuses it, at this very site ...
    with pytest.raises(RlxError) as refusal:
        twin.startup(loaded.recipe, tmp_path, monkeypatch)
    fragment = site.split("::")[-1].split(" ")[0]
    assert fragment.strip(":") in str(refusal.value)
    # ... and lint refuses the same recipe, at the field concerned.
    errors = [f for f in lint_loaded(loaded) if f.severity == "error"]
    assert twin.lint_field in {f.field for f in errors}, [f.format() for f in errors]


def test_lint_knows_the_trainers_synthetic_tasks():
    from rlx.trainer.resolve import synthetic_writers

    assert set(SYNTHETIC_TASKS) == set(synthetic_writers())
