from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlx.trainer.model.tiny import build_tokenizer
from rlx.trainer.tasks.data import (
    DataError,
    PromptSampler,
    get_field,
    load_prompt_dataset,
    read_rows,
)
from rlx.trainer.tasks.synthetic import write_arithmetic_dataset, write_synthetic_dataset

GENERATION_PROMPT = "<|im_start|>assistant\n"


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _write_verl_parquet(path: Path) -> Path:
    """Two GSM8K rows exactly as verl's gsm8k preprocessing lays them out."""
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [
                {
                    "role": "user",
                    "content": "Natalia sold 48 clips. Let's think step by step and output "
                    'the final answer after "####".',
                }
            ],
            "ability": "math",
            "reward_model": {"ground_truth": "72", "style": "rule"},
            "extra_info": {"split": "train", "index": 0},
        },
        {
            "data_source": "openai/gsm8k",
            "prompt": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weng earns $12 an hour. How much for 50 min?"},
            ],
            "ability": "math",
            "reward_model": {"ground_truth": "10", "style": "rule"},
            "extra_info": {"split": "train", "index": 1},
        },
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_jsonl_plain_prompts_are_used_as_is(tmp_path: Path, tiny_tokenizer) -> None:
    path = _write_jsonl(
        tmp_path / "d.jsonl",
        [{"prompt": "2+2=", "answer": 4}, {"prompt": "héllo", "answer": "x"}, {"prompt": "z"}],
    )
    data = load_prompt_dataset(path, tiny_tokenizer, answer_key=None)
    assert data.prompts == ["2+2=", "héllo", "z"]
    assert data.prompt_token_ids[1] == list("héllo".encode())
    assert data.answers == [None, None, None]
    assert len(data) == 3


def test_jsonl_answers_and_chat_template_for_strings(tmp_path: Path, tiny_tokenizer) -> None:
    path = _write_jsonl(
        tmp_path / "d.jsonl", [{"prompt": "2+2=", "answer": 4}, {"prompt": "1+1=", "answer": 2.0}]
    )
    data = load_prompt_dataset(
        path, tiny_tokenizer, answer_key="answer", chat_template_for_strings=True
    )
    assert data.prompts[0] == "<|im_start|>user\n2+2=<|im_end|>\n" + GENERATION_PROMPT
    assert data.answers == ["4", "2"]
    assert tiny_tokenizer.decode(data.prompt_token_ids[0]) == data.prompts[0]


def test_verl_gsm8k_parquet_layout(tmp_path: Path, tiny_tokenizer) -> None:
    path = _write_verl_parquet(tmp_path / "train.parquet")
    data = load_prompt_dataset(path, tiny_tokenizer, answer_key="reward_model.ground_truth")
    assert data.answers == ["72", "10"]
    assert data.prompts[0].startswith("<|im_start|>user\nNatalia sold 48 clips.")
    assert data.prompts[1].startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    assert all(p.endswith(GENERATION_PROMPT) for p in data.prompts)
    assert data.row_indices == [0, 1]


def test_synthetic_writers_load(tmp_path: Path, tiny_tokenizer) -> None:
    parquet = write_arithmetic_dataset(tmp_path / "a.parquet", 5, seed=0)
    jsonl = write_arithmetic_dataset(tmp_path / "a.jsonl", 5, seed=0)
    from_parquet = load_prompt_dataset(
        parquet, tiny_tokenizer, answer_key="reward_model.ground_truth"
    )
    from_jsonl = load_prompt_dataset(
        jsonl, tiny_tokenizer, answer_key="answer", chat_template_for_strings=True
    )
    assert from_parquet.prompts == from_jsonl.prompts
    assert from_parquet.answers == from_jsonl.answers
    letters = load_prompt_dataset(
        write_synthetic_dataset(tmp_path / "s.jsonl", 40, seed=0),
        tiny_tokenizer,
        answer_key="answer",
    )
    assert set(letters.answers) == {"digits", "letters"}
    assert set(letters.prompts) == {"Write digits.", "Write letters."}


def test_synthetic_dataset_is_deterministic(tmp_path: Path) -> None:
    a = write_synthetic_dataset(tmp_path / "a.jsonl", 50, seed=7).read_bytes()
    b = write_synthetic_dataset(tmp_path / "b.jsonl", 50, seed=7).read_bytes()
    c = write_synthetic_dataset(tmp_path / "c.jsonl", 50, seed=8).read_bytes()
    assert a == b != c


