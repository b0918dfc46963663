"""Prompt files from benchmarks as published (`rlx data TASK SOURCE OUT`): GSM8K for
training and validation, MATH-500 and AIME for evaluation.

The source is the benchmark's own file (jsonl or parquet) or its dataset repository by id,
`hf://ORG/NAME[@revision]`, served by the hub cache as training data is (rlx.trainer.tasks.data):
- gsm8k: openai/gsm8k (config `main`), a `question` and an `answer` ending in `#### N`
  (rlx.trainer.tasks.gsm8k);
- math500: HuggingFaceH4/MATH-500 (split `test`), a `problem` and its `answer` in LaTeX;
- aime: an AIME set such as HuggingFaceH4/aime_2024 (split `train`), a `problem` and an
  integer `answer` (column names in any case: some sets write `Problem` and `Answer`).

Each row becomes a chat prompt (a system message, the problem as the user's message) and
`answer`. The math prompts ask for the final answer in \\boxed{}, which the math_verify
reward extracts and compares symbolically; GSM8K's ask for `#### N`, the gsm8k reward's.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlx.storage import is_url
from rlx.trainer.tasks import gsm8k
from rlx.trainer.tasks.data import (
    DataError,
    HubSource,
    chat_prompt_row,
    detect_format,
    hub_source,
    read_rows,
)

MATH_SYSTEM = "Solve the problem. Reason step by step, then give the final answer in \\boxed{}."

Rows = Callable[[Iterable[Mapping[str, Any]], str], list[dict]]


def _column(row: Mapping[str, Any], name: str) -> Any:
    """The row's column `name`, matched in any case."""
    for key, value in row.items():
        if key.lower() == name:
            return value
    return None


def math_rows(benchmark: str) -> Rows:
    """The prompt rows of a benchmark whose rows hold a `problem` and its `answer`."""

    def rows(source_rows: Iterable[Mapping[str, Any]], source: str) -> list[dict]:
        out = []
        for index, row in enumerate(source_rows):
            problem, answer = _column(row, "problem"), _column(row, "answer")
            if not isinstance(problem, str) or not isinstance(answer, str | int) or answer == "":
                raise DataError(
                    f"{source}: row {index}: {benchmark} rows have a text column 'problem' and "
                    f"an 'answer'; this one has {sorted(row)}"
                )
            out.append(chat_prompt_row(MATH_SYSTEM, problem, str(answer).strip()))
        return out

    return rows


@dataclass(frozen=True)
class Benchmark:
    name: str
    split: str  # the split read from a dataset id unless one is named
    rows: Rows
    tools: Rows | None = None  # the prompts that teach a tool, where the task has one


BENCHMARKS = {
    "gsm8k": Benchmark(
        "gsm8k",
        "train",
        lambda rows, source: gsm8k.prompt_rows(rows, source, tools=False),
        lambda rows, source: gsm8k.prompt_rows(rows, source, tools=True),
    ),
    "math500": Benchmark("math500", "test", math_rows("MATH-500")),
    "aime": Benchmark("aime", "train", math_rows("AIME")),
}


@dataclass(frozen=True)
class Written:
    path: Path
    rows: int
    source: str  # what was read: the file, or the dataset at its commit and split


def _source(
    spec: str, benchmark: Benchmark, split: str | None, config: str | None
) -> str | HubSource:
    if spec.startswith("hf://"):
        return hub_source(spec, config, split or benchmark.split, field="rlx data SOURCE")
    if is_url(spec):
        raise DataError(
            f"source {spec!r} is a URL; rlx data reads a file on this machine or a dataset "
            "by id (hf://ORG/NAME)"
        )
    if split is not None or config is not None:
        raise DataError(
            f"--split and --config choose a part of a dataset named by id (hf://ORG/NAME); "
            f"{spec} is a file"
        )
    return spec


def write_prompts(
    task: str,
    source: str | Path,
    out: str | Path,
    *,
    tools: bool = False,
    split: str | None = None,
    config: str | None = None,
) -> Written:
    """Read the benchmark `task`'s `source` and write its prompt rows to `out` (.jsonl or
    .parquet, which must not exist); the folder is made. Raises DataError with one line."""
    benchmark = BENCHMARKS[task]
    if is_url(str(out)):
        raise DataError(
            f"out {str(out)!r} is a URL; rlx data writes a file on this machine (copy the "
            "result to the store with its own tool)"
        )
    if tools and benchmark.tools is None:
        raise DataError(f"--tools: {task} has no tool prompts (gsm8k has: gsm8k-tools.yaml)")
    out = Path(out)
    fmt = detect_format(out)
    if out.exists():
        raise DataError(f"{out} exists; name a new file (nothing was written)")
    where = _source(str(source), benchmark, split, config)
    convert = benchmark.tools if tools and benchmark.tools is not None else benchmark.rows
    rows = convert(read_rows(where), str(where))
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    if fmt == "jsonl":
        with partial.open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), partial)
    partial.replace(out)  # a killed run leaves no half file under the real name
    return Written(out, len(rows), str(where))
