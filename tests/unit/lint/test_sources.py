"""What a run reads besides its model (rlx.lint.sources) and keys written inline
(rlx.lint.secrets): every bad input is one line that names the field and says what to write,
and the trainer's start-up says the very same line when it meets the same fact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from rlx.cli import app
from rlx.errors import RlxError
from rlx.lint import lint_file
from rlx.lint.sources import reward_arity_problem
from rlx.recipe import load_recipe
from rlx.trainer.job import TrainJob
from rlx.trainer.main import check_context_at_start, check_reward_signature, check_sources_at_start

runner = CliRunner()

MODEL = "Qwen/Qwen2.5-0.5B"  # in the plan's table: 32768 positions, known offline
READABLE = "a .jsonl, .ndjson or .parquet file"
SIGNATURE = "fn(prompt: str, response: str, answer: str | None) -> float"
SYNTHETIC = "synthetic:letters_or_digits"


def _recipe(trainer: dict, **top: object) -> str:
    data = {"name": "job", **top, "trainer": {"model": {"path": MODEL}, **trainer}}
    return yaml.safe_dump(data, sort_keys=False)


@pytest.fixture
def job_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The folder `rlx lint` and `rlx train` run in: relative paths start here for both."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _errors(path: Path) -> list[str]:
    """Lint's errors for a recipe file, each as `field: message` (what start-up raises)."""
    return [f"{f.field}: {f.message}" for f in lint_file(path) if f.severity == "error"]


def _write(job_dir: Path, text: str) -> Path:
    path = job_dir / "recipe.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def _parquet(path: Path, rows: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)


REWARDS = """\
def two(prompt, response):
    return 1.0


def keyword(prompt, response, answer, *, scale):
    return scale


def fine(prompt, response, answer=None, **extra):
    return 1.0
"""