def test_get_field_dotted_and_literal_keys() -> None:
    row = {"reward_model": {"ground_truth": "72", "style": "rule"}, "a.b": 1, "a": {"b": 2}}
    assert get_field(row, "reward_model.ground_truth") == "72"
    assert get_field(row, "a.b") == 1  # a literal column name wins
    with pytest.raises(
        KeyError, match="no 'truth' under 'reward_model'; keys there: ground_truth, style"
    ):
        get_field(row, "reward_model.truth")
    with pytest.raises(KeyError, match=r"'reward_model\.style' is a str, not a mapping"):
        get_field(row, "reward_model.style.x")


def test_missing_key_names_the_key_and_the_keys_that_exist(tmp_path: Path, tiny_tokenizer) -> None:
    path = _write_verl_parquet(tmp_path / "train.parquet")
    with pytest.raises(DataError) as info:
        load_prompt_dataset(path, tiny_tokenizer, prompt_key="question")
    assert str(info.value) == (
        f"{path}: row 0: key 'question': no 'question' in the row; "
        "keys there: data_source, prompt, ability, reward_model, extra_info"
    )
    with pytest.raises(
        DataError, match="no 'answer' under 'reward_model'; keys there: ground_truth, style"
    ):
        load_prompt_dataset(path, tiny_tokenizer, answer_key="reward_model.answer")


def test_file_and_format_errors(tmp_path: Path, tiny_tokenizer) -> None:
    with pytest.raises(DataError, match="does not exist"):
        read_rows(tmp_path / "missing.jsonl")
    csv = tmp_path / "d.csv"
    csv.write_text("prompt\nhi\n")
    with pytest.raises(DataError, match=r"suffix '\.csv'.*\.jsonl, \.ndjson, \.parquet"):
        read_rows(csv)
    with pytest.raises(DataError, match="unknown data format 'csv'; valid: jsonl, parquet"):
        read_rows(csv, data_format="csv")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": oops}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: invalid JSON"):
        read_rows(bad)
    not_object = tmp_path / "list.jsonl"
    not_object.write_text("[1, 2]\n")
    with pytest.raises(DataError, match="must be a JSON object, got list"):
        read_rows(not_object)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="holds no rows"):
        read_rows(empty)
    fake = tmp_path / "fake.parquet"
    fake.write_text("not parquet")
    with pytest.raises(DataError, match="not a readable parquet file"):
        read_rows(fake)


def test_explicit_format_overrides_the_suffix(tmp_path: Path) -> None:
    path = tmp_path / "rows.txt"
    path.write_text('{"prompt": "a"}\n')
    assert read_rows(path, data_format="jsonl") == [{"prompt": "a"}]


def test_bad_prompt_values(tmp_path: Path, tiny_tokenizer) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "fine"}, {"prompt": 5}])
    with pytest.raises(DataError, match="row 1: a prompt must be a string or a list of"):
        load_prompt_dataset(path, tiny_tokenizer)
    messages = _write_jsonl(tmp_path / "m.jsonl", [{"prompt": [{"role": "user", "content": "x"}]}])
    no_template = build_tokenizer()
    no_template.chat_template = None
    with pytest.raises(DataError, match="row 0: the tokenizer has no chat template"):
        load_prompt_dataset(messages, no_template)


