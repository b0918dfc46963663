"""resources.groups: the model (strict, per-group fields, job-wide defaults, the form the
nodes read back), the actors each group gets, lint's rules for groups, the plan of each
group on its own GPUs, and each node's place in the job from its backend's variables."""

from __future__ import annotations

import pytest

from rlx.errors import RecipeError, RlxError
from rlx.lint import lint_file
from rlx.node.env import job_node_info, recipe_from_env, recipe_json, sky_group_info
from rlx.plan import plan_recipe
from rlx.plan.actors import plan_actors
from rlx.recipe.load import parse_recipe

GROUPED = """\
name: grouped
resources:
  cpus: "8+"
  memory: "64+"
  groups:
    train: {nodes: 2, accelerators: "H100:8", memory: "512+"}
    rollout: {nodes: 3, accelerators: "L4:4"}
trainer:
  model: {path: Qwen/Qwen2.5-1.5B-Instruct}
  data: {train: data.jsonl}
  layout: split
  rollout: {engine: vllm, gpu_memory_utilization: 0.8}
  batch: {prompts_per_step: 32, micro_batch_size: 4}
"""


def grouped(text: str = GROUPED):
    return parse_recipe(text, "grouped.yaml").recipe


def findings(text: str) -> list[str]:
    with pytest.raises(RecipeError) as refused:
        parse_recipe(text, "grouped.yaml")
    return [f.format() for f in refused.value.findings]


def test_groups_sum_and_take_job_wide_defaults():
    res = grouped().resources
    assert res.total_nodes == 5 and res.total_gpus == 2 * 8 + 3 * 4
    assert res.gpus_per_node == 8 and res.engine_gpus_per_node == 4  # train / rollout
    train, rollout = res.train_nodes, res.rollout_nodes
    assert (train.memory, train.cpus) == ("512+", "8+")  # its own memory, the job's cpus
    assert (rollout.memory, rollout.cpus) == ("64+", "8+")
    assert [name for name, _ in res.node_groups()] == ["train", "rollout"]


def test_the_nodes_read_back_the_same_recipe():
    recipe = grouped()
    dumped = recipe.model_dump(mode="json")["resources"]
    assert "nodes" not in dumped and "accelerators" not in dumped
    assert recipe_from_env({"RLX_RECIPE_JSON": recipe_json(recipe)}) == recipe
    plain = parse_recipe("name: plain\n").recipe
    assert "groups" not in plain.model_dump(mode="json")["resources"]  # goldens unchanged


def test_job_wide_nodes_or_accelerators_beside_groups_are_refused():
    text = GROUPED.replace('  cpus: "8+"', '  nodes: 5\n  accelerators: "H100:8"\n  cpus: "8+"')
    [line] = findings(text)
    assert line.startswith("grouped.yaml:2: error: resources: nodes and accelerators cannot be")
    assert "move them under groups.train and groups.rollout" in line


def test_group_names_are_train_and_rollout_with_a_hint():
    lines = findings(GROUPED.replace("rollout: {", "rollouts: {"))
    assert any(
        "resources.groups.rollouts: unknown field 'rollouts'; did you mean 'rollout'?" in x
        for x in lines
    )
    assert any("resources.groups.rollout: required field is missing" in x for x in lines)
    [line] = findings(GROUPED.replace("nodes: 3,", "nodes: 0,"))
    assert "resources.groups.rollout.nodes" in line


def test_actors_each_on_their_group():
    plan = plan_actors(grouped())
    assert (plan.train_workers, plan.rollout_workers, plan.rollout_gpus) == (16, 12, 1)
    assert (plan.train_group, plan.rollout_group) == ("train", "rollout")
    tp2 = grouped(GROUPED.replace("engine: vllm,", "engine: vllm, tensor_parallel_size: 2,"))
    assert (plan_actors(tp2).rollout_workers, plan_actors(tp2).rollout_gpus) == (6, 2)
    cpu = grouped(
        GROUPED.replace(', accelerators: "H100:8"', "").replace(', accelerators: "L4:4"', "")
    )
    cpu_plan = plan_actors(cpu)
    assert (cpu_plan.train_workers, cpu_plan.rollout_workers) == (2, 3)
    assert cpu_plan.spread_training and cpu_plan.spread_rollout


