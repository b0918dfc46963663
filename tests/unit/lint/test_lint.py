"""Broken recipes: every one exits 1 with the right file:line and field, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlx.cli import app
from rlx.lint import lint_file
from tests.conftest import RECIPES

runner = CliRunner()

TRAINER = """\
trainer:
  model: {path: Qwen/Qwen2.5-0.5B}
  data: {train: data.jsonl}
"""

# (case id, recipe text, line, field, a piece of the message)
BROKEN = [
    (
        "typo-top-level",
        "name: job\nresorces:\n  nodes: 2\n" + TRAINER,
        2,
        "resorces",
        "did you mean 'resources'?",
    ),
    (
        "typo-nested",
        "name: job\nresources:\n  nodes: 2\n  acclerators: H100:8\n" + TRAINER,
        4,
        "resources.acclerators",
        "did you mean 'accelerators'?",
    ),
    ("skypilot-key", "name: job\nnum_nodes: 2\n" + TRAINER, 2, "num_nodes", "resources.nodes"),
    (
        "wrong-type",
        "name: job\nresources:\n  nodes: two\n" + TRAINER,
        3,
        "resources.nodes",
        "valid integer",
    ),
    ("bad-name", "name: My_Job\n" + TRAINER, 1, "name", "not a valid job name"),
    ("missing-name", "resources:\n  nodes: 1\n" + TRAINER, 1, "name", "required field"),
    (
        "bad-literal",
        "name: job\n" + TRAINER + "  algorithm: gpro\n",
        5,
        "trainer.algorithm",
        "did you mean 'grpo'?",
    ),
    (
        "bad-accelerators",
        "name: job\nresources:\n  accelerators: 8xH100\n" + TRAINER,
        3,
        "resources.accelerators",
        "TYPE:COUNT",
    ),
    (
        "zero-nodes",
        "name: job\nresources:\n  nodes: 0\n" + TRAINER,
        3,
        "resources.nodes",
        "greater than or equal to 1",
    ),
    ("not-a-mapping", "- name: job\n", 1, "(recipe)", "mapping of fields"),
    ("invalid-yaml", "name: job\ntrainer: [\n", 3, "(recipe)", "invalid YAML"),
    ("duplicate-key", "name: job\nname: other\n" + TRAINER, 2, "(recipe)", "duplicate key"),
    (
        "secret-value-in-secrets",
        "name: job\nsecrets: [hf_abcdefghijklmnopqrstuvwxyz0123]\n" + TRAINER,
        2,
        "secrets[0]",
        "NAMES only",
    ),
    ("nothing-to-run", "name: job\n", 1, "trainer", "nothing to run"),
    (
        "batch-not-divisible",
        "name: job\nresources:\n  nodes: 2\n  accelerators: H100:8\n"
        + TRAINER
        + "  batch: {prompts_per_step: 3}\n  rollout: {n: 5}\n  checkpoint: {dir: null}\n",
        8,
        "trainer.batch.prompts_per_step",
        "do not split evenly over 16",
    ),
    (
        "minibatch-not-divisor",
        "name: job\n" + TRAINER + "  batch: {prompts_per_step: 8, minibatch_size: 7}\n",
        5,
        "trainer.batch.minibatch_size",
        "does not divide",
    ),
    (
        "tp-not-divides-gpus",
        "name: job\nresources:\n  accelerators: H100:8\n"
        + TRAINER
        + "  rollout: {tensor_parallel_size: 3}\n",
        7,
        "trainer.rollout.tensor_parallel_size",
        "does not divide the 8 GPUs",
    ),
    (
        "grpo-group-of-one",
        "name: job\n" + TRAINER + "  rollout: {n: 1}\n",
        5,
        "trainer.rollout.n",
        "at least 2",
    ),
    (
        "gspo-with-token-mean",
        "name: job\n" + TRAINER + "  algo: {policy_loss: gspo, loss_agg: token-mean}\n",
        5,
        "trainer.algo.loss_agg",
        "write loss_agg: seq-mean-token-mean",
    ),
    (
        "cispo-with-dual-clip",
        "name: job\n" + TRAINER + "  algo: {policy_loss: cispo, dual_clip: 3}\n",
        5,
        "trainer.algo.dual_clip",
        "remove dual_clip",
    ),
    (
        "correction-bounds-reversed",
        "name: job\n" + TRAINER + "  algo: {rollout_correction: {low: 2.0, high: 0.5}}\n",
        5,
        "trainer.algo.rollout_correction",
        "must satisfy 0 <= low <= 1 <= high",
    ),
    (
        "correction-high-below-one",
        "name: job\n" + TRAINER + "  algo:\n    rollout_correction: {high: 0.9}\n",
        6,
        "trainer.algo.rollout_correction",
        "write e.g. low: 0.5, high: 2.0",
    ),
    (
        "correction-mask-without-bounds",
        "name: job\n" + TRAINER + "  algo: {rollout_correction: {action: mask}}\n",
        5,
        "trainer.algo.rollout_correction",
        "both bounds must be written",
    ),
    (
        "bfloat16-hf-engine-beside-lora",
        "name: job\ntrainer:\n  model: {path: Qwen/Qwen2.5-0.5B, dtype: float32, lora: {rank: 8}}"
        "\n  data: {train: data.jsonl}\n  rollout: {engine: hf, dtype: bfloat16}\n",
        5,
        "trainer.rollout.dtype",
        "or use engine: vllm or layout: split",
    ),
    (
        "reinforce-pp-group-of-one",
        "name: job\n" + TRAINER + "  algorithm: reinforce_pp\n"
        "  algo: {baseline: group}\n  rollout: {n: 1}\n",
        7,
        "trainer.rollout.n",
        "or write baseline: batch",
    ),
    (
        "ray-port-skypilot",
        "name: job\nray:\n  port: 6380\n" + TRAINER,
        3,
        "ray.port",
        "SkyPilot's Ray GCS",
    ),
    (
        "ray-dashboard-skypilot",
        "name: job\nray:\n  dashboard_port: 8266\n" + TRAINER,
        3,
        "ray.dashboard_port",
        "SkyPilot's Ray dashboard",
    ),
    (
        "ray-agent-skypilot",
        "name: job\nray:\n  dashboard_agent_port: 52365\n" + TRAINER,
        3,
        "ray.dashboard_agent_port",
        "dashboard agent",
    ),
    (
        "ray-ports-clash",
        "name: job\nray:\n  port: 7000\n  dashboard_port: 7000\n" + TRAINER,
        4,
        "ray.dashboard_port",
        "every Ray port must differ",
    ),
    (
        "secret-in-env",
        "name: job\nenv:\n  HF_TOKEN: hf_abc\nsecrets: [HF_TOKEN]\n" + TRAINER,
        3,
        "env.HF_TOKEN",
        "listed under secrets",
    ),
    (
        "plaintext-secret-name",
        "name: job\nenv:\n  WANDB_API_KEY: abc123\n" + TRAINER,
        3,
        "env.WANDB_API_KEY",
        "looks like a secret",
    ),
    (
        "ray-port-public",
        "name: job\nresources:\n  ports: [6379]\n" + TRAINER,
        3,
        "resources.ports",
        "opened to the internet",
    ),
    (
        "dashboard-open",
        "name: job\nray:\n  dashboard_host: 0.0.0.0\n" + TRAINER,
        3,
        "ray.dashboard_host",
        "opens the Ray dashboard",
    ),
    (
        "ckpt-local-multinode",
        "name: job\nresources:\n  nodes: 2\n" + TRAINER + "  checkpoint: {dir: /tmp/ckpt}\n",
        7,
        "trainer.checkpoint.dir",
        "node-local disk",
    ),
    (
        "ckpt-local-retries",
        "name: job\n"
        + TRAINER
        + "  checkpoint: {dir: /tmp/ckpt}\ndstack:\n  fleets: [f]\n  retry: {duration: 1h}\n",
        5,
        "trainer.checkpoint.dir",
        "dstack.retry may restart",
    ),
    (
        "resume-without-dir",
        "name: job\n" + TRAINER + "  checkpoint:\n    resume: auto\n",
        6,
        "trainer.checkpoint.resume",
        "needs checkpoint.dir",
    ),
    (
        "retries-without-ckpt",
        "name: job\n" + TRAINER + "sky:\n  recovery: {strategy: FAILOVER}\n",
        2,
        "trainer.checkpoint.dir",
        "starts over from step 0",
    ),
    (
        "model-not-shared",
        "name: job\nresources:\n  nodes: 2\n"
        "trainer:\n  model: {path: /home/me/model}\n  data: {train: data.jsonl}\n",
        5,
        "trainer.model.path",
        "not on shared storage",
    ),
    (
        "volume-without-name-sky",
        "name: job\nvolumes:\n  - path: /data\n" + TRAINER + "sky:\n  infra: aws\n",
        3,
        "volumes[0].path",
        "cannot attach",
    ),
    (
        "slurm-file-mounts",
        "name: job\nfile_mounts:\n  /data: ./data\n" + TRAINER + "slurm:\n  partition: gpu\n",
        2,
        "file_mounts",
        "Slurm copies no files",
    ),
    (
        "k8s-spot",
        "name: job\nresources:\n  spot: true\n" + TRAINER + "sky:\n  infra: k8s\n",
        3,
        "resources.spot",
        "no spot instances",
    ),
    (
        "reserved-env",
        "name: job\nenv:\n  SKYPILOT_NODE_RANK: '0'\n" + TRAINER,
        3,
        "env.SKYPILOT_NODE_RANK",
        "set by the backend",
    ),
    (
        "ray-stop-in-setup",
        "name: job\nsetup:\n  - ray stop --force\n" + TRAINER,
        3,
        "setup[0]",
        "SkyPilot's own",
    ),
    (
        "split-layout-no-gpus",
        "name: job\nresources:\n  accelerators: H100:8\n" + TRAINER + "  layout: split\n",
        4,
        "trainer.rollout_gpus",
        "layout: split needs",
    ),
    (
        "slurm-time",
        "name: job\n" + TRAINER + "slurm:\n  time: 4h\n",
        6,
        "slurm.time",
        "not a Slurm time",
    ),
    (
        "slurm-partition-injection",
        "name: job\n" + TRAINER + "slurm:\n  partition: 'gpu\\n#SBATCH --wrap=x'\n",
        6,
        "slurm.partition",
        "plain name",
    ),
    (
        "dstack-env-newline",
        'name: job\nenv:\n  MULTI: "a\\nb"\n' + TRAINER + "dstack:\n  fleets: [f]\n",
        3,
        "env.MULTI",
        "line break",
    ),
    (
        "min-over-max-tokens",
        "name: job\n" + TRAINER + "  rollout: {min_new_tokens: 64, max_new_tokens: 32}\n",
        5,
        "trainer.rollout.min_new_tokens",
        "exceeds max_new_tokens",
    ),
    (
        "url-missing-a-slash",
        "name: job\n" + TRAINER + "  checkpoint: {dir: 's3:/bucket/ckpt'}\n",
        5,
        "trainer.checkpoint.dir",
        "with a slash missing",
    ),
    (
        "url-unsupported-scheme",
        "name: job\n" + TRAINER + "  logging: {dir: 'ftp://host/runs'}\n",
        5,
        "trainer.logging.dir",
        "rlx cannot store to",
    ),
    (
        "bucket-extra-not-in-setup",
        "name: job\nsetup:\n  - pip install 'rlx[train]'\n"
        + TRAINER
        + "  checkpoint: {dir: 's3://bucket/ckpt'}\n",
        7,
        "trainer.checkpoint.dir",
        "rlx[train,s3]",
    ),
    (
        "data-in-a-store",
        "name: job\ntrainer:\n  model: {path: Qwen/Qwen2.5-0.5B}\n"
        "  data: {train: 's3://bucket/data.jsonl'}\n",
        4,
        "trainer.data.train",
        "read on the head",
    ),
    (
        "sky-volume-on-aws",
        "name: job\nvolumes:\n  - {name: vol, path: /shared}\n" + TRAINER + "sky:\n  infra: aws\n",
        3,
        "volumes[0].name",
        "s3://BUCKET/checkpoints",
    ),
    (
        "sky-volume-eager-next-region",
        "name: job\nvolumes:\n  - {name: vol, path: /shared}\n"
        + TRAINER
        + "sky:\n  infra: k8s\n  recovery: {strategy: EAGER_NEXT_REGION}\n",
        9,
        "sky.recovery.strategy",
        "region-bound volume",
    ),
    (
        "dstack-volume-multinode",
        "name: job\nresources: {nodes: 2}\nvolumes:\n  - {name: vol, path: /shared}\n"
        + TRAINER
        + "dstack:\n  fleets: [f]\n",
        4,
        "volumes[0].name",
        "${{ dstack.node_rank }}",
    ),
    (
        "checkpoint-on-a-per-node-volume",
        "name: job\nresources: {nodes: 2}\n"
        "volumes:\n  - {name: 'vol-${{ dstack.node_rank }}', path: /local}\n"
        + TRAINER
        + "  checkpoint: {dir: /local/ckpt}\n",
        8,
        "trainer.checkpoint.dir",
        "is on node-local disk but 2 nodes write shards there",
    ),
    (
        "best-metric-never-logged",
        "name: job\n"
        + TRAINER
        + "  validation: {data: held.jsonl, n: 4}\n"
        + "  checkpoint: {dir: ckpt, best: {metric: val/pass@8}}\n",
        6,
        "trainer.checkpoint.best.metric",
        "the run never logs val/pass@8; with validation.n 4",
    ),
    (
        "best-not-a-validation-metric",
        "name: job\n" + TRAINER + "  checkpoint: {dir: ckpt, best: {metric: reward/mean}}\n",
        5,
        "trainer.checkpoint.best.metric",
        "'reward/mean' is not a validation metric",
    ),
    (
        "best-mode",
        "name: job\n"
        + TRAINER
        + "  checkpoint: {dir: ckpt, best: {metric: val/pass@1, mode: highest}}\n",
        5,
        "trainer.checkpoint.best.mode",
        "'highest' is not allowed",
    ),
    (
        "resume-auto-without-dir",
        "name: job\n" + TRAINER + "  checkpoint: {resume: auto}\n",
        5,
        "trainer.checkpoint.resume",
        "needs checkpoint.dir",
    ),
]


def test_resume_left_at_its_default_needs_no_checkpoint_dir(write_recipe):
    # Only a resume the recipe writes is checked: the default (auto) asks for nothing.
    assert lint_file(write_recipe("name: job\n" + TRAINER)) == []


@pytest.mark.parametrize("case,text,line,field,message", BROKEN, ids=[c[0] for c in BROKEN])
def test_broken_recipe(case, text, line, field, message, write_recipe):
    path = write_recipe(text, f"{case}.yaml")
    result = runner.invoke(app, ["lint", str(path)])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    expected = f"{path}:{line}: error: {field}: "
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith(expected)]
    assert lines, f"no line starting {expected!r} in:\n{result.output}"
    assert any(message in ln for ln in lines), result.output


def test_at_least_25_broken_recipes():
    assert len(BROKEN) >= 25


def test_secret_value_pasted_into_secrets_is_not_echoed(write_recipe):
    token = "hf_abcdefghijklmnopqrstuvwxyz0123"
    path = write_recipe(f"name: job\nsecrets: [{token}]\n" + TRAINER)
    result = runner.invoke(app, ["lint", str(path)])
    assert result.exit_code == 1
    assert token not in result.output


@pytest.mark.parametrize("recipe", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_recipes_lint_clean(recipe: Path):
    assert lint_file(recipe) == []


def test_lint_folder_all_clean_exit_0():
    result = runner.invoke(app, ["lint", str(RECIPES)])
    assert result.exit_code == 0, result.output
    assert "0 error(s), 0 warning(s)" in result.output


def test_warnings_fail_only_with_strict(write_recipe):
    path = write_recipe("name: job\nray:\n  auth: none\n" + TRAINER)
    assert runner.invoke(app, ["lint", str(path)]).exit_code == 0
    result = runner.invoke(app, ["lint", "--strict", str(path)])
    assert result.exit_code == 1
    assert f"{path}:3: warning: ray.auth:" in result.stdout


def test_github_annotations(write_recipe):
    path = write_recipe("name: job\nresources:\n  nodes: two\n" + TRAINER)
    result = runner.invoke(app, ["lint", "--format", "github", str(path)])
    assert result.exit_code == 1
    assert f"::error file={path},line=3,title=resources.nodes::" in result.stdout


def test_missing_path_is_one_clear_line(tmp_path):
    result = runner.invoke(app, ["lint", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 1
    assert "no such file or folder" in result.output
    assert "Traceback" not in result.output


def test_not_utf8_is_a_finding(tmp_path):
    path = tmp_path / "bin.yaml"
    path.write_bytes(b"name: \xff\xfe\n")
    result = runner.invoke(app, ["lint", str(path)])
    assert result.exit_code == 1
    assert f"{path}:1: error:" in result.stdout
    assert "UTF-8" in result.stdout


def test_cpu_multinode_counts_one_rank_per_node(write_recipe):
    # 3 CPU nodes train as 3 ranks: 4 prompts x 2 samples = 8 sequences do not split.
    path = write_recipe(
        "name: job\nresources:\n  nodes: 3\n"
        + TRAINER
        + "  batch: {prompts_per_step: 4}\n  rollout: {n: 2}\n"
    )
    messages = [f.message for f in lint_file(path)]
    assert any("do not split evenly over 3 training workers" in m for m in messages), messages


def test_split_layout_on_cpu_is_allowed(write_recipe):
    path = write_recipe("name: job\n" + TRAINER + "  layout: split\n  rollout_gpus: 1\n")
    assert lint_file(path) == []  # not even "rollout_gpus is ignored with layout: colocated"
    colocated = write_recipe("name: job\n" + TRAINER + "  rollout_gpus: 1\n", "other.yaml")
    assert [f.message for f in lint_file(colocated)] == [
        "rollout_gpus is ignored with layout: colocated"
    ]


def test_micro_batch_above_the_share_is_a_warning(write_recipe):
    path = write_recipe(
        "name: job\n" + TRAINER + "  batch: {prompts_per_step: 1, micro_batch_size: 64}\n"
    )
    findings = [f for f in lint_file(path) if f.field == "trainer.batch.micro_batch_size"]
    assert [f.severity for f in findings] == ["warning"]
    assert "micro-batches hold 8" in findings[0].message


def test_staleness_needs_engines_of_their_own(write_recipe):
    colocated = write_recipe("name: job\n" + TRAINER + "  rollout: {max_staleness: 1}\n")
    findings = [f for f in lint_file(colocated) if f.severity == "error"]
    assert [f.field for f in findings] == ["trainer.rollout.max_staleness"]
    assert "needs layout: split" in findings[0].message
    split = write_recipe(
        "name: job\n" + TRAINER + "  layout: split\n  rollout_gpus: 1\n"
        "  rollout: {max_staleness: 2}\n"
    )
    assert [f for f in lint_file(split) if f.severity == "error"] == []


def test_checkpoint_best_on_a_logged_metric_lints_clean(write_recipe):
    """gsm8k compares answers, so maj@n is logged; saves every 4 meet validation every 2."""
    text = (
        "name: job\n" + TRAINER + "  reward: {function: gsm8k}\n"
        "  validation: {data: held.jsonl, n: 8, every: 2}\n"
        "  checkpoint: {dir: ckpt, every: 4, best: {metric: val/maj@8, mode: max}}\n"
    )
    assert [f.format() for f in lint_file(write_recipe(text))] == []
    apart = text.replace("every: 4", "every: 3")
    findings = lint_file(write_recipe(apart, "apart.yaml"))
    assert [(f.field, f.severity) for f in findings] == [("trainer.checkpoint.every", "warning")]
    assert "only a step both validated and saved can be the best" in findings[0].message