def test_overlong_prompts_filter_truncate_error(tmp_path: Path, tiny_tokenizer) -> None:
    path = _write_jsonl(
        tmp_path / "d.jsonl",
        [{"prompt": "short"}, {"prompt": "x" * 20 + "END"}, {"prompt": "tiny"}],
    )
    filtered = load_prompt_dataset(path, tiny_tokenizer, max_prompt_length=8, overlong="filter")
    assert filtered.prompts == ["short", "tiny"]
    assert filtered.row_indices == [0, 2]
    assert (filtered.n_filtered, filtered.n_truncated) == (1, 0)
    assert "1 filtered" in filtered.summary()

    truncated = load_prompt_dataset(path, tiny_tokenizer, max_prompt_length=8, overlong="truncate")
    assert truncated.prompts == ["short", "xxxxxEND", "tiny"]  # the end survives
    assert [len(ids) for ids in truncated.prompt_token_ids] == [5, 8, 4]
    assert (truncated.n_filtered, truncated.n_truncated) == (0, 1)

    with pytest.raises(
        DataError, match="row 1: prompt has 23 tokens, more than max_prompt_length 8"
    ):
        load_prompt_dataset(path, tiny_tokenizer, max_prompt_length=8, overlong="error")
    with pytest.raises(DataError, match="all 3 prompts are longer"):
        load_prompt_dataset(path, tiny_tokenizer, max_prompt_length=2)
    with pytest.raises(
        DataError, match="unknown overlong policy 'drop'; valid: filter, truncate, error"
    ):
        load_prompt_dataset(path, tiny_tokenizer, max_prompt_length=8, overlong="drop")


def test_truncation_keeps_the_generation_prompt(tmp_path: Path, tiny_tokenizer) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": [{"role": "user", "content": "q" * 50}]}])
    data = load_prompt_dataset(path, tiny_tokenizer, max_prompt_length=30, overlong="truncate")
    assert len(data.prompt_token_ids[0]) == 30
    assert data.prompts[0].endswith("<|im_end|>\n" + GENERATION_PROMPT)


# --- sampler -------------------------------------------------------------------------


def _take(sampler: PromptSampler, count: int) -> list[list[int]]:
    return [next(sampler) for _ in range(count)]


def test_sampler_epochs_are_permutations_reshuffled_each_epoch() -> None:
    sampler = PromptSampler(n_rows=10, batch_size=5, seed=3)
    epoch0 = _take(sampler, 2)
    epoch1 = _take(sampler, 2)
    assert sorted(epoch0[0] + epoch0[1]) == list(range(10))
    assert sorted(epoch1[0] + epoch1[1]) == list(range(10))
    assert epoch0 != epoch1
    assert sampler.epoch == 1


def test_sampler_is_deterministic_per_seed() -> None:
    a = _take(PromptSampler(20, 4, seed=1), 12)
    b = _take(PromptSampler(20, 4, seed=1), 12)
    c = _take(PromptSampler(20, 4, seed=2), 12)
    assert a == b != c


def test_sampler_full_batches_only() -> None:
    sampler = PromptSampler(n_rows=7, batch_size=3, seed=0)
    assert sampler.batches_per_epoch == 2
    batches = _take(sampler, 5)
    assert all(len(b) == 3 for b in batches)
    assert len(set(batches[0] + batches[1])) == 6  # no row twice within an epoch


def test_sampler_without_shuffle_walks_in_order() -> None:
    sampler = PromptSampler(n_rows=5, batch_size=2, seed=0, shuffle=False)
    assert _take(sampler, 3) == [[0, 1], [2, 3], [0, 1]]


@pytest.mark.parametrize("stop_after", [0, 1, 3, 4, 7, 10])
def test_sampler_resume_matches_an_uninterrupted_run(stop_after: int) -> None:
    uninterrupted = _take(PromptSampler(n_rows=13, batch_size=3, seed=5), 16)
    first = PromptSampler(n_rows=13, batch_size=3, seed=5)
    head = _take(first, stop_after)
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint file
    resumed = PromptSampler(n_rows=13, batch_size=3, seed=5)
    resumed.load_state_dict(state)
    assert head + _take(resumed, 16 - stop_after) == uninterrupted


def test_sampler_rejects_a_state_from_other_settings() -> None:
    state = PromptSampler(n_rows=10, batch_size=2, seed=0).state_dict()
    with pytest.raises(ValueError, match="sampler state has n_rows=10 but this sampler has 12"):
        PromptSampler(n_rows=12, batch_size=2, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=0 but this sampler has 1"):
        PromptSampler(n_rows=10, batch_size=2, seed=1).load_state_dict(state)


def test_sampler_argument_errors() -> None:
    with pytest.raises(ValueError, match="3 prompts, fewer than one batch of 4"):
        PromptSampler(n_rows=3, batch_size=4, seed=0)
    with pytest.raises(ValueError, match="batch_size must be at least 1"):
        PromptSampler(n_rows=3, batch_size=0, seed=0)