def lint_errors(write_recipe, text: str) -> list[str]:
    return [f.format() for f in lint_file(write_recipe(text)) if f.severity == "error"]


def test_lint_groups_need_split_layout(write_recipe):
    [line] = lint_errors(write_recipe, GROUPED.replace("layout: split", "layout: colocated"))
    assert ": error: trainer.layout: resources.groups puts the rollout engines" in line
    assert "write layout: split" in line


def test_lint_tensor_parallel_against_the_rollout_group(write_recipe):
    text = GROUPED.replace("engine: vllm,", "engine: vllm, tensor_parallel_size: 8,")
    [line] = lint_errors(write_recipe, text)
    assert (
        "trainer.rollout.tensor_parallel_size: tensor_parallel_size 8 does not divide the " in line
    )
    assert "4 GPUs per rollout node (groups.rollout)" in line


def test_lint_rollout_gpus_is_the_rollout_groups(write_recipe):
    assert (
        lint_errors(
            write_recipe, GROUPED.replace("layout: split", "layout: split\n  rollout_gpus: 12")
        )
        == []
    )
    [line] = lint_errors(
        write_recipe, GROUPED.replace("layout: split", "layout: split\n  rollout_gpus: 8")
    )
    assert "trainer.rollout_gpus: rollout_gpus 8 differs from the rollout group's 12 GPUs" in line
    assert "leave rollout_gpus out (or write 12)" in line


def test_lint_accelerators_on_both_groups_or_neither(write_recipe):
    [line] = lint_errors(write_recipe, GROUPED.replace(', accelerators: "L4:4"', ""))
    assert "resources.groups.rollout: groups.rollout has no accelerators" in line


def test_lint_refuses_docker_containers_in_a_heterogeneous_job(write_recipe):
    text = GROUPED + "slurm:\n  container: {runtime: docker, image: img}\n"
    assert any(
        "slurm.container.runtime: docker containers are not run in a heterogeneous job" in x
        for x in lint_errors(write_recipe, text)
    )


def test_plan_each_group_on_its_own_gpus():
    plan = plan_recipe(grouped())
    training, rollout = plan.gpus
    assert training.capacity == int(79.18 * 2**30) and training.count == 16  # H100
    assert rollout.capacity == int(23034 / 1024 * 2**30) and rollout.count == 12  # L4
    hosts = {b.title: b.capacity for b in plan.hosts}
    assert hosts["host RAM per node (x2: 8 rank(s))"] == 512 * 10**9
    assert hosts["host RAM per node (x3: 0 rank(s), 4 engine(s))"] == 64 * 10**9
    assert plan.accelerator == "train 2 x H100:8, rollout 3 x L4:4"


def test_plan_engines_that_do_not_fit_the_rollout_gpus():
    plan = plan_recipe(grouped(GROUPED.replace("Qwen2.5-1.5B", "Qwen2.5-14B")))
    # 14B in bf16 leaves an L4's share no room for the KV cache; the H100s are not the limit
    assert [p.split(":")[0] for p in plan.problems] == ["rollout GPU"], plan.problems


# --------------------------------------------------------------------------- the nodes


def test_dstack_node_of_a_group():
    env = {
        "DSTACK_NODE_RANK": "3",
        "DSTACK_MASTER_NODE_IP": "10.0.0.1",
        "DSTACK_NODES_IPS": "\n".join(f"10.0.0.{i}" for i in range(1, 6)),
        "DSTACK_NODES_NUM": "5",
        "DSTACK_GPUS_PER_NODE": "4",
    }
    info = job_node_info("dstack", env, grouped().resources)
    assert info.groups == ("train", "train", "rollout", "rollout", "rollout")
    assert (info.rank, info.own_group, info.gpus_per_node, info.expected_gpus) == (
        3,
        "rollout",
        4,
        28,
    )
    assert info.describe(0) == "node 0 (train, 10.0.0.1)"


