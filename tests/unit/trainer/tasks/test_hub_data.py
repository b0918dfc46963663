"""Prompts from a dataset repository named by id (hf://org/name[@revision]), served from a hub
cache the test fills in the hub's own layout (HF_HUB_OFFLINE=1): the quickstart's task read
by configuration, split and columns, at the commit this process resolved first; and the chat
format (template variables, a system prompt, a template of one's own) reaching the template."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlx import hub
from rlx.recipe.model import DataSettings
from rlx.trainer.resolve import resolve_data_path
from rlx.trainer.tasks.data import (
    ChatFormat,
    DataError,
    HubSource,
    hub_source,
    load_recipe_prompts,
    read_rows,
    render_prompt,
)
from rlx.trainer.tasks.synthetic import write_synthetic_dataset
from tests.support.hub import (
    ANSWER_COLUMN,
    DATASET_ID,
    PROMPT_COLUMN,
    fill_dataset_cache,
    write_dataset_repo,
)

SPEC = f"hf://{DATASET_ID}"


@pytest.fixture
def served(dataset_cache, monkeypatch: pytest.MonkeyPatch):
    for name, value in dataset_cache.env.items():
        monkeypatch.setenv(name, value)
    return dataset_cache


def _settings(**fields) -> DataSettings:
    base = {
        "train": SPEC,
        "config": "letters",
        "prompt_key": PROMPT_COLUMN,
        "answer_key": ANSWER_COLUMN,
    }
    return DataSettings(**{**base, **fields})


def test_the_quickstart_prompts_load_by_id(served, tiny_tokenizer, tmp_path: Path) -> None:
    data = _settings()
    source = resolve_data_path(data.train, tmp_path, seed=0, config="letters", split="train")
    assert isinstance(source, HubSource) and source.folder == served.snapshot
    dataset = load_recipe_prompts(source, tiny_tokenizer, data)
    # The rows the quickstart generates for itself, through the chat template as there.
    rows = read_rows(write_synthetic_dataset(tmp_path / "rows.jsonl", 64, seed=0))
    assert dataset.answers == [row["answer"] for row in rows]
    assert rows[0]["prompt"] in dataset.prompts[0] != rows[0]["prompt"]
    assert dataset.source == f"{SPEC}@{served.commit[:12]} (split train, config letters)"
    assert dataset.revisions == {SPEC: served.commit}  # what a checkpoint records
    # The held-out split: the task's other phrasings.
    test = resolve_data_path(data.train, tmp_path, seed=0, config="letters", split="test")
    held_out = load_recipe_prompts(test, tiny_tokenizer, data)
    assert not set(held_out.prompts) & set(dataset.prompts)


def test_the_commit_resolved_first_is_read_all_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = fill_dataset_cache(tmp_path / "hub", write_dataset_repo(tmp_path / "v1"))
    for name, value in first.env.items():
        monkeypatch.setenv(name, value)
    assert hub_source(SPEC, "letters", "train").folder == first.snapshot
    # The branch moves on (a push during the run): this process keeps its commit.
    later = fill_dataset_cache(first.root, write_dataset_repo(tmp_path / "v2", seed=1))
    assert later.commit != first.commit
    assert hub_source(SPEC, "letters", "train").folder == first.snapshot
    # A revision written in the id: a commit, or a tag or branch the cache knows.
    fill_dataset_cache(first.root, tmp_path / "v2", ref="v2")
    assert hub_source(f"{SPEC}@{first.commit}", None, "train").folder == first.snapshot
    assert hub_source(f"{SPEC}@v2", None, "train").folder == later.snapshot
    # A run started now resolves main afresh.
    monkeypatch.setattr(hub, "_PINNED", {})
    assert hub_source(SPEC, "letters", "train").folder == later.snapshot


def test_a_malformed_id_is_one_line() -> None:
    with pytest.raises(DataError) as refusal:
        hub_source("hf://gsm8k", None, "train")
    assert str(refusal.value) == (
        "trainer.data.train: hf://gsm8k is not a hub dataset id; write hf://org/name or "
        "hf://org/name@revision (a branch, tag or commit), e.g. hf://openai/gsm8k"
    )


# ----------------------------------------------------------------------------- chat format

# A template that writes out what reaches it: the messages and the variables.
PRINTING = (
    "{% for m in messages %}[{{ m.role }}: {{ m.content }}]{% endfor %}"
    "thinking={{ enable_thinking }} style={{ style | default('none') }}"
    "{% if add_generation_prompt %}<go>{% endif %}"
)


def test_template_variables_and_the_system_prompt_reach_the_template(
    tiny_tokenizer, tmp_path: Path
) -> None:
    (tmp_path / "printing.jinja").write_text(PRINTING)
    data = DataSettings(
        train="x.jsonl",
        chat_template_kwargs={"enable_thinking": False, "style": "terse"},
        system_prompt="Answer briefly.",
        chat_template_override="printing.jinja",
    )
    chat = ChatFormat.of_settings(data, tmp_path)
    assert chat.template == PRINTING
    assert render_prompt(tiny_tokenizer, "Write digits.", chat=chat) == (
        "[system: Answer briefly.][user: Write digits.]thinking=False style=terse<go>"
    )
    # Messages that bring their own system message keep it.
    own = [{"role": "system", "content": "Mine."}, {"role": "user", "content": "Hi"}]
    assert render_prompt(tiny_tokenizer, own, chat=chat).startswith("[system: Mine.][user: Hi]")
    # The template itself in the field, and what the recipe's data gives the dataset.
    inline = ChatFormat.of_settings(data.model_copy(update={"chat_template_override": PRINTING}))
    assert inline == chat
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "Write letters.", "answer": "letters"}\n')
    dataset = load_recipe_prompts(rows, tiny_tokenizer, data, tmp_path)
    assert dataset.prompts == [
        "[system: Answer briefly.][user: Write letters.]thinking=False style=terse<go>"
    ]


def test_the_tokenizers_own_template_gets_the_variables(tiny_tokenizer) -> None:
    # Without an override, the variables go to the tokenizer's template.
    tokenizer = type(tiny_tokenizer).from_pretrained(tiny_tokenizer.name_or_path)
    tokenizer.chat_template = PRINTING
    chat = ChatFormat(for_strings=True, kwargs={"enable_thinking": True})
    assert render_prompt(tokenizer, "Hi", chat=chat) == "[user: Hi]thinking=True style=none<go>"
    # Plain text without the template stays as it is, system prompt or not.
    plain = ChatFormat(for_strings=False, system_prompt="Ignored for text.")
    assert render_prompt(tokenizer, "Hi", chat=plain) == "Hi"


# ----------------------------------------------------------------------------- mixing


def test_a_mix_holds_each_source_in_proportion_to_its_weight(
    served, tiny_tokenizer, tmp_path: Path
) -> None:
    from rlx.trainer.tasks.data import mix_datasets

    data = _settings()
    letters = load_recipe_prompts(
        resolve_data_path(SPEC, tmp_path, 0, config="letters", split="train"),
        tiny_tokenizer,
        data,
    )
    rows = tmp_path / "few.jsonl"
    rows.write_text('{"question": "Write digits.", "kind": "digits"}\n' * 16)
    few = load_recipe_prompts(rows, tiny_tokenizer, data)
    mixed = mix_datasets([(letters, 1.0), (few, 3.0)], seed=0)
    # 80 prompts in all: a quarter from the 64 letters rows, three quarters from the 16
    # rows drawn again and again.
    assert len(mixed) == 80 and mixed.answers.count("digits") >= 60
    assert mixed.prompts[20:] == [few.prompts[0]] * 60
    assert len(set(mixed.prompts[:20])) > 1 and set(mixed.prompts[:20]) <= set(letters.prompts)
    assert mixed == mix_datasets([(letters, 1.0), (few, 3.0)], seed=0)  # seeded
    assert mixed.revisions == letters.revisions and not few.revisions  # a file has none
    assert mix_datasets([(letters, 2.0)], seed=0) is letters
