"""What a dress rehearsal of the shipped GPU recipes reads from its working folder: small
prompt files in the layouts the recipes name (verl's GSM8K and MATH parquet, GSM8K made into
calculator prompts by `rlx data gsm8k --tools` from GSM8K's own layout)."""

from __future__ import annotations

from pathlib import Path

SYSTEM = "Answer the question. Put the final number after ####."
ROWS = 16


def gsm8k_rows() -> list[dict]:
    """GSM8K's own layout: question, and an answer ending in #### N."""
    rows = []
    for i in range(ROWS):
        a, b = 3 + i, 5 + 2 * i
        rows.append(
            {
                "question": f"Tom has {a} apples and buys {b} more. How many has he?",
                "answer": f"He has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}",
            }
        )
    return rows


def write_workdir(folder: Path) -> Path:
    """data/gsm8k/train.parquet, data/math/train.parquet (verl's layout: chat prompt,
    reward_model.ground_truth) and data/gsm8k-tools/train.jsonl under folder."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlx.trainer.tasks.benchmarks import write_prompts

    def verl(rows: list[tuple[str, str]], path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        table = pa.Table.from_pylist(
            [
                {
                    "data_source": path.parent.name,
                    "prompt": [
                        {"role": "system", "content": SYSTEM},
                        {"role": "user", "content": question},
                    ],
                    "reward_model": {"style": "rule", "ground_truth": answer},
                }
                for question, answer in rows
            ]
        )
        pq.write_table(table, path)

    gsm8k = gsm8k_rows()
    verl(
        [(r["question"], r["answer"].rsplit("#### ", 1)[1]) for r in gsm8k],
        folder / "data" / "gsm8k" / "train.parquet",
    )
    verl(
        [
            (f"What is {i} divided by {i + 1}? Give \\boxed{{}}.", f"\\frac{{{i}}}{{{i + 1}}}")
            for i in range(1, ROWS + 1)
        ],
        folder / "data" / "math" / "train.parquet",
    )
    source = folder / "gsm8k-main-train.parquet"
    pq.write_table(pa.Table.from_pylist(gsm8k), source)
    out = folder / "data" / "gsm8k-tools" / "train.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_prompts("gsm8k", source, out, tools=True)
    return folder
