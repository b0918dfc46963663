"""Models named by hub id, served from a Hugging Face cache a test fills itself (the cache's
own layout: blobs, snapshots of links, refs/main) with HF_HUB_OFFLINE=1: how users name
models, without a network."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# The id every shipped small recipe names: a test puts a tiny model of the same architecture
# under it.
HUB_ID = "Qwen/Qwen2.5-0.5B-Instruct"


@dataclass(frozen=True)
class HubCache:
    root: Path  # HF_HUB_CACHE
    repo_id: str
    snapshot: Path  # the folder the cache serves for repo_id

    @property
    def env(self) -> dict[str, str]:
        """What a process needs to be served from this cache, and only from it."""
        return {"HF_HUB_CACHE": str(self.root), "HF_HUB_OFFLINE": "1"}


def fill_hub_cache(root: Path, model_dir: Path, repo_id: str = HUB_ID) -> HubCache:
    """model_dir stored in a hub cache at root under repo_id."""
    from rlx.hub import put_in_cache

    snapshot = put_in_cache(model_dir, repo_id, {"HF_HUB_CACHE": str(root)})
    return HubCache(root, repo_id, snapshot)


# The dataset the tests serve by id: the quickstart's task (letters_or_digits) in a
# repository laid out as the hub's datasets are (a folder of parquet shards per configuration,
# README.md's YAML naming each configuration's splits), with columns of its own names.
DATASET_ID = "rlx-tests/letters-or-digits"
DATASET_CONFIGS = ("letters", "plain")
PROMPT_COLUMN, ANSWER_COLUMN = "question", "kind"


@dataclass(frozen=True)
class DatasetCache:
    root: Path  # HF_HUB_CACHE
    repo_id: str
    snapshot: Path  # the folder refs/main names

    @property
    def commit(self) -> str:
        return self.snapshot.name

    @property
    def env(self) -> dict[str, str]:
        """Served from this cache only; the datasets library's own files beside it."""
        return {
            "HF_HUB_CACHE": str(self.root),
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_CACHE": str(self.root.with_name(self.root.name + "-datasets")),
        }


def dataset_readme(splits: dict[str, dict[str, str]]) -> str:
    """A dataset card whose YAML header names each configuration's split files."""
    lines = ["---", "configs:"]
    for config, files in splits.items():
        lines += [f"- config_name: {config}", "  data_files:"]
        lines += [f"  - split: {split}\n    path: {path}" for split, path in files.items()]
    return "\n".join([*lines, "---", "", "Prompts of the letters-or-digits task.", ""])


def write_dataset_repo(folder: Path, seed: int = 0, rows: int = 64) -> Path:
    """A dataset repository's files: per configuration a train and a test parquet shard of
    the quickstart's task, the prompt in PROMPT_COLUMN, the answer in ANSWER_COLUMN."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlx.trainer.tasks.data import read_rows
    from rlx.trainer.tasks.synthetic import write_synthetic_dataset

    splits: dict[str, dict[str, str]] = {}
    for config in DATASET_CONFIGS:
        splits[config] = {}
        for split, held_out in (("train", False), ("test", True)):
            jsonl = write_synthetic_dataset(
                folder / f".{config}-{split}.jsonl", rows, seed=seed, held_out=held_out
            )
            table = [
                {PROMPT_COLUMN: row["prompt"], ANSWER_COLUMN: row["answer"]}
                for row in read_rows(jsonl)
            ]
            jsonl.unlink()
            name = f"{config}/{split}-00000-of-00001.parquet"
            (folder / config).mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.Table.from_pylist(table), folder / name)
            splits[config][split] = f"{config}/{split}-*"
    (folder / "README.md").write_text(dataset_readme(splits))
    return folder


def fill_dataset_cache(
    root: Path, folder: Path, repo_id: str = DATASET_ID, ref: str = "main"
) -> DatasetCache:
    """A dataset repository's files stored in a hub cache at root under repo_id, refs/<ref>
    naming their snapshot."""
    from rlx.hub import put_in_cache

    env = {"HF_HUB_CACHE": str(root)}
    snapshot = put_in_cache(folder, repo_id, env, repo_type="dataset", ref=ref)
    return DatasetCache(root, repo_id, snapshot)
