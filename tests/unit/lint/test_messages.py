"""How lint's lines read: the most specific fact about a field first (a generic rule that is
only a consequence stays quiet), near names suggested, commands quoted so they paste."""

from __future__ import annotations

import pytest

from rlx.lint import lint_file

TRAINER = """\
trainer:
  model: {path: Qwen/Qwen2.5-0.5B}
  data: {train: data.jsonl}
"""


def _lines(write_recipe, text: str, field: str) -> list[str]:
    """Lint's findings for one field, each as `severity: message`."""
    return [f"{f.severity}: {f.message}" for f in lint_file(write_recipe(text)) if f.field == field]


@pytest.mark.parametrize(
    "resources",
    [
        "resources: {nodes: 2}\n",
        "resources: {nodes: 1}\nsky: {recovery: {max_restarts_on_errors: 3}}\n",
    ],
    ids=["two-nodes", "restarts"],
)
def test_a_mistyped_checkpoint_url_is_said_alone(resources, write_recipe):
    # s3:/bucket is no folder on a node's disk: it is a URL with a slash missing.
    text = "name: job\n" + resources + TRAINER + '  checkpoint: {dir: "s3:/bucket/x"}\n'
    assert _lines(write_recipe, text, "trainer.checkpoint.dir") == [
        "error: s3:/bucket/x looks like an s3:// URL with a slash missing; write "
        "s3://bucket/prefix (rlx never makes a folder named 's3:')"
    ]


def test_a_local_checkpoint_dir_on_two_nodes_is_still_refused(write_recipe):
    text = "name: job\nresources: {nodes: 2}\n" + TRAINER + "  checkpoint: {dir: /ckpt}\n"
    assert _lines(write_recipe, text, "trainer.checkpoint.dir") == [
        "error: /ckpt is on node-local disk but 2 nodes write shards there; put it in a bucket "
        "(s3://BUCKET/checkpoints, gs://, az://) or on a filesystem every node shares (Slurm, "
        "SkyPilot on Kubernetes)"
    ]


def test_a_mistyped_resume_url_is_said_alone(write_recipe):
    text = (
        "name: job\nresources: {nodes: 2}\n"
        + TRAINER
        + '  checkpoint: {dir: "s3://bucket/x", resume: "gs:/bucket/x/step-000010"}\n'
    )
    assert _lines(write_recipe, text, "trainer.checkpoint.resume") == [
        "error: gs:/bucket/x/step-000010 looks like a gs:// URL with a slash missing; write "
        "gs://bucket/prefix (rlx never makes a folder named 'gs:')"
    ]


@pytest.mark.parametrize(
    "text,field,message",
    [
        # A key from SkyPilot or dstack: where it lives, not the nearest name (cpus).
        (
            "resources:\n  gpus: 8\n",
            "resources.gpus",
            "unknown field 'gpus'; in a recipe this is 'resources.accelerators'",
        ),
        (
            "resources:\n  use_spot: true\n",
            "resources.use_spot",
            "unknown field 'use_spot'; in a recipe this is 'resources.spot'",
        ),
        ("envs: {A: b}\n", "envs", "unknown field 'envs'; in a recipe this is 'env'"),
        # A typo: the nearest name.
        (
            "resources:\n  acclerators: H100:8\n",
            "resources.acclerators",
            "unknown field 'acclerators'; did you mean 'accelerators'?",
        ),
    ],
    ids=["gpus", "use_spot", "envs", "typo"],
)
def test_an_unknown_key_says_where_it_belongs(text, field, message, write_recipe):
    assert _lines(write_recipe, "name: job\n" + text + TRAINER, field) == [f"error: {message}"]


def test_a_mistyped_model_url_is_not_sent_to_the_hub(write_recipe):
    # Not "memory not checked ... hf download s3:/bucket/model": the URL is the news.
    text = "name: job\ntrainer:\n  model: {path: 's3:/bucket/model'}\n  data: {train: x.jsonl}\n"
    assert _lines(write_recipe, text, "trainer.model.path") == [
        "error: s3:/bucket/model looks like an s3:// URL with a slash missing; write "
        "s3://bucket/prefix (rlx never makes a folder named 's3:')"
    ]


def test_an_unknown_critic_is_said_at_the_critic(write_recipe):
    text = TRAINER + "  algorithm: ppo\n  critic_model: {path: acme/critic}\n"
    path = write_recipe("name: job\n" + text)
    said = {f.field: f.message for f in lint_file(path) if f.severity == "warning"}
    assert list(said) == ["trainer.critic_model.path"]
    assert said["trainer.critic_model.path"].startswith("memory not checked: acme/critic: ")


def test_a_fields_errors_come_before_its_warnings(write_recipe):
    # Alphabetically the warning ("... is read") sorts before the error ("...: rlx reads").
    text = "name: job\nresources: {nodes: 2}\n" + TRAINER.replace("data.jsonl", "/data/x.csv")
    assert [line.split(": ")[0] for line in _lines(write_recipe, text, "trainer.data.train")] == [
        "error",
        "warning",
    ]
