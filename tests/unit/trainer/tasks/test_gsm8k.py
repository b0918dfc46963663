"""`rlx data gsm8k`: GSM8K's own file -> the prompt file gsm8k-tools.yaml reads, whose answers
the calculator environment scores."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlx.recipe.model import DataSettings
from rlx.trainer.episodes.env import Row, Turn
from rlx.trainer.tasks.data import load_recipe_prompts
from rlx.trainer.tasks.gsm8k import SYSTEM_TOOLS
from rlx.trainer.tasks.tools import Calculator
from tests.support.cli import assert_one_line_error, invoke

ROWS = [
    {
        "question": "Tom has 3 boxes of 12 pens. How many pens?",
        "answer": "3 boxes of 12 is <<3*12=36>>36.\n#### 36",
    },
    {"question": "A car costs 1,200 and a bike 300. Total?", "answer": "1200+300=1500\n#### 1,500"},
]


def openai_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_tools_prompts_load_as_the_recipe_says_and_the_calculator_scores_them(
    tmp_path: Path, tiny_tokenizer, suffix: str
) -> None:
    source = openai_parquet(tmp_path / "train-00000-of-00001.parquet", ROWS)
    out = tmp_path / "data" / "gsm8k-tools" / f"train{suffix}"
    result = invoke(["data", "gsm8k", str(source), str(out), "--tools"])
    assert result.exit_code == 0, result.output
    assert f"wrote 2 gsm8k prompts from {source} to {out}" in result.output
    assert not list(out.parent.glob("*.partial"))

    # The keys recipes/gsm8k-tools.yaml names.
    data = DataSettings(train=str(out), prompt_key="prompt", answer_key="answer")
    dataset = load_recipe_prompts(out, tiny_tokenizer, data)
    assert dataset.answers == ["36", "1500"]
    assert "<calc>EXPRESSION</calc>" in dataset.prompts[0]
    assert ROWS[0]["question"] in dataset.prompts[0]
    assert dataset.columns[0]["prompt"][0] == {"role": "system", "content": SYSTEM_TOOLS}

    env = Calculator()
    env.reset(Row(prompt=dataset.prompts[1], answer=dataset.answers[1], columns={}, index=1))
    call = env.step(Turn(index=0, text="<calc>1200 + 300</calc>", ids=(), finished=True))
    assert (call.observation, call.done) == ({"role": "tool", "content": "1500"}, False)
    assert env.step(Turn(index=1, text="So\n#### 1500", ids=(), finished=True)).reward == 1.0


def test_plain_prompts_have_no_tool(tmp_path: Path) -> None:
    source = openai_parquet(tmp_path / "test.parquet", ROWS)
    out = tmp_path / "test.jsonl"
    assert invoke(["data", "gsm8k", str(source), str(out)]).exit_code == 0
    assert "<calc>" not in out.read_text()


def test_bad_input_is_one_line_and_writes_nothing(tmp_path: Path) -> None:
    source = openai_parquet(tmp_path / "s.parquet", ROWS)
    wrong = openai_parquet(tmp_path / "w.parquet", [{"problem": "x", "solution": "y"}])
    unfinished = openai_parquet(tmp_path / "u.parquet", [{"question": "q", "answer": "36"}])
    out = tmp_path / "out.jsonl"
    cases = [
        (wrong, out, "row 0: GSM8K rows have text columns 'question' and 'answer'"),
        (unfinished, out, "row 0: the answer does not end with a '#### N' line"),
        (tmp_path / "none.parquet", out, "does not exist"),
        (source, "s3://bucket/train.jsonl", "is a URL; rlx data writes a file"),
        (source, tmp_path / "out.csv", "cannot tell the format"),
    ]
    for src, dst, needle in cases:
        assert_one_line_error(invoke(["data", "gsm8k", str(src), str(dst)]), needle)
        assert not out.exists()
    out.write_text("kept\n")
    assert_one_line_error(invoke(["data", "gsm8k", str(source), str(out)]), "exists")
    assert out.read_text() == "kept\n"