def _files(job_dir: Path) -> None:
    """What the cases below read from the job's folder."""
    (job_dir / "rows.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n')
    (job_dir / "no-answer.jsonl").write_text('{"prompt": "1+1?", "solution": "2"}\n')
    _parquet(job_dir / "rows.parquet", [{"question": "1+1?", "answer": "2"}])
    _parquet(job_dir / "no-answer.parquet", [{"prompt": "1+1?", "solution": "2"}])
    (job_dir / "rows.csv").write_text("prompt,answer\n1+1?,2\n")
    (job_dir / "gsm8k").mkdir()
    (job_dir / "rewards.py").write_text(REWARDS)


# (case, trainer section, the one line lint and start-up give; {dir} is the job's folder)
CASES: list[tuple[str, dict, str]] = [
    (
        "absolute-data-file-missing",
        {"data": {"train": "/nowhere/rows.jsonl"}},
        "trainer.data.train: /nowhere/rows.jsonl does not exist; give a .jsonl, .ndjson or "
        f".parquet file, or {SYNTHETIC}",
    ),
    (
        "csv-suffix",
        {"data": {"train": "rows.csv"}},
        "trainer.data.train: rows.csv: rlx reads jsonl and parquet files, and the suffix "
        f"'.csv' is neither; convert it to {READABLE} (jsonl: one JSON object per line), or "
        "write data.format: jsonl or parquet if it is one",
    ),
    (
        "hub-id-as-path",
        {"data": {"train": "openai/gsm8k"}},
        "trainer.data.train: 'openai/gsm8k' looks like a hub dataset id, and a bare name is "
        "read as a local file; write hf://openai/gsm8k for the hub's dataset (with "
        f"data.config and data.split where it has several), or name {READABLE}",
    ),
    (
        "folder",
        {"data": {"train": "gsm8k"}},
        f"trainer.data.train: gsm8k is a folder; name {READABLE} in it",
    ),
    (
        "jsonl-without-prompt-column",
        {"data": {"train": "rows.jsonl"}},
        "trainer.data.train: rows.jsonl has no 'prompt' in its first row (data.prompt_key); "
        "its columns: question, answer; write data.prompt_key: one of them (dotted for nested "
        "fields)",
    ),
    (
        "jsonl-without-answer-column",
        {"data": {"train": "no-answer.jsonl"}},
        "trainer.data.train: no-answer.jsonl has no 'answer' in its first row "
        "(data.answer_key); its columns: prompt, solution; write data.answer_key: one of them "
        "(dotted for nested fields), or answer_key: null when there is no answer",
    ),
    (
        "parquet-without-prompt-column",
        {"data": {"train": "rows.parquet"}},
        "trainer.data.train: rows.parquet has no 'prompt' in its first row (data.prompt_key); "
        "its columns: question, answer; write data.prompt_key: one of them (dotted for nested "
        "fields)",
    ),
    (
        "parquet-without-answer-column",
        {"data": {"train": "no-answer.parquet"}},
        "trainer.data.train: no-answer.parquet has no 'answer' in its first row "
        "(data.answer_key); its columns: prompt, solution; write data.answer_key: one of them "
        "(dotted for nested fields), or answer_key: null when there is no answer",
    ),
    (
        "validation-file-missing",
        {
            "data": {"train": SYNTHETIC},
            "validation": {"data": "/nowhere/held-out.jsonl", "every": 1},
        },
        "trainer.validation.data: /nowhere/held-out.jsonl does not exist; give a .jsonl, "
        f".ndjson or .parquet file, or {SYNTHETIC}",
    ),
    (
        "reward-file-missing",
        {"data": {"train": SYNTHETIC}, "reward": {"function": "nowhere.py:score"}},
        "trainer.reward.function: reward 'nowhere.py:score': file 'nowhere.py' does not "
        "exist in {dir} (relative paths start in the folder the job runs in); fix the path, "
        "or write 'package.module:function' for an installed module",
    ),
    (
        "reward-file-without-the-function",
        {"data": {"train": SYNTHETIC}, "reward": {"function": "rewards.py:score"}},
        "trainer.reward.function: reward 'rewards.py:score': 'rewards.py' defines no function "
        "'score'; its functions: fine, keyword, two",
    ),
    (
        "reward-takes-two",
        {"data": {"train": SYNTHETIC}, "reward": {"function": "rewards.py:two"}},
        "trainer.reward.function: reward 'rewards.py:two' takes 2 arguments, and rlx calls it "
        f"with 3 (prompt, response, answer); write it as {SIGNATURE}",
    ),
    (
        "reward-needs-a-keyword",
        {"data": {"train": SYNTHETIC}, "reward": {"function": "rewards.py:keyword"}},
        "trainer.reward.function: reward 'rewards.py:keyword' needs keyword argument 'scale', "
        f"and rlx calls it with 3 (prompt, response, answer); write it as {SIGNATURE}",
    ),
]


@pytest.mark.parametrize("case,trainer,line", CASES, ids=[c[0] for c in CASES])
def test_lint_says_one_line(case, trainer, line, job_dir):
    _files(job_dir)
    path = _write(job_dir, _recipe(trainer))
    assert _errors(path) == [line.format(dir=job_dir)]


@pytest.mark.parametrize("case,trainer,line", CASES, ids=[c[0] for c in CASES])
def test_start_up_says_lints_line(case, trainer, line, job_dir):
    _files(job_dir)
    settings = load_recipe(_write(job_dir, _recipe(trainer))).recipe.trainer
    with pytest.raises(RlxError) as refusal:
        check_sources_at_start(settings)
    assert str(refusal.value) == line.format(dir=job_dir)


def test_the_shipped_fields_pass_both(job_dir):
    # The files as they should be: nothing at lint, nothing at start-up.
    _files(job_dir)
    trainer = {
        "data": {"train": "rows.parquet", "prompt_key": "question"},
        "reward": {"function": "rewards.py:fine"},
    }
    path = _write(job_dir, _recipe(trainer))
    assert _errors(path) == []
    check_sources_at_start(load_recipe(path).recipe.trainer)


def test_a_relative_data_file_is_made_before_launch_but_must_be_there_at_start(job_dir):
    # Lint leaves a relative file to the steps that make it; start-up needs it there.
    path = _write(job_dir, _recipe({"data": {"train": "data/train.jsonl"}}))
    assert _errors(path) == []
    with pytest.raises(RlxError) as refusal:
        check_sources_at_start(load_recipe(path).recipe.trainer)
    assert str(refusal.value) == (
        f"trainer.data.train: data/train.jsonl does not exist in {job_dir} (relative paths "
        f"start in the folder the job runs in); give {READABLE}, or {SYNTHETIC}"
    )


def test_relative_paths_start_in_the_workdir(job_dir):
    (job_dir / "src").mkdir()
    (job_dir / "src" / "rewards.py").write_text(REWARDS)
    trainer = {"data": {"train": SYNTHETIC}, "reward": {"function": "rewards.py:fine"}}
    assert _errors(_write(job_dir, _recipe(trainer, workdir="src"))) == []
    assert _errors(_write(job_dir, _recipe(trainer))) == [
        f"trainer.reward.function: reward 'rewards.py:fine': file 'rewards.py' does not exist "
        f"in {job_dir} (relative paths start in the folder the job runs in); fix the path, or "
        "write 'package.module:function' for an installed module"
    ]


# ------------------------------------------------------------------------------ rewards


def test_a_module_reward_is_left_to_the_head(job_dir):
    # Not importable here, and that is fine: setup: installs it on the nodes.
    trainer = {"data": {"train": SYNTHETIC}, "reward": {"function": "my_rewards.math:score"}}
    assert _errors(_write(job_dir, _recipe(trainer))) == []


def test_a_module_rewards_signature_is_checked_once_imported(job_dir):
    trainer = {"data": {"train": SYNTHETIC}, "reward": {"function": "my_rewards.math:score"}}
    settings = load_recipe(_write(job_dir, _recipe(trainer))).recipe.trainer

    def score(prompt: str, response: str) -> float:
        return 1.0

    with pytest.raises(RlxError) as refusal:
        check_reward_signature(settings, score)
    assert str(refusal.value) == (
        "trainer.reward.function: reward 'my_rewards.math:score' takes 2 arguments, and rlx "
        f"calls it with 3 (prompt, response, answer); write it as {SIGNATURE}"
    )
    check_reward_signature(settings, lambda prompt, response, answer: 1.0)


def _two(prompt, response):
    return 1.0


def _keyword(prompt, response, answer, *, scale):
    return scale


def test_a_file_and_an_imported_function_get_the_same_line(job_dir):
    # Lint reads the file's def (ast); start-up inspects the function it imported.
    _files(job_dir)
    for name, fn in (("two", _two), ("keyword", _keyword)):
        trainer = {"data": {"train": SYNTHETIC}, "reward": {"function": f"rewards.py:{name}"}}
        path = _write(job_dir, _recipe(trainer))
        [said] = _errors(path)
        with pytest.raises(RlxError) as refusal:
            check_reward_signature(load_recipe(path).recipe.trainer, fn)
        assert str(refusal.value) == said


@pytest.mark.parametrize(
    "positional,required,varargs,keywords,wrong",
    [
        (3, 3, False, [], None),
        (3, 2, False, [], None),  # answer=None
        (1, 1, True, [], None),  # fn(prompt, *rest)
        (4, 3, False, [], None),  # a fourth with a default
        (2, 2, False, [], "takes 2 arguments"),
        (1, 1, False, [], "takes 1 argument,"),
        (4, 4, False, [], "needs 4 arguments"),
        (3, 3, False, ["scale"], "needs keyword argument 'scale'"),
    ],
)
def test_which_signatures_take_the_call(positional, required, varargs, keywords, wrong):
    said = reward_arity_problem("f.py:score", positional, required, varargs, keywords)
    if wrong is None:
        assert said is None
    else:
        assert said == (
            f"reward 'f.py:score' {wrong}"
            + ("" if wrong.endswith(",") else ",")
            + f" and rlx calls it with 3 (prompt, response, answer); write it as {SIGNATURE}"
        )


# ------------------------------------------------------------------------ context window


def _model_folder(job_dir: Path, positions: int) -> Path:
    folder = job_dir / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": positions}))
    return folder


CONTEXT = [
    (
        {"max_new_tokens": 40000},
        {},
        "trainer.rollout.max_new_tokens: data.max_prompt_length 512 + rollout.max_new_tokens "
        f"40000 + 1 for the engine's probe = 40513 positions, more than {MODEL}'s 32768 "
        "(max_position_embeddings); write rollout.max_new_tokens: 32255 or less",
    ),
    (
        {"max_new_tokens": 256},
        {"max_prompt_length": 32768},
        "trainer.data.max_prompt_length: data.max_prompt_length 32768 + rollout.max_new_tokens "
        f"256 + 1 for the engine's probe = 33025 positions, more than {MODEL}'s 32768 "
        "(max_position_embeddings); lower data.max_prompt_length and rollout.max_new_tokens "
        "so that a prompt and a response fit in 32767 tokens",
    ),
]


@pytest.mark.parametrize("rollout,data,line", CONTEXT, ids=["response", "prompt"])
def test_the_context_window_is_one_line_at_lint_and_start(rollout, data, line, job_dir):
    trainer = {"data": {"train": SYNTHETIC, **data}, "rollout": rollout}
    path = _write(job_dir, _recipe(trainer))
    assert [e for e in _errors(path) if "positions" in e] == [line]
    with pytest.raises(RlxError) as refusal:
        check_context_at_start(load_recipe(path).recipe.trainer, _model_folder(job_dir, 32768))
    assert str(refusal.value) == line


def test_a_context_that_fits_exactly_passes(job_dir):
    # 512 + 32255 + 1 = 32768: the last position is used, none more.
    trainer = {"data": {"train": SYNTHETIC}, "rollout": {"max_new_tokens": 32255}}
    path = _write(job_dir, _recipe(trainer))
    assert [e for e in _errors(path) if "positions" in e] == []
    check_context_at_start(load_recipe(path).recipe.trainer, _model_folder(job_dir, 32768))


# ------------------------------------------------------------------------ packing budget

PACKING = (
    "trainer.batch.max_tokens_per_micro_batch: 700 tokens per packed pass hold no whole "
    "sequence (data.max_prompt_length + the response budget = 768 tokens); write "
    "max_tokens_per_micro_batch: 768 or more, or leave it unset (micro_batch_size sequences)"
)


def _packing(budget: int) -> dict:
    batch = {"packing": True, "max_tokens_per_micro_batch": budget}
    return {"data": {"train": SYNTHETIC}, "batch": batch}


def test_a_packing_budget_below_one_sequence_is_one_line(job_dir):
    path = _write(job_dir, _recipe(_packing(700)))
    assert _errors(path) == [PACKING]
    with pytest.raises(RlxError) as refusal:
        TrainJob.of(load_recipe(path).recipe)
    assert str(refusal.value) == PACKING


def test_a_packing_budget_of_one_sequence_passes(job_dir):
    assert _errors(_write(job_dir, _recipe(_packing(768)))) == []


# ------------------------------------------------------------------------- inline keys

WANDB_KEY = "5f1c9a3e7b2d4f60a8e19c7d3b5a2f4e6d8c0b91"  # 40 hex, as W&B issues them
HF_TOKEN = "hf_" + "aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789"


def test_a_wandb_key_in_env_is_one_line_and_not_echoed(job_dir):
    # The name says nothing (not *_API_KEY): the value's shape alone gives it away.
    path = _write(job_dir, _recipe({"data": {"train": SYNTHETIC}}, env={"WANDB_KEY": WANDB_KEY}))
    assert _errors(path) == [
        "env.WANDB_KEY: this value looks like a credential; remove it, list 'WANDB_KEY' under "
        "secrets and export it before launch"
    ]
    result = runner.invoke(app, ["lint", str(path)])
    assert result.exit_code == 1
    assert WANDB_KEY not in result.output


@pytest.mark.parametrize("name", ["GIT_COMMIT", "MODEL_REVISION", "DATA_SHA256"])
def test_a_commit_or_hash_named_so_is_a_pin_not_a_key(job_dir, name):
    digest = WANDB_KEY if name != "DATA_SHA256" else WANDB_KEY + WANDB_KEY[:24]
    path = _write(job_dir, _recipe({"data": {"train": SYNTHETIC}}, env={name: digest}))
    assert _errors(path) == []


def test_a_key_named_like_a_pin_and_a_secret_is_still_a_key(job_dir):
    path = _write(job_dir, _recipe({"data": {"train": SYNTHETIC}}, env={"SHA_TOKEN": WANDB_KEY}))
    assert len(_errors(path)) == 1


INLINE = (
    "this value holds what looks like a credential; remove it, list a name under secrets "
    "(e.g. HF_TOKEN), export it before launch and refer to it by that name ($HF_TOKEN in "
    "setup: or command:)"
)


@pytest.mark.parametrize(
    "top,field",
    [
        ({"setup": [f"hf auth login --token {HF_TOKEN}"]}, "setup[0]"),
        ({"setup": ["pip install rlx", f"export HF_TOKEN={HF_TOKEN}"]}, "setup[1]"),
        ({"command": ["python", "run.py", f"--token={HF_TOKEN}"]}, "command[2]"),
    ],
    ids=["setup", "setup-export", "command"],
)
def test_an_hf_token_in_setup_or_command_is_one_line(top, field, job_dir):
    trainer = {"data": {"train": SYNTHETIC}}
    path = _write(job_dir, _recipe(trainer, **top))
    assert _errors(path) == [f"{field}: {INLINE}"]
    result = runner.invoke(app, ["lint", str(path)])
    assert HF_TOKEN not in result.output


@pytest.mark.parametrize(
    "value",
    [
        "false",
        "/opt/models/qwen2.5-0.5b-instruct/checkpoints/step-000100",
        "Qwen/Qwen2.5-0.5B-Instruct",
        "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa1",  # long, but not random
        "https://wandb.ai/my-team/my-project/runs/abc123",
    ],
)
def test_plain_values_are_not_keys(value, job_dir):
    path = _write(job_dir, _recipe({"data": {"train": SYNTHETIC}}, env={"SETTING": value}))
    assert _errors(path) == []


# ---------------------------------------------------------------------------- the CLI


def test_rlx_lint_on_a_bad_recipe_is_one_line_and_exit_1(job_dir):
    _files(job_dir)
    path = _write(job_dir, _recipe({"data": {"train": "rows.csv"}}))
    result = runner.invoke(app, ["lint", str(path)])
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    said = [line for line in result.stdout.splitlines() if ": error: " in line]
    written = path.read_text().splitlines().index("    train: rows.csv") + 1
    assert said == [f"{path}:{written}: error: {CASES[1][2]}"]


# ------------------------------------------------------------------------ hub datasets

HUB = "hf://rlx-tests/letters-or-digits"
HUB_DATA = {"train": HUB, "config": "letters", "prompt_key": "question", "answer_key": "kind"}

# (case, trainer section, the one line lint and start-up give; {cache}: the hub cache)
HUB_CASES: list[tuple[str, dict, str]] = [
    (
        "missing-id",
        {"data": {**HUB_DATA, "train": "hf://rlx-tests/nothing"}},
        "trainer.data.train: rlx-tests/nothing is not in the Hugging Face cache {cache} and "
        "HF_HUB_OFFLINE=1 forbids fetching it; fetch it first (hf download rlx-tests/nothing "
        "--repo-type dataset) or unset HF_HUB_OFFLINE",
    ),
    (
        "missing-revision",
        {"data": {**HUB_DATA, "train": f"{HUB}@v9"}},
        "trainer.data.train: rlx-tests/letters-or-digits is not in the Hugging Face cache "
        "{cache} at revision 'v9' and HF_HUB_OFFLINE=1 forbids fetching it; fetch it first "
        "(hf download rlx-tests/letters-or-digits --repo-type dataset) or unset HF_HUB_OFFLINE",
    ),
    (
        "malformed-id",
        {"data": {**HUB_DATA, "train": "hf://letters"}},
        "trainer.data.train: hf://letters is not a hub dataset id; write hf://org/name or "
        "hf://org/name@revision (a branch, tag or commit), e.g. hf://openai/gsm8k",
    ),
    (
        "missing-config",
        {"data": {**HUB_DATA, "config": "words"}},
        f"trainer.data.train: {HUB} has no configuration 'words'; its configurations: "
        "letters, plain; write data.config: one of them",
    ),
    (
        "config-needed",
        {"data": {**HUB_DATA, "config": None}},
        f"trainer.data.train: {HUB} has configurations letters, plain and none is the "
        "default; choose one with data.config",
    ),
    (
        "missing-split",
        {"data": HUB_DATA, "validation": {"data": HUB, "split": "validation"}},
        f"trainer.validation.data: {HUB} (configuration letters) has no split 'validation'; "
        "its splits: train, test; write validation.split: one of them",
    ),
    (
        "missing-column",
        {"data": {**HUB_DATA, "prompt_key": "prompt"}},
        f"trainer.data.train: {HUB}@{{commit}} (split train, config letters) has no 'prompt' "
        "in its first row (data.prompt_key); its columns: question, kind; write "
        "data.prompt_key: one of them (dotted for nested fields)",
    ),
    (
        "template-file-missing",
        {"data": {**HUB_DATA, "chat_template_override": "/nowhere/chat.jinja"}},
        "trainer.data.chat_template_override: /nowhere/chat.jinja does not exist; give a "
        "Jinja template file, or the template itself (text with {{{{ or {{%)",
    ),
]


@pytest.fixture
def hub_job_dir(job_dir: Path, dataset_cache, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name, value in dataset_cache.env.items():
        monkeypatch.setenv(name, value)
    return job_dir


def _hub_line(line: str, cache) -> str:
    return line.format(cache=cache.root, commit=cache.commit[:12])


@pytest.mark.parametrize("case,trainer,line", HUB_CASES, ids=[c[0] for c in HUB_CASES])
def test_lint_says_a_hub_datasets_problem_in_one_line(
    case, trainer, line, hub_job_dir, dataset_cache
):
    path = _write(hub_job_dir, _recipe(trainer))
    assert _errors(path) == [_hub_line(line, dataset_cache)]


@pytest.mark.parametrize("case,trainer,line", HUB_CASES, ids=[c[0] for c in HUB_CASES])
def test_start_up_says_lints_line_for_a_hub_dataset(
    case, trainer, line, hub_job_dir, dataset_cache
):
    settings = load_recipe(_write(hub_job_dir, _recipe(trainer))).recipe.trainer
    with pytest.raises(RlxError) as refusal:
        check_sources_at_start(settings)
    assert str(refusal.value) == _hub_line(line, dataset_cache)


def test_a_hub_dataset_as_it_should_be_passes_both(hub_job_dir):
    trainer = {"data": HUB_DATA, "validation": {"data": HUB}}
    path = _write(hub_job_dir, _recipe(trainer))
    assert _errors(path) == []
    check_sources_at_start(load_recipe(path).recipe.trainer)


def test_lint_leaves_a_dataset_its_cache_lacks_to_the_node(job_dir, monkeypatch):
    # Online, a dataset this machine has never fetched is the job's node's to fetch.
    monkeypatch.setenv("HF_HUB_CACHE", str(job_dir / "empty-hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    trainer = {"data": {**HUB_DATA, "train": "hf://rlx-tests/elsewhere"}}
    assert _errors(_write(job_dir, _recipe(trainer))) == []


def test_a_mixed_in_datasets_problem_names_its_place(hub_job_dir, dataset_cache):
    mixed = {"train": HUB, "weight": 2, "config": "plain", "split": "dev"}
    trainer = {"data": {**HUB_DATA, "mix": [mixed]}}
    line = (
        f"trainer.data.mix[0].train: {HUB} (configuration plain) has no split 'dev'; its "
        "splits: train, test; write data.mix[0].split: one of them"
    )
    path = _write(hub_job_dir, _recipe(trainer))
    assert _errors(path) == [line]
    with pytest.raises(RlxError) as refusal:
        check_sources_at_start(load_recipe(path).recipe.trainer)
    assert str(refusal.value) == line
