"""A resume reads the dataset repositories its run started with: a commit that moved is one
line; a commit the recipe now names, or a repository it dropped, is the user's choice."""

from __future__ import annotations

from rlx.trainer.checkpoint.resume import chosen_commits, moved_data

OLD, NEW = "a" * 40, "b" * 40
REPO = "hf://org/prompts"


def test_a_moved_commit_is_named_with_the_pin_that_goes_on() -> None:
    line = moved_data({REPO: OLD}, {REPO: NEW})
    assert line is not None
    assert f"started on {REPO} at commit {OLD[:12]} and it is at {NEW[:12]} now" in line
    assert f"write {REPO}@{OLD} in trainer.data" in line and "RLX_RUN_ID" in line


def test_the_same_commit_a_chosen_one_or_a_dropped_repository_resume() -> None:
    assert moved_data({REPO: OLD}, {REPO: OLD}) is None
    assert moved_data({REPO: OLD}, {REPO: NEW}, chosen_commits([f"{REPO}@{NEW}"])) is None
    assert moved_data({REPO: OLD}, {"hf://org/other": NEW}) is None  # no longer read
    assert moved_data({}, {REPO: NEW}) is None  # a checkpoint of a run before the record


def test_only_a_full_commit_is_a_choice() -> None:
    specs = [f"{REPO}@v1.0", f"hf://org/pinned@{OLD}", "data/train.jsonl", "synthetic:x"]
    assert chosen_commits(specs) == {"hf://org/pinned"}
    assert moved_data({REPO: OLD}, {REPO: NEW}, chosen_commits(specs)) is not None