def test_slurm_node_of_a_group(monkeypatch):
    hosts = ["t1", "t2", "r1", "r2", "r3"]
    monkeypatch.setattr("socket.gethostbyname", lambda host: f"10.9.0.{hosts.index(host) + 1}")
    env = {"SLURM_JOB_ID": "7", "SLURMD_NODENAME": "t2", "RLX_NODE_HOSTS": "\n".join(hosts)}
    info = job_node_info("slurm", env, grouped().resources)
    assert (info.rank, info.own_group, info.gpus_per_node) == (1, "train", 8)
    assert info.describe(4) == "node 4 (rollout, r3, 10.9.0.5)"
    with pytest.raises(RlxError, match="the recipe's groups have 5 nodes but the job has 2"):
        job_node_info("slurm", {**env, "RLX_NODE_HOSTS": "t1\nt2"}, grouped().resources)


def test_sky_node_of_a_job_group_finds_the_other_job_by_hostname():
    env = {
        "SKYPILOT_NODE_RANK": "1",
        "SKYPILOT_NODE_IPS": "10.2.0.7\n10.2.0.8\n10.2.0.9",
        "SKYPILOT_NUM_NODES": "3",
        "SKYPILOT_NUM_GPUS_PER_NODE": "4",
        "SKYPILOT_JOBGROUP_NAME": "grouped",
        "RLX_NODE_GROUP": "rollout",
    }
    hosts = {"train-0.grouped": "10.1.0.1", "train-1.grouped": "10.1.0.2"}
    info = sky_group_info(env, grouped().resources, resolve=hosts.__getitem__)
    assert info.node_ips == ("10.1.0.1", "10.1.0.2", "10.2.0.7", "10.2.0.8", "10.2.0.9")
    assert (info.rank, info.own_ip, info.head_ip) == (3, "10.2.0.8", "10.1.0.1")
    assert info.node_names[3] == "rollout-1.grouped"
    with pytest.raises(RlxError, match=r"job rollout has 2 nodes but the recipe's groups\.rollout"):
        sky_group_info(
            {
                **env,
                "SKYPILOT_NODE_IPS": "a\nb",
                "SKYPILOT_NUM_NODES": "2",
                "SKYPILOT_NODE_RANK": "0",
            },
            grouped().resources,
            resolve=hosts.__getitem__,
        )


def test_the_local_backend_refuses_groups():
    with pytest.raises(
        RlxError,
        match="the local backend has one machine; launch with --backend sky, dstack or slurm",
    ):
        job_node_info("local", {}, grouped().resources)


def test_local_launch_and_dry_run_refuse_groups_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from rlx.cli import app

    path = tmp_path / "grouped.yaml"
    path.write_text(GROUPED)
    for extra in ([], ["--dry-run"]):
        out = CliRunner().invoke(app, ["launch", str(path), "-b", "local", *extra])
        assert out.exit_code == 1
        assert "the local backend is this one machine; launch with --backend sky" in out.output
        assert "Traceback" not in out.output


def test_every_node_starts_ray_with_its_groups_label():
    from ray._private.label_utils import parse_node_labels_string

    from rlx.node import raynode
    from rlx.recipe.model import RaySettings

    worker = raynode.worker_command(RaySettings(), "10.0.0.1", "10.0.0.2", 4, "rollout")
    [flag] = [arg for arg in worker if arg.startswith("--labels=")]
    assert parse_node_labels_string(flag.removeprefix("--labels=")) == {"rlx-node-group": "rollout"}
    head = raynode.head_command(RaySettings(), "10.0.0.1", 8, "train")
    assert "--labels=rlx-node-group=train" in head
    assert not [a for a in raynode.head_command(RaySettings(), "10.0.0.1", 8) if "labels" in a]
