"""`rlx data math500 | aime`: the benchmarks' own rows (a file, or the dataset by id from a hub
cache the test fills in the hub's own layout) -> prompt files whose answers the math_verify
reward scores from a \\boxed{} answer."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlx.recipe.model import DataSettings
from rlx.trainer.tasks.benchmarks import MATH_SYSTEM
from rlx.trainer.tasks.data import load_recipe_prompts
from rlx.trainer.tasks.rewards import math_verify
from tests.support.cli import assert_one_line_error, invoke
from tests.support.hub import dataset_readme, fill_dataset_cache

# HuggingFaceH4/MATH-500's columns
MATH500 = [
    {
        "problem": "Compute $\\frac{7}{3} \\cdot 2$.",
        "solution": "It is $\\boxed{\\frac{14}{3}}$.",
        "answer": "\\frac{14}{3}",
        "subject": "Prealgebra",
        "level": 1,
        "unique_id": "test/prealgebra/1.json",
    },
    {
        "problem": "What is $\\sqrt{16}$?",
        "solution": "$\\boxed{4}$",
        "answer": "4",
        "subject": "Algebra",
        "level": 1,
        "unique_id": "test/algebra/2.json",
    },
]
# an AIME set that writes its columns capitalised, the answer an integer
AIME = [
    {"ID": "2024-I-1", "Problem": "Find the remainder of 2024 divided by 1000.", "Answer": 24},
    {"ID": "2024-I-2", "Problem": "Find $x$ if $x + 1 = 205$.", "Answer": 204},
]


def test_math500_prompts_ask_for_a_boxed_answer_that_math_verify_scores(
    tmp_path: Path, tiny_tokenizer
) -> None:
    source = tmp_path / "test-00000-of-00001.parquet"
    pq.write_table(pa.Table.from_pylist(MATH500), source)
    out = tmp_path / "data" / "math500.jsonl"
    result = invoke(["data", "math500", str(source), str(out)])
    assert result.exit_code == 0, result.output
    assert f"wrote 2 math500 prompts from {source} to {out}" in result.output

    data = DataSettings(train=str(out), prompt_key="prompt", answer_key="answer")
    dataset = load_recipe_prompts(out, tiny_tokenizer, data)
    assert dataset.answers == ["\\frac{14}{3}", "4"]
    assert dataset.columns[0]["prompt"][0] == {"role": "system", "content": MATH_SYSTEM}
    assert MATH500[1]["problem"] in dataset.prompts[1]
    score = math_verify(dataset.prompts[0], "So it is \\boxed{\\frac{14}{3}}.", dataset.answers[0])
    assert score == 1.0
    assert math_verify(dataset.prompts[0], "\\boxed{5}", dataset.answers[0]) == 0.0


def test_aime_by_id_reads_the_split_at_the_cached_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(AIME), repo / "data" / "train-00000-of-00001.parquet")
    (repo / "README.md").write_text(dataset_readme({"default": {"train": "data/train-*"}}))
    cache = fill_dataset_cache(tmp_path / "hub", repo, repo_id="HuggingFaceH4/aime_2024")
    for name, value in cache.env.items():
        monkeypatch.setenv(name, value)

    out = tmp_path / "aime.jsonl"
    result = invoke(["data", "aime", "hf://HuggingFaceH4/aime_2024", str(out)])
    assert result.exit_code == 0, result.output
    assert f"hf://HuggingFaceH4/aime_2024@{cache.commit[:12]} (split train)" in result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["answer"] for row in rows] == ["24", "204"]
    assert rows[1]["prompt"][1] == {"role": "user", "content": AIME[1]["Problem"]}
    assert math_verify("", "x is \\boxed{204}", rows[1]["answer"]) == 1.0

    missing = invoke(
        [
            "data",
            "aime",
            "hf://HuggingFaceH4/aime_2024",
            str(tmp_path / "t.jsonl"),
            "--split",
            "test",
        ]
    )
    assert_one_line_error(missing, "has no split 'test'", "its splits: train")
    assert not (tmp_path / "t.jsonl").exists()


def test_bad_input_is_one_line_and_writes_nothing(tmp_path: Path) -> None:
    source = tmp_path / "math.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in MATH500))
    wrong = tmp_path / "gsm8k.jsonl"
    wrong.write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n")
    out = tmp_path / "out.jsonl"
    cases = [
        (["math500", str(wrong), str(out)], "row 0: MATH-500 rows have a text column 'problem'"),
        (["aime", str(wrong), str(out)], "row 0: AIME rows have a text column 'problem'"),
        (["math500", str(source), str(out), "--tools"], "math500 has no tool prompts"),
        (["math500", str(source), str(out), "--split", "test"], "is a file"),
        (["math500", "s3://bucket/math.jsonl", str(out)], "is a URL; rlx data reads a file"),
        (["math500", "hf://just-a-name", str(out)], "rlx data SOURCE: hf://just-a-name"),
    ]
    for args, needle in cases:
        assert_one_line_error(invoke(["data", *args]), needle)
        assert not out.exists()
