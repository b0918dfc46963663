"""The recipe: one strict model of an RL post-training job, shared by every backend.

Validation here is about shape and single fields (types, ranges, formats). Checks that need
several fields together, or knowledge of the backends, live in `rlx.lint`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from rlx.errors import RlxError

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
RECIPE_NAME = re.compile(r"[a-z][a-z0-9-]{0,38}[a-z0-9]")
ACCELERATORS = re.compile(r"(?P<type>[A-Za-z][A-Za-z0-9_.-]*)(:(?P<count>[1-9][0-9]*))?")
AMOUNT = re.compile(r"(?P<value>[0-9]+(\.[0-9]+)?)(?P<plus>\+)?")
SLURM_WORD = re.compile(r"[A-Za-z0-9_.,@+=-]+")
SLURM_FEATURE = re.compile(r"[A-Za-z0-9_.:-]+")
SLURM_CONSTRAINT = re.compile(r"[A-Za-z0-9_.,&|\[\]*:()!-]+")
LOG_DIR = re.compile(r"[A-Za-z0-9_./~-]+")
SLURM_TIME = re.compile(r"([0-9]+-)?[0-9]+(:[0-9]{1,2}){0,2}")
INFRA = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]*(/[A-Za-z0-9][A-Za-z0-9_.:-]*){0,2}")
BUCKET_URL = re.compile(r"(s3|gs|r2|cos|oci|https)://")
# A duration as dstack writes one: a whole number and a unit.
DURATION = re.compile(r"(?P<amount>[0-9]+) *(?P<unit>[smhdw])")
DURATION_UNITS = {"w": 604800, "d": 86400, "h": 3600, "m": 60, "s": 1}
# How long a cluster kept with `rlx launch --keep` may sit with no Ray job (minutes).
IDLE_MINUTES = 30


def is_bucket(source: str) -> bool:
    """A file-mount source that is an object-store bucket (mounted, so shared by all nodes)."""
    return BUCKET_URL.match(source) is not None


def _number_to_str(value: Any) -> Any:
    # YAML reads `memory: 64` or `time: 60` as numbers; those fields are strings.
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return str(value)
    return value


Str = Annotated[str, BeforeValidator(_number_to_str)]


def _str_or_list(value: Any) -> Any:
    if isinstance(value, str):
        return [value]
    return value


Commands = Annotated[list[Str], BeforeValidator(_str_or_list)]


class StrictModel(BaseModel):
    """Unknown keys are errors; instances are frozen once loaded."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


# --------------------------------------------------------------------------- resources


class Accelerator(NamedTuple):
    """One accelerator alternative: a type and how many of it a node has."""

    type: str
    count: int

    def __str__(self) -> str:
        return f"{self.type}:{self.count}"


def parse_accelerator(value: str) -> Accelerator:
    """'H100:8' -> Accelerator('H100', 8); 'L4' -> count 1. ValueError, worded for the
    recipe, when it is not TYPE or TYPE:COUNT."""
    match = ACCELERATORS.fullmatch(value)
    if match is None:
        raise ValueError(f"{value!r} is not TYPE or TYPE:COUNT; write e.g. 'H100:8'")
    return Accelerator(match["type"], int(match["count"] or 1))


# accelerators: one 'TYPE:COUNT'; a list (in order of preference); or a set, any of them,
# written as SkyPilot writes one: {H100:8, A100-80GB:8} (YAML reads it as a mapping to
# nulls) or {H100: 8, A100-80GB: 8}.
AcceleratorsValue = Str | list[Str] | dict[Str, int | None]


def _check_accelerators(value: Any) -> Any:
    if value is None:
        return value
    if isinstance(value, str):
        parse_accelerator(value)
        return value
    if not value:
        raise ValueError("lists no accelerators; write e.g. 'H100:8' or [H100:8, A100-80GB:8]")
    if isinstance(value, dict):
        for key, count in value.items():
            if count is not None and (isinstance(count, bool) or count < 1):
                raise ValueError(f"{key}: {count!r} is not a count; write e.g. {{H100: 8}}")
            if count is not None and ":" in key:
                raise ValueError(f"{key!r} names a count twice; write {{{key}}} or a count")
            parse_accelerator(key if count is None else f"{key}:{count}")
        options = accelerator_options(value)
    else:
        options = [parse_accelerator(item) for item in value]
    seen = set()
    for option in options:
        if option in seen:
            raise ValueError(f"lists {option} twice")
        seen.add(option)
    return value


def accelerator_options(value: Any) -> tuple[Accelerator, ...]:
    """The alternatives an `accelerators` value names, in its order (a set's order is the
    order written; only a list's is a preference)."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (parse_accelerator(value),)
    if isinstance(value, dict):
        return tuple(
            parse_accelerator(key if count is None else f"{key}:{count}")
            for key, count in value.items()
        )
    return tuple(parse_accelerator(item) for item in value)


def duration_seconds(text: str) -> int:
    """Seconds in a duration such as '90m', '8h' or '2d' (one the recipe model accepted)."""
    found = DURATION.fullmatch(text.strip())
    if found is None:
        raise ValueError(text)
    return int(found["amount"]) * DURATION_UNITS[found["unit"]]


def _check_duration(value: str | None) -> str | None:
    if value is None:
        return value
    found = DURATION.fullmatch(value.strip())
    if found is None or int(found["amount"]) == 0:
        raise ValueError(
            f"{value!r} is not a positive duration; write a whole number and a unit (s, m, h, "
            "d or w), e.g. '8h', '90m' or '2d'"
        )
    return value.strip()


def _check_idle_minutes(value: Any) -> Any:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if value == "none" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ValueError(
        f"{value!r} is not allowed; write whole minutes of idleness, at least 1 (e.g. "
        f"{IDLE_MINUTES}), or 'none' to keep a kept cluster until `rlx down`"
    )


def _check_amount(value: str | None) -> str | None:
    if value is not None and not AMOUNT.fullmatch(value):
        raise ValueError(f"{value!r} is not a number; write e.g. '8' or '8+' (at least 8)")
    return value


class _NodeShape(StrictModel):
    """How many nodes, and what each looks like: its accelerators, CPUs, memory and disk."""

    nodes: int = Field(1, ge=1, le=4096, description="Number of nodes (machines).")
    accelerators: AcceleratorsValue | None = Field(
        None,
        description="Accelerators per node as TYPE:COUNT, e.g. 'H100:8' or 'L4' (count 1); "
        "or alternatives: a list in order of preference, [H100:8, A100-80GB:8], or a set, any "
        "of them, {H100:8, A100-80GB:8}. Every alternative is planned, and the job is sized "
        "at start-up for the one it got. Omit for CPU-only nodes.",
    )
    cpus: Str | None = Field(
        None, description="vCPUs per node: '8' for exactly 8, '8+' for at least 8."
    )
    memory: Str | None = Field(
        None, description="Memory per node in GB: '64' for exactly 64, '64+' for at least 64."
    )
    disk_size: int | None = Field(None, ge=1, description="Boot disk size per node in GB.")

    @field_validator("accelerators")
    @classmethod
    def _accelerators(cls, value: Any) -> Any:
        return _check_accelerators(value)

    @field_validator("cpus", "memory")
    @classmethod
    def _amount(cls, value: str | None) -> str | None:
        return _check_amount(value)

    @property
    def accelerator_options(self) -> tuple[Accelerator, ...]:
        """Every accelerator alternative, the preferred (or first written) first; () for
        CPU-only nodes."""
        return accelerator_options(self.accelerators)

    @property
    def accelerators_ordered(self) -> bool:
        """The alternatives are a preference (a list, or just one), not a set."""
        return not isinstance(self.accelerators, dict)

    @property
    def accelerator_type(self) -> str | None:
        """The first alternative's type (the only one, for most recipes)."""
        options = self.accelerator_options
        return options[0].type if options else None

    @property
    def gpus_per_node(self) -> int:
        """The first alternative's count (0 for CPU-only nodes)."""
        options = self.accelerator_options
        return options[0].count if options else 0


# The two kinds of node a job with resources.groups has, in the order their nodes are ranked:
# the head (rank 0) is the first training node.
GROUP_NAMES = ("train", "rollout")


class NodeGroup(_NodeShape):
    """One kind of node in a job with `resources.groups`. cpus, memory and disk_size left
    out here take the job-wide value of `resources`."""

    nodes: int = Field(1, ge=1, le=4096, description="Number of nodes of this kind.")


class NodeGroups(StrictModel):
    """A job whose rollout engines run on machines of their own kind (layout: split)."""

    train: NodeGroup = Field(
        description="The training nodes: the Ray head runs on the first, and training ranks "
        "only on these."
    )
    rollout: NodeGroup = Field(
        description="The rollout nodes: the split layout's engines run only on these "
        "(trainer.rollout_gpus is all of their GPUs)."
    )


class Resources(_NodeShape):
    """What every node of the job needs; with `groups`, what each kind of node needs."""

    nodes: int = Field(1, ge=1, le=4096, description="Number of nodes (machines) in the job.")
    image: Str | None = Field(
        None,
        description="Container image every node runs in (SkyPilot docker image, dstack image). "
        "For Slurm, set slurm.container.",
    )
    spot: bool | Literal["auto"] = Field(
        False,
        description="Spot/preemptible instances: true (spot only), false (on-demand) or auto "
        "(spot where there is capacity, on-demand otherwise).",
    )
    max_hourly_cost: float | None = Field(
        None,
        gt=0,
        description="Highest price per node and hour, in dollars: offers above it are not "
        "taken (SkyPilot max_hourly_cost, dstack max_price).",
    )
    infra: Str | list[Str] | None = Field(
        None,
        description="Where to run: a cloud, cloud/region or cloud/region/zone, e.g. 'aws', "
        "'gcp/us-central1'; or a list of them. Any the backend knows if unset.",
    )
    max_duration: Str | None = Field(
        None,
        description="The longest the job may run once started, e.g. '8h' or '2d' (a whole "
        "number and s, m, h, d or w): dstack's max_duration, Slurm's --time. SkyPilot has no "
        "such limit (lint warns).",
    )
    start_deadline: Str | None = Field(
        None,
        description="The longest the job may wait to start (for capacity, in a queue), e.g. "
        "'30m': dstack's retry.duration on no-capacity, Slurm's --deadline (with a time limit: "
        "Slurm drops a job that cannot end before its deadline), SkyPilot's "
        "provision_timeout on Kubernetes (on clouds SkyPilot tries each place once and fails "
        "without waiting).",
    )
    idle_minutes: int | Literal["none"] = Field(
        IDLE_MINUTES,
        description="A cluster kept with `rlx launch --keep` is torn down once no Ray job has "
        "run or waited on it for this many minutes (whole minutes, at least 1); `none` keeps "
        "it until `rlx down`. A job that trains is torn down when it ends, whatever this "
        "says. -b ray and local refuse it: they keep no cluster of their own.",
    )
    ports: list[int | Str] = Field(
        default_factory=list,
        description="Ports to open to the internet (SkyPilot) or publish (dstack), e.g. 8000 "
        "or '9000-9010'. Never list Ray's ports here.",
    )
    fabric: Literal["efa", "infiniband", "tcp"] | None = Field(
        None,
        description="The network joining the nodes, for NCCL: 'efa' (AWS Elastic Fabric "
        "Adapter: p4d, p5 and other EFA instances), 'infiniband' (InfiniBand or RoCE: a Slurm "
        "cluster's, Nebius, Kubernetes clusters with it) or 'tcp' (no fast fabric: NCCL over "
        "TCP sockets). With efa or infiniband, SkyPilot asks for network_tier: best, Slurm's "
        "docker/podman containers get the RDMA devices, and every node sets NCCL's and "
        "libfabric's variables for it (the recipe's env wins). Unset: nothing is asked for, and "
        "lint warns when FSDP spans nodes. strategy: auto prefers DDP across nodes without a "
        "fast fabric when it fits.",
    )
    groups: NodeGroups | None = Field(
        None,
        description="Two kinds of node in one job, e.g. train: {nodes: 1, accelerators: "
        "'H100:8'} and rollout: {nodes: 2, accelerators: 'L4:4'}: one Ray cluster across both, "
        "training ranks on train nodes and rollout engines on rollout nodes (layout: split). "
        "nodes and accelerators are then set per group; cpus, memory and disk_size here are "
        "the groups' default; image, spot and ports stay job-wide.",
    )

    @model_validator(mode="after")
    def _per_group_fields(self) -> Resources:
        if self.groups is not None:
            both = [f for f in ("nodes", "accelerators") if f in self.model_fields_set]
            if both:
                raise ValueError(
                    f"{' and '.join(both)} cannot be set with groups: each group has its own; "
                    "move them under groups.train and groups.rollout (e.g. train: {nodes: 1, "
                    "accelerators: 'H100:8'})"
                )
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # The dump is read back on the nodes (RLX_RECIPE_JSON): a job with groups carries no
        # job-wide nodes or accelerators (the validator above would refuse them), and one
        # without carries no `groups: null`; nor does one that names no fabric.
        data = handler(self)
        for name in ("fabric", "max_hourly_cost", "infra", "max_duration", "start_deadline"):
            if data.get(name) is None:
                data.pop(name, None)
        if data.get("idle_minutes") == IDLE_MINUTES:
            data.pop("idle_minutes")
        if self.groups is None:
            data.pop("groups", None)
        else:
            data.pop("nodes", None)
            data.pop("accelerators", None)
        return data

    @field_validator("infra")
    @classmethod
    def _infra(cls, value: str | list[str] | None) -> str | list[str] | None:
        places = [value] if isinstance(value, str) else value or []
        if value is not None and not places:
            raise ValueError("lists no places; write e.g. 'aws' or [aws/us-east-1, gcp]")
        for place in places:
            if not INFRA.fullmatch(place):
                raise ValueError(
                    f"{place!r} is not cloud, cloud/region or cloud/region/zone; write e.g. "
                    "'aws' or 'gcp/us-central1'"
                )
        if len(set(places)) != len(places):
            raise ValueError("lists a place twice")
        return value

    @field_validator("max_duration", "start_deadline")
    @classmethod
    def _duration(cls, value: str | None) -> str | None:
        return _check_duration(value)

    @field_validator("idle_minutes", mode="before")
    @classmethod
    def _idle_minutes(cls, value: Any) -> Any:
        return _check_idle_minutes(value)

    @property
    def infra_list(self) -> list[str]:
        """The places resources.infra names ([] for any)."""
        if self.infra is None:
            return []
        return [self.infra] if isinstance(self.infra, str) else list(self.infra)

    @field_validator("ports")
    @classmethod
    def _ports(cls, value: list[int | str]) -> list[int | str]:
        for port in value:
            low, _, high = str(port).partition("-")
            if not (low.isdigit() and (not high or high.isdigit())):
                raise ValueError(
                    f"{port!r} is not a port or a range; write e.g. 8000 or '9000-9010'"
                )
            if not 1 <= int(low) <= int(high or low) <= 65535:
                raise ValueError(f"{port!r} is outside 1-65535")
        return value

    def group(self, name: str) -> NodeGroup:
        """Group `name` with the job-wide cpus, memory and disk_size filled in where it sets
        none; without groups, the whole job as the one group "train" (KeyError for
        "rollout")."""
        if self.groups is None:
            if name != "train":
                raise KeyError(name)
            return NodeGroup(
                nodes=self.nodes,
                accelerators=self.accelerators,
                cpus=self.cpus,
                memory=self.memory,
                disk_size=self.disk_size,
            )
        group: NodeGroup = getattr(self.groups, name)
        defaults = {
            field: getattr(self, field)
            for field in ("cpus", "memory", "disk_size")
            if getattr(group, field) is None
        }
        return group.model_copy(update=defaults)

    def node_groups(self) -> list[tuple[str, NodeGroup]]:
        """(name, group) in rank order, train first; [] for a job without groups."""
        if self.groups is None:
            return []
        return [(name, self.group(name)) for name in GROUP_NAMES]

    @property
    def train_nodes(self) -> NodeGroup:
        """The nodes training ranks run on: the train group, or every node."""
        return self.group("train")

    @property
    def rollout_nodes(self) -> NodeGroup | None:
        """The rollout group; None without groups (engines share the training nodes)."""
        return None if self.groups is None else self.group("rollout")

    @property
    def fast_fabric(self) -> bool:
        """The nodes are joined by a fast interconnect that NCCL uses (EFA, InfiniBand)."""
        return self.fabric in ("efa", "infiniband")

    @property
    def total_nodes(self) -> int:
        """Every node of the job, all groups together."""
        if self.groups is None:
            return self.nodes
        return self.groups.train.nodes + self.groups.rollout.nodes

    @property
    def accelerator_type(self) -> str | None:
        """The training nodes' accelerator type."""
        return _NodeShape.accelerator_type.fget(self.train_nodes)  # type: ignore[attr-defined]

    @property
    def gpus_per_node(self) -> int:
        """GPUs per training node (with groups, the train group's)."""
        return _NodeShape.gpus_per_node.fget(self.train_nodes)  # type: ignore[attr-defined]

    @property
    def engine_gpus_per_node(self) -> int:
        """GPUs per node where the rollout engines run: the rollout group's, or every node's."""
        rollout = self.rollout_nodes
        return self.gpus_per_node if rollout is None else rollout.gpus_per_node

    @property
    def total_gpus(self) -> int:
        if self.groups is None:
            return self.nodes * self.gpus_per_node
        return sum(group.nodes * group.gpus_per_node for _, group in self.node_groups())

    def expanded_ports(self) -> list[int]:
        """Every port `ports` opens, ranges expanded."""
        out: list[int] = []
        for port in self.ports:
            low, _, high = str(port).partition("-")
            out.extend(range(int(low), int(high or low) + 1))
        return out


class Volume(StrictModel):
    """Storage that every node sees at the same path."""

    path: Str = Field(description="Absolute mount point on every node, e.g. /checkpoints.")
    name: Str | None = Field(
        None,
        description="Backend volume to attach there (a SkyPilot volume or a dstack network "
        "volume). Omit for storage every node already shares, such as a Slurm cluster's "
        "shared filesystem.",
    )
    read_only: bool = Field(False, description="Mount read-only.")

    @field_validator("path")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError(f"{value!r} is not absolute; write e.g. '/checkpoints'")
        return value.rstrip("/") or "/"


# --------------------------------------------------------------------------- ray


class RaySettings(StrictModel):
    """The Ray cluster rlx forms on the nodes (separate from any Ray a backend runs itself)."""

    port: int = Field(6379, ge=1024, le=65535, description="GCS port of the head node.")
    dashboard_port: int = Field(8265, ge=1024, le=65535, description="Dashboard port (head).")
    dashboard_host: Str = Field(
        "127.0.0.1",
        description="Address the dashboard binds to. Keep 127.0.0.1 and reach it through an "
        "SSH tunnel; 0.0.0.0 exposes job submission to anyone who can reach the node.",
    )
    dashboard_agent_port: int = Field(
        52366,
        ge=1024,
        le=65535,
        description="Dashboard agent HTTP port on every node (Ray's default 52365 is taken by "
        "SkyPilot's own Ray).",
    )
    object_manager_port: int = Field(8077, ge=1024, le=65535, description="Object manager port.")
    node_manager_port: int = Field(8078, ge=1024, le=65535, description="Raylet port.")
    client_server_port: int = Field(
        10101,
        ge=1024,
        le=65535,
        description="Ray Client server port (head; SkyPilot's uses 10001).",
    )
    min_worker_port: int = Field(20002, ge=1024, le=65535, description="Lowest worker port.")
    max_worker_port: int = Field(29999, ge=1024, le=65535, description="Highest worker port.")
    join_timeout: int = Field(
        600,
        ge=10,
        le=86400,
        description="Seconds the head waits for every node to join (and a worker waits for "
        "the head) before failing with the names of the missing nodes.",
    )
    auth: Literal["token", "none"] = Field(
        "token",
        description="Ray token authentication: 'token' (a fresh token per job, delivered as a "
        "secret) or 'none'.",
    )
    debug: Literal["off", "post-mortem", "breakpoints", "legacy"] = Field(
        "off",
        description="Ray's debugger on every node: 'post-mortem' (a failing task waits for a "
        "debugger, debugpy), 'breakpoints' (breakpoint() in tasks waits for one), 'legacy' "
        "(Ray's pdb, listening on the node's address) or 'off'.",
    )


# --------------------------------------------------------------------------- trainer


# LoRA's target: every linear layer of the decoder (attention and MLP), not the output head.
ALL_LINEAR = "all-linear"


class LoraSettings(StrictModel):
    """Low-rank adapters (peft's LoRA) trained instead of the model's own weights: the base
    stays frozen in its dtype, the reference is the base (the adapter switched off), and a
    weight push carries the adapter alone."""

    rank: int = Field(ge=1, description="The adapters' rank r (1-32 is what RL needs).")
    alpha: float | None = Field(
        None,
        gt=0,
        description="LoRA's scale numerator: updates are scaled by alpha / rank; unset: 2 x rank.",
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input.")
    target_modules: Literal["all-linear"] | list[Str] = Field(
        ALL_LINEAR,
        description="Which linear layers get an adapter: 'all-linear' (attention and MLP of "
        "every decoder layer, not the output head) or module names such as [q_proj, v_proj].",
    )

    @property
    def scale_alpha(self) -> float:
        return self.alpha if self.alpha is not None else 2.0 * self.rank


class ModelSettings(StrictModel):
    path: Str = Field(description="Hugging Face hub id or a local folder with the model.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights dtype: 'auto' is bfloat16 on GPU and float32 on CPU."
    )
    trust_remote_code: bool = Field(False, description="Allow model code from the hub.")
    gradient_checkpointing: bool = Field(False, description="Trade compute for memory.")
    lora: LoraSettings | None = Field(
        None,
        description="Train low-rank adapters (LoRA) instead of every weight: the base frozen "
        "and shared with the reference, pushes and checkpoints carry the adapter alone.",
    )


class MixSource(StrictModel):
    train: Str = Field(
        description="Another prompt dataset, as data.train takes one (a file, synthetic:NAME, "
        "hf://ORG/NAME[@REVISION]), in data.train's layout (prompt_key, answer_key)."
    )
    weight: float = Field(
        1.0, gt=0, description="Its share of the training prompts, beside data.weight."
    )
    config: Str | None = Field(None, description="The configuration of an hf:// dataset.")
    split: Str = Field("train", description="The split of an hf:// dataset.")


class DataSettings(StrictModel):
    train: Str = Field(
        description="Prompt dataset: a .jsonl or .parquet file, 'synthetic:NAME' for a "
        "generated task, or a Hugging Face dataset repository hf://ORG/NAME[@REVISION] (read "
        "with the datasets library at the commit the run resolves at start; data.config and "
        "data.split choose its part)."
    )
    config: Str | None = Field(
        None,
        description="The configuration (subset) of an hf:// dataset, e.g. main for "
        "openai/gsm8k; unset: its only or default one.",
    )
    split: Str = Field("train", description="The split of an hf:// dataset to train on.")
    format: Literal["auto", "jsonl", "parquet"] = Field(
        "auto", description="File format; 'auto' goes by the file suffix."
    )
    prompt_key: Str = Field(
        "prompt",
        description="Field with the prompt: text, or a column of chat messages (a list of "
        "{role, content}).",
    )
    answer_key: Str | None = Field(
        "answer",
        description="Field with the reference answer given to the reward (dotted for nested "
        "fields, e.g. reward_model.ground_truth).",
    )
    chat_template: bool = Field(
        True,
        description="Render text prompts with the chat template (as one user message); "
        "chat-message prompts always are.",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra variables for the chat template (tokenizer.apply_chat_template), "
        "e.g. {enable_thinking: false} for Qwen3.",
    )
    system_prompt: Str | None = Field(
        None,
        description="A system message put before each prompt's messages (a prompt whose "
        "messages start with a system message keeps its own).",
    )
    chat_template_override: Str | None = Field(
        None,
        description="A Jinja chat template used instead of the tokenizer's: the template "
        "itself, or a file (relative paths start in the folder the job runs in).",
    )
    max_prompt_length: int = Field(512, ge=1, description="Longest prompt in tokens.")
    truncate: Literal["error", "filter", "left"] = Field(
        "filter",
        description="What to do with longer prompts: drop them, keep the last tokens, or fail.",
    )
    shuffle: bool = Field(True, description="Shuffle prompts each epoch (seeded).")
    mix: list[MixSource] = Field(
        default_factory=list,
        description="More datasets trained on beside data.train: the training set holds as "
        "many prompts as they all do together, each source's share in proportion to its "
        "weight (a source's rows drawn again, seeded, where its share is more than it holds).",
    )
    weight: float = Field(
        1.0, gt=0, description="data.train's share when data.mix names more datasets."
    )


class RolloutSettings(StrictModel):
    engine: Literal["auto", "vllm", "hf"] = Field(
        "auto", description="Generation engine: vLLM on GPU when installed, else HF generate."
    )
    n: int = Field(8, ge=1, description="Responses sampled per prompt (the GRPO group size).")
    max_new_tokens: int = Field(256, ge=1, description="Longest response in tokens.")
    min_new_tokens: int = Field(0, ge=0, description="Shortest response in tokens.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    tensor_parallel_size: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        1,
        description="GPUs per vLLM engine; auto: the fewest that hold the engine's weights and "
        "KV cache on the GPU the job got (1 when colocated or on CPU).",
    )
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] | Literal["auto"] = Field(
        0.5,
        description="Share of GPU memory vLLM may take; auto: what the plan leaves the engine "
        "on the GPU the job got (0.9 on rollout GPUs of its own).",
    )
    weight_sync_bucket_mb: int = Field(
        256,
        ge=1,
        description="Weight pushes to the engines travel in buckets of at most this many MiB "
        "(gathered from the shards one parameter at a time): the extra memory a push needs.",
    )
    max_staleness: int = Field(
        0,
        ge=0,
        le=8,
        description="How many weight versions a trained sample may lag the policy (layout: "
        "split only). 0: generate, then train (synchronous). k > 0: the engines generate the "
        "next k batches while the learners train on this one; every sample carries the "
        "version that made it and a batch outside [policy - k, policy] stops the run.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None,
        description="The engines' weights dtype; unset: the model's (model.dtype). A bfloat16 "
        "engine beside a float32 learner samples from a slightly different policy: "
        "algo.rollout_correction then weighs it back (on by default where they differ).",
    )


class RewardSettings(StrictModel):
    function: Str = Field(
        "gsm8k",
        description="Reward: a built-in name (gsm8k; math_verify: the final answer, e.g. "
        "\\boxed{}, equal to the reference by math-verify; math_exact: the whole response "
        "equal to the reference; synthetic names) or a custom "
        "function as 'module:function' or 'path/to/file.py:function'.",
    )
    gsm8k_mode: Literal["strict", "flexible"] = Field(
        "strict",
        description="gsm8k answer extraction: 'strict' reads the number after '####', "
        "'flexible' the last number in the response.",
    )


REWARD_TERM_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
# The fields only an HTTP reward server (url:) reads.
# What a reward term scores with: exactly one of these.
REWARD_SOURCES = ("function", "model", "url")
REWARD_SERVER_FIELDS = (
    "timeout_s",
    "retries",
    "backoff_s",
    "max_concurrency",
    "batch_size",
    "auth_secret",
    "auth_header",
    "auth_scheme",
)


class RewardTerm(StrictModel):
    """One reward of trainer.rewards: a function, a reward model or an HTTP reward server,
    weighted."""

    name: Str | None = Field(
        None,
        description="The term's name in the metrics (reward/<name>/mean, reward/<name>/failed). "
        "Unset: the function's name (what follows ':' in a spec, or the built-in's) or the "
        "server's host.",
    )
    weight: float = Field(
        1.0,
        allow_inf_nan=False,
        description="The term's weight in the total reward; 0: scored and logged only (a "
        "monitor), it neither trains nor excludes a sample.",
    )
    function: Str | None = Field(
        None,
        description="A reward function, as trainer.reward.function: a built-in name or "
        "'module:function' or 'path/to/file.py:function'.",
    )
    model: Str | None = Field(
        None,
        description="A reward model: a one-label sequence classifier (transformers' "
        "AutoModelForSequenceClassification, e.g. LlamaForSequenceClassification) by hub id "
        "or folder, scored on the head in packed passes of token_budget tokens; it reads the "
        "policy's tokens where it shares the policy's tokenizer, else the conversation "
        "rendered with its own chat template (docs/reward-models.md).",
    )
    token_budget: int = Field(
        4096, ge=1, description="model: the most tokens one forward of the reward model holds."
    )
    url: Str | None = Field(
        None,
        description="An HTTP reward server (http:// or https://): rlx POSTs batches of "
        '{"samples": [{"prompt", "response", "answer"}, ...]} and reads {"rewards": '
        "[number or null, ...]} (docs/rewards.md).",
    )
    timeout_s: float = Field(
        30.0, gt=0, allow_inf_nan=False, description="url: seconds one request may take."
    )
    retries: int = Field(
        2, ge=0, le=10, description="url: tries after the first for a request that failed."
    )
    backoff_s: float = Field(
        1.0,
        ge=0,
        allow_inf_nan=False,
        description="url: seconds before the first retry, doubled before each next one.",
    )
    max_concurrency: int = Field(4, ge=1, le=256, description="url: requests in flight at most.")
    batch_size: int = Field(32, ge=1, description="url: samples per request at most.")
    auth_secret: Str | None = Field(
        None,
        description="url: the NAME of a secret (listed in the recipe's secrets:) whose value "
        "is sent in auth_header; read from the environment at run time, never written down.",
    )
    auth_header: Str = Field("Authorization", description="url: the header auth_secret fills.")
    auth_scheme: Str = Field(
        "Bearer",
        description="url: the word before the secret in the header ('Bearer <value>'); '' "
        "sends the value alone.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> RewardTerm:
        given = [f for f in REWARD_SOURCES if getattr(self, f) is not None]
        if len(given) != 1:
            said = (
                f"{' and '.join(f + ':' for f in given)}"
                if given
                else "none of function:, model: and url:"
            )
            raise ValueError(
                f"a reward term sets {said}; give exactly one (function: gsm8k, model: "
                "<hub id or folder>, or url: http://host:port/score)"
            )
        if self.model is None and "token_budget" in self.model_fields_set:
            raise ValueError(
                f"token_budget is for model: terms and this term is a "
                f"{given[0]} ({getattr(self, given[0])}); remove it"
            )
        if self.url is not None:
            scheme = self.url.split("://", 1)[0].lower() if "://" in self.url else ""
            if scheme not in ("http", "https") or not self.url.split("://", 1)[1]:
                raise ValueError(
                    f"url {self.url!r} is not an http:// or https:// address; write e.g. "
                    "http://127.0.0.1:8000/score"
                )
        else:
            stray = [f for f in REWARD_SERVER_FIELDS if f in self.model_fields_set]
            if stray:
                kind = "function" if self.function is not None else "model"
                raise ValueError(
                    f"{', '.join(stray)} {'is' if len(stray) == 1 else 'are'} for url: terms "
                    f"and this term is a {kind} ({getattr(self, kind)}); remove "
                    f"{'it' if len(stray) == 1 else 'them'}"
                )
        if self.name is not None and not REWARD_TERM_NAME.fullmatch(self.name):
            raise ValueError(
                f"name {self.name!r} is not a metric name; use letters, digits, '_', '.' "
                "and '-' (at most 64)"
            )
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A function term's dump carries no server fields (read back, they would be refused).
        data = handler(self)
        if self.url is None:
            for name in REWARD_SERVER_FIELDS:
                data.pop(name, None)
        if self.model is None:
            data.pop("token_budget", None)
        for source in REWARD_SOURCES:
            if getattr(self, source) is None:
                data.pop(source, None)
        return data

    @property
    def label(self) -> str:
        """The term's name: its own, or one derived from its function or server."""
        if self.name is not None:
            return self.name
        if self.function is not None:
            tail = self.function.rsplit(":", 1)[-1]
            return tail if REWARD_TERM_NAME.fullmatch(tail) else "function"
        if self.model is not None:
            tail = re.sub(r"[^A-Za-z0-9_.-]", "_", self.model.rstrip("/").rsplit("/", 1)[-1])
            return tail[:64] if REWARD_TERM_NAME.fullmatch(tail[:64]) else "model"
        host = self.url.split("://", 1)[1].split("/", 1)[0].split("@")[-1] if self.url else ""
        host = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        cleaned = re.sub(r"[^A-Za-z0-9_.-]", "_", host)[:64]
        return cleaned if REWARD_TERM_NAME.fullmatch(cleaned) else "server"


class EnvironmentSettings(StrictModel):
    function: Str = Field(
        description="The environment episodes run in: a built-in name (tool_lookup, "
        "calculator) or a class as 'package.module:Class' or 'path/to/file.py:Class' (see "
        "docs/environments.md). Its reward replaces trainer.reward (or trainer.rewards).",
    )
    max_turns: int = Field(
        4, ge=1, le=64, description="Model turns per episode at most (each a generate call)."
    )
    max_tokens: int | None = Field(
        None,
        ge=1,
        description="Tokens after the prompt per episode at most, the model's and the "
        "environment's together (unset: max_turns * 2 * rollout.max_new_tokens). An episode "
        "that would pass it ends there, truncated.",
    )
    step_timeout_s: float = Field(
        30.0, gt=0, description="Seconds a reset or step may take before its episode fails."
    )
    max_failed_fraction: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Share of a step's episodes that may fail (the environment raised, hung "
        "or returned something unusable) before the run stops; a failed episode trains nothing.",
    )


# A size chosen at start-up for the GPU the job gets (rlx.plan.sizing).
AUTO = "auto"


def fixed_int(value: int | str, name: str) -> int:
    """A size the caller needs fixed: RlxError, one line, where `auto` was never chosen."""
    if value == AUTO or isinstance(value, str):
        raise RlxError(
            f"{name}: auto is chosen for the GPU the job gets, and this needs it fixed; "
            "write a number, or size the recipe first (rlx.plan.planner.size_recipe)"
        )
    return value


def episode_token_budget(settings: TrainerSettings) -> int:
    """Tokens after the prompt an episode may hold (the model's and the environment's):
    what the engines' context, the planner and lint count. Without an environment, the
    longest response."""
    environment = settings.environment
    if environment is None:
        return settings.rollout.max_new_tokens
    if environment.max_tokens is not None:
        return environment.max_tokens
    return environment.max_turns * 2 * settings.rollout.max_new_tokens


class KLSettings(StrictModel):
    coef: float = Field(0.001, ge=0, description="KL weight; 0 turns the reference model off.")
    estimator: Literal["k1", "k2", "k3"] = Field("k3", description="Per-token KL estimator.")
    mode: Literal["loss", "reward"] = Field(
        "loss", description="Add KL to the loss (GRPO style) or subtract it from the reward."
    )


class RolloutCorrectionSettings(StrictModel):
    """Importance weights pi_old / mu for tokens the engines sampled (mu) and the learner
    trains on (pi_old): see docs/losses.md for the paper or peer each level and action follow."""

    on: Literal["auto"] | bool = Field(
        "auto",
        description="auto: on where engine and learner can disagree (a vLLM engine, an engine "
        "or model dtype other than float32, rollout.max_staleness > 0), off where they agree "
        "(the HF engine in float32 on CPU: nothing extra is computed or sent). true / false "
        "force it.",
    )
    level: Literal["token", "sequence", "geometric"] = Field(
        "token",
        description="Whose ratio a token gets: token (its own, TIS / IcePop), sequence (the "
        "response's product, verl's and TRL's sequence IS) or geometric (the response's "
        "per-token geometric mean, SkyRL's geometric mask).",
    )
    action: Literal["truncate", "mask"] = Field(
        "truncate",
        description="Outside [low, high]: truncate clamps the weight into the bounds (TIS); "
        "mask drops the token or response from the loss (IcePop, rejection sampling; needs "
        "low and high written).",
    )
    low: float | None = Field(
        None,
        description="Lower bound, 0 <= low <= 1; unset: 0 (truncate only).",
    )
    high: float | None = Field(
        None,
        description="Upper bound, >= 1; unset: algo.behavior_weight_cap (truncate only).",
    )
    max_mismatch_kl: float | None = Field(
        1.0,
        gt=0,
        description="Stop the run, in one line, at a step whose mismatch/kl (the engines' "
        "log-probs against the learner's on every sampled token) is above this: engines that "
        "differ by dtype or kernels stay far below 1 (about 1e-3 in bf16), engines serving "
        "other weights do not. null: never stop on it. Measured wherever the correction is on.",
    )


class OverlongSettings(StrictModel):
    """Responses near or at rollout.max_new_tokens (DAPO, Yu et al. 2025, section 3.4):
    see docs/losses.md."""

    mask_truncated: bool = Field(
        False,
        description="Train nothing on a response the limit cut (no EOS): its tokens leave "
        "the loss and its score leaves its group's baseline (DAPO's overlong filtering).",
    )
    buffer: int = Field(
        0,
        ge=0,
        description="DAPO's soft overlong punishment: a response longer than max_new_tokens "
        "- buffer loses penalty x (its tokens past that point) / buffer, -penalty at the "
        "limit. 0: off. What the advantages read; the outcome (reward/mean) stays the "
        "reward function's.",
    )
    penalty: float = Field(
        1.0, ge=0, description="The punishment at the limit (buffer > 0), in reward units."
    )


class AlgorithmSettings(StrictModel):
    clip_eps: float = Field(0.2, gt=0, lt=1, description="PPO ratio clip (lower side).")
    clip_eps_high: float | None = Field(
        None, gt=0, lt=10, description="Upper ratio clip; defaults to clip_eps."
    )
    dual_clip: float | None = Field(
        None, gt=1, description="Dual-clip bound c > 1 for negative advantages; off if unset."
    )
    kl: KLSettings = Field(default_factory=KLSettings, description="KL to the reference model.")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus weight.")
    gamma: float = Field(1.0, gt=0, le=1, description="Discount (PPO/GAE).")
    gae_lambda: float = Field(0.95, ge=0, le=1, description="GAE lambda (PPO).")
    vf_coef: float = Field(0.5, ge=0, description="Value loss weight (PPO).")
    value_clip: float = Field(0.2, gt=0, description="Value clip range (PPO).")
    norm_adv_by_std: bool = Field(True, description="Divide group advantages by their std (GRPO).")
    policy_loss: Literal["ppo", "gspo", "cispo"] = Field(
        "ppo",
        description="The policy loss. ppo: the clipped surrogate per token (Schulman et al. "
        "2017). gspo: the response's length-normalised ratio exp(mean_t log(pi / pi_old)), "
        "clipped per response (Zheng et al. 2025, GSPO); needs loss_agg seq-mean-token-mean, "
        "and the paper clips at about 3e-4 / 4e-4 (clip_eps, clip_eps_high), not 0.2. cispo: "
        "-sg(clip(pi / pi_old)) x A x log pi on every token, the clipped weight with its "
        "gradient stopped (MiniMax-M1, 2025); no dual_clip.",
    )
    loss_agg: Literal[
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
    ] = Field(
        "token-mean",
        description="How per-token losses become one number, over the whole minibatch: "
        "token-mean (sum / tokens), seq-mean-token-mean (each response's mean, averaged), "
        "seq-mean-token-sum (each response's sum, averaged), seq-mean-token-sum-norm (each "
        "response's sum over a constant, the response budget: rollout.max_new_tokens, or the "
        "episode's token budget with an environment; averaged: Dr. GRPO, Liu et al. 2025).",
    )
    baseline: Literal["batch", "group"] = Field(
        "batch",
        description="algorithm reinforce_pp only: batch (REINFORCE++, Hu 2025: discounted "
        "returns normalised over the step's tokens) or group (REINFORCE++-baseline: minus "
        "the mean score of the prompt's responses first; needs rollout.n >= 2).",
    )
    behavior_weight_cap: float = Field(
        2.0,
        gt=1,
        description="With rollout.max_staleness > 0 the loss is decoupled PPO: each token is "
        "weighted by pi_proximal / pi_behaviour (the learner's log-prob before the update "
        "over the engine's), truncated at this value (rollout_correction's default high).",
    )
    overlong: OverlongSettings = Field(
        default_factory=OverlongSettings,
        description="Responses cut or nearly cut at rollout.max_new_tokens: masked from the "
        "loss, a soft length penalty, or both (DAPO). Single-turn rollouts.",
    )
    rollout_correction: RolloutCorrectionSettings = Field(
        default_factory=RolloutCorrectionSettings,
        description="Weigh each token by pi_old / mu where the engines (mu) and the learner "
        "(pi_old) can disagree: another dtype, vLLM's kernels, stale samples. One rule, which "
        "also gives max_staleness > 0 its decoupled PPO weight.",
    )


class OptimSettings(StrictModel):
    lr: float = Field(1e-6, gt=0, description="Policy learning rate.")
    critic_lr: float = Field(1e-5, gt=0, description="Critic learning rate (PPO).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    grad_clip: float = Field(1.0, gt=0, description="Global gradient-norm clip.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps.")
    schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="Learning-rate schedule after warm-up."
    )


class FilterGroupsSettings(StrictModel):
    """Dynamic sampling (DAPO, Yu et al. 2025, section 3.2): see docs/losses.md."""

    on: Literal["outcome", "reward"] = Field(
        "outcome",
        description="What must vary within a prompt's group for it to train: outcome (the "
        "reward function's or environment's score, before any shaping or KL) or reward "
        "(after algo.overlong's penalty).",
    )
    max_rounds: int = Field(
        4,
        ge=1,
        le=64,
        description="Generate calls per step at most, the first included: each later one "
        "samples prompts_per_step more prompts. A step that still has too few varied groups "
        "trains on the groups it has, filled with unvaried ones, and says so in one line.",
    )
    tolerance: float = Field(
        1e-6,
        ge=0,
        description="Scores closer than this (max - min within a group) count as no spread.",
    )


class BatchSettings(StrictModel):
    prompts_per_step: int = Field(8, ge=1, description="Prompts sampled per training step.")
    filter_groups: FilterGroupsSettings | None = Field(
        None,
        description="Dynamic sampling: train only on prompts whose responses' scores differ "
        "(under GRPO a group of equal scores has zero advantage and trains nothing), "
        "sampling more prompts until the step has prompts_per_step such groups. Unset: off.",
    )
    minibatch_size: int | None = Field(
        None,
        ge=1,
        description="Sequences per optimiser update; defaults to the whole step "
        "(prompts_per_step x rollout.n).",
    )
    micro_batch_size: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        4,
        description="Sequences per forward/backward on one device; auto: the largest power of "
        "two that the plan fits with 10% spare on the GPU the job got (host memory on CPU).",
    )
    ppo_epochs: int = Field(1, ge=1, description="Passes over each step's samples.")
    max_tokens_per_micro_batch: int | None = Field(
        None,
        ge=1,
        description="The token budget of one forward/backward (prompt + response tokens). "
        "Packed: the most tokens a pass holds; unset, micro_batch_size sequences of the "
        "longest length (max_prompt_length + the response budget), so a pass needs no more "
        "memory than a padded micro-batch would. Not packed: micro-batches are cut by this "
        "budget (rows sorted by length, padding excluded) instead of micro_batch_size "
        "sequences; unset: fixed counts.",
    )
    packing: bool | None = Field(
        None,
        description="Pack sequences end to end (no padding) into the passes of every forward "
        "and backward: the policy's update, old and reference log-probs, the critic. Exact: "
        "each sequence attends to itself only (position ids restart per sequence; "
        "FlashAttention's varlen kernels where installed on GPU, a block-diagonal mask "
        "elsewhere), checked on the first step. Unset: packed where the model's attention "
        "keeps packed sequences apart (padded micro-batches with one line where not) and "
        "where it computes fewer positions than padded micro-batches that run a prompt "
        "shared by several samples once (short responses after long prompts); true: packed "
        "whenever exact; "
        "false: padded micro-batches.",
    )


def effective_strategy(strategy: str, ranks: int) -> Literal["single", "ddp", "fsdp"]:
    """What `trainer.parallel.strategy` means with `ranks` training ranks, the plan unasked:
    one rank is always a plain module ('single'); 'auto' is FSDP otherwise. The rule that
    reads the plan and the nodes' network is rlx.plan.strategy.choose_strategy."""
    if ranks <= 1:
        return "single"
    return "ddp" if strategy == "ddp" else "fsdp"


class ParallelSettings(StrictModel):
    strategy: Literal["auto", "fsdp", "ddp"] = Field(
        "auto",
        description="How training ranks share the models: 'fsdp' shards weights, gradients "
        "and optimiser state (FSDP2, per decoder layer then the root); 'ddp' replicates them; "
        "'auto' decides from the plan and the nodes' network: ddp when the training ranks span "
        "several GPU nodes with no fast fabric (resources.fabric unset or tcp) and the "
        "replicated state leaves every training GPU 10% spare, fsdp otherwise (and whenever "
        "an offload below is on; one rank is always a plain module). `rlx plan` prints the "
        "choice and why.",
    )
    offload_reference: bool = Field(
        False, description="Keep the reference model's shards in host memory (FSDP)."
    )
    offload_optimizer: bool = Field(
        False,
        description="Keep the trained models' parameters, gradients and optimiser state in "
        "host memory and step on the CPU (FSDP2 CPU offload).",
    )
    reshard_after_forward: bool = Field(
        True,
        description="Free each layer's gathered weights after its forward (less memory, one "
        "more all-gather in the backward).",
    )


class ValidationSettings(StrictModel):
    data: Str = Field(
        description="Held-out prompts: a .jsonl or .parquet file in the training data's "
        "layout, or 'synthetic:NAME' (that task's held-out phrasings). Prompts that also "
        "appear in the training data are dropped, so the set stays disjoint from it. Or an "
        "hf://ORG/NAME[@REVISION] dataset (validation.split chooses its part)."
    )
    config: Str | None = Field(
        None, description="The configuration of an hf:// dataset; unset: data.config."
    )
    split: Str = Field("test", description="The split of an hf:// dataset to validate on.")
    every: int = Field(
        10, ge=1, description="Validate every this many steps, at step 0 and at the last step."
    )
    n: int = Field(
        4,
        ge=1,
        description="Samples per prompt (at the rollout temperature): val/reward_mean, "
        "val/pass@k for k = 1, 2, 4, ... <= n (k = 1 as val/pass@1_sampled), val/avg@n, "
        "val/maj@n (where the reward compares answers) and val/response_length.",
    )
    max_new_tokens: int | None = Field(
        None, ge=1, description="Longest validation response; defaults to rollout.max_new_tokens."
    )
    max_prompts: int | None = Field(
        None, ge=1, description="Use at most this many held-out prompts (the first ones)."
    )
    pass_threshold: float = Field(
        1.0,
        description="A sample is correct for val/pass@k and val/maj@n when its reward is at "
        "least this (1.0: the 0/1 rewards' success; lower it for a graded reward), as "
        "`rlx eval --pass-threshold`.",
    )


class BestSettings(StrictModel):
    metric: Str = Field(
        description="The validation metric that ranks the saved steps: one the run logs, "
        "val/pass@1 (greedy), val/reward_mean, val/pass@1_sampled, val/pass@K (K = 2, 4, ... "
        "<= validation.n), val/avg@N or val/maj@N (N = validation.n; maj where the reward "
        "compares answers), val/response_length."
    )
    mode: Literal["max", "min"] = Field(
        "max", description="'max': the highest value is the best; 'min': the lowest."
    )

    @field_validator("metric")
    @classmethod
    def _validation_metric(cls, value: str) -> str:
        if not value.startswith("val/"):
            raise ValueError(
                f"{value!r} is not a validation metric; the best step is ranked by a val/* "
                "metric, e.g. val/pass@1 or val/avg@4"
            )
        return value


class CheckpointSettings(StrictModel):
    dir: Str | None = Field(
        None,
        description="Folder for checkpoints (a per-run subfolder is made). Must be on storage "
        "every node shares when nodes > 1. Unset: no checkpoints.",
    )
    every: int = Field(50, ge=1, description="Save every this many steps.")
    keep: int = Field(
        3,
        ge=1,
        description="Complete checkpoints to keep, the newest ones (and the best step, "
        "checkpoint.best, beside them).",
    )
    best: BestSettings | None = Field(
        None,
        description="Keep the best checkpoint by a validation metric, {metric: val/..., mode: "
        "max|min}: a step that is both validated and saved whose value beats the best so "
        "far becomes the best; it is never rotated out by keep (one step beside the newest), "
        "it survives resume, and result.json and the run's summary name it. Needs a "
        "validation section and checkpoint.dir; make checkpoint.every a multiple of "
        "validation.every so that every save is a candidate.",
    )
    resume: Literal["auto", "never"] | Str = Field(
        "auto",
        description="'auto' resumes from the newest complete checkpoint of this run that "
        "verifies (every file listed with its recorded size), 'never' starts fresh, or a path "
        "to one checkpoint.",
    )
    on_failure: Literal["stop", "continue"] = Field(
        "stop",
        description="A save that fails for good (disk full, permission lost, store down past "
        "its deadline): 'stop' ends the run with one line (exit 1, or 75 where running it "
        "again may succeed); 'continue' warns, trains on and tries again at the next save.",
    )


class LoggingSettings(StrictModel):
    dir: Str = Field("runs", description="Folder for metrics, TensorBoard logs and plots.")
    tensorboard: bool = Field(True, description="Write TensorBoard event files.")
    wandb_project: Str | None = Field(
        None, description="W&B project; used only when WANDB_API_KEY is set."
    )
    every: int = Field(1, ge=1, description="Print metrics every this many steps.")


class TrainerSettings(StrictModel):
    """The shared PPO/GRPO trainer rlx runs on the head node."""

    algorithm: Literal["grpo", "ppo", "rloo", "reinforce_pp"] = Field(
        "grpo",
        description="grpo (group-normalised), rloo (leave-one-out), ppo (critic + GAE) or "
        "reinforce_pp (REINFORCE++: returns normalised over the batch; algo.baseline).",
    )
    model: ModelSettings = Field(
        description="Policy model (also the reference and, for PPO, the critic's starting point)."
    )
    critic_model: ModelSettings | None = Field(
        None, description="Critic model for PPO; defaults to the policy model."
    )
    data: DataSettings = Field(description="Prompt dataset.")
    rollout: RolloutSettings = Field(default_factory=RolloutSettings, description="Generation.")
    reward: RewardSettings = Field(
        default_factory=RewardSettings,
        description="Reward: one function (the same as trainer.rewards with one term of "
        "weight 1). Not with trainer.rewards.",
    )
    rewards: list[RewardTerm] | None = Field(
        None,
        min_length=1,
        description="Rewards mixed with weights: terms of function: or url: (an HTTP reward "
        "server), each with a weight (0: logged only). Replaces trainer.reward. A term that "
        "fails on a sample (an error, a timeout, null, not a finite number) gives it no "
        "reward, never 0: the sample trains nothing and leaves its group's baseline.",
    )
    reward_aggregate: Literal["sum_then_normalize", "normalize_then_sum"] = Field(
        "sum_then_normalize",
        description="How the terms make the reward the advantages read: sum_then_normalize "
        "adds the weighted terms (the advantage estimator normalises the sum); "
        "normalize_then_sum first normalises each term over its group (the prompt's n "
        "responses; the batch when rollout.n is 1) to mean 0 and std 1, then adds them "
        "weighted, so a term of large scale does not drown the others. reward/mean reports "
        "the weighted sum of the raw terms either way.",
    )
    reward_max_failed: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Share of a step's samples whose reward may fail (a weighted term gave "
        "no number) before the run stops, with one line and before the update: the last "
        "checkpoint is kept.",
    )
    environment: EnvironmentSettings | None = Field(
        None,
        description="Multi-turn episodes: the model acts, an environment (a tool, a game) "
        "answers, for up to max_turns turns; the environment gives the reward. Unset: one "
        "response per prompt, scored by trainer.reward.",
    )
    algo: AlgorithmSettings = Field(default_factory=AlgorithmSettings, description="Losses.")
    optim: OptimSettings = Field(default_factory=OptimSettings, description="Optimiser.")
    batch: BatchSettings = Field(default_factory=BatchSettings, description="Batch sizes.")
    steps: int = Field(100, ge=1, description="Training steps.")
    seed: int = Field(0, ge=0, description="Random seed (data order, sampling, init).")
    layout: Literal["colocated", "split"] = Field(
        "colocated",
        description="'colocated': training and rollout share every GPU; 'split': rollout "
        "engines get rollout_gpus GPUs of their own.",
    )
    rollout_gpus: int = Field(0, ge=0, description="GPUs for rollout engines with layout: split.")
    parallel: ParallelSettings = Field(
        default_factory=ParallelSettings, description="Sharding of the trained models."
    )
    validation: ValidationSettings | None = Field(
        None,
        description="Score the policy on held-out prompts during training: greedy pass@1, "
        "and pass@k, avg@n, maj@n and the mean reward of n samples. Unset: no validation.",
    )
    checkpoint: CheckpointSettings = Field(
        default_factory=CheckpointSettings, description="Checkpointing and resume."
    )
    logging: LoggingSettings = Field(default_factory=LoggingSettings, description="Metrics.")
    stall_timeout: float | None = Field(
        None,
        gt=0,
        description="Seconds a step may take before the run counts as stalled: it stops with "
        "one line naming the phase (generation, reward, the training ranks' update, a weight "
        "push, a save) and the actors that did not answer, keeps its last complete "
        "checkpoint and exits 75 so the job is run again. Also the timeout of the training "
        "ranks' collectives and of every weight push. Unset: 5 x the slowest step so far, "
        "at least 600 s, and 1800 s until the first step finishes (also the collectives' "
        "timeout).",
    )

    @field_validator("stall_timeout", mode="before")
    @classmethod
    def _positive_stall_timeout(cls, value: Any) -> Any:
        if isinstance(value, int | float) and not isinstance(value, bool) and value <= 0:
            raise ValueError(
                f"{value!r}: give the seconds a step may take before the run counts as "
                "stalled (more than 0), or leave it unset for 5 x the slowest step so far"
            )
        return value

    @model_validator(mode="after")
    def _reward_terms(self) -> TrainerSettings:
        if self.rewards is None:
            return self
        if "reward" in self.model_fields_set:
            raise ValueError(
                "both reward: and rewards: are set; keep one (a function alone in reward:, "
                "or every term in rewards:, e.g. - function: gsm8k)"
            )
        if all(term.weight == 0 for term in self.rewards):
            raise ValueError(
                "every term of rewards: has weight 0, so nothing trains; give at least one "
                "term a weight (0 marks a term logged only)"
            )
        labels = [term.label for term in self.rewards]
        twice = sorted({label for label in labels if labels.count(label) > 1})
        if twice:
            raise ValueError(
                f"rewards: {len(labels) - len(set(labels)) + 1} terms are named {twice[0]!r}; "
                "give each a name: of its own (the metrics key on it)"
            )
        return self

    def reward_terms(self) -> list[RewardTerm]:
        """The terms the run scores with: trainer.rewards, or trainer.reward as one term of
        weight 1."""
        if self.rewards is not None:
            return list(self.rewards)
        spec = self.reward.function
        if spec == "gsm8k" and self.reward.gsm8k_mode == "flexible":
            spec = "gsm8k_flexible"
        return [RewardTerm(function=spec)]

    def reward_term_fields(self) -> list[tuple[str | int, ...]]:
        """Where each of reward_terms() is written in the recipe."""
        if self.rewards is not None:
            return [("trainer", "rewards", i) for i in range(len(self.rewards))]
        return [("trainer", "reward")]

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Single-turn jobs carry no `environment: null` in their dump (RLX_RECIPE_JSON), and
        # single-reward ones no `rewards: null`.
        data = handler(self)
        if self.environment is None:
            data.pop("environment", None)
        if self.rewards is None:
            data.pop("rewards", None)
        else:  # read back, a dumped reward: beside rewards: would be refused
            data.pop("reward", None)
        return data


# --------------------------------------------------------------------------- backends


class SkyRecovery(StrictModel):
    strategy: Literal["FAILOVER", "EAGER_NEXT_REGION"] = Field(
        "EAGER_NEXT_REGION", description="How a managed job recovers from preemption."
    )
    max_restarts_on_errors: int = Field(
        0, ge=0, description="Restarts after a user-code failure (0: only after preemption)."
    )


class SkySettings(StrictModel):
    """SkyPilot-only settings."""

    infra: Str | None = Field(
        None, description="Where to run, e.g. 'aws', 'gcp/us-central1', 'k8s'. Any if unset."
    )
    disk_tier: Literal["low", "medium", "high", "ultra", "best"] | None = Field(
        None, description="Disk performance tier."
    )
    recovery: SkyRecovery | None = Field(
        None, description="Managed-job recovery (used with `rlx launch --managed`)."
    )


class DstackRetry(StrictModel):
    on_events: list[Literal["no-capacity", "interruption", "error"]] = Field(
        default_factory=lambda: ["no-capacity", "interruption"],
        description="Events that trigger a retry.",
    )
    duration: Str = Field("1h", description="How long to keep retrying, e.g. '1h' or '2d'.")


class DstackSettings(StrictModel):
    """dstack-only settings."""

    fleets: list[Str] = Field(
        default_factory=list,
        description="Fleets to run in; distributed tasks need a fleet with placement: cluster.",
    )
    backends: list[Str] = Field(default_factory=list, description="dstack backends to consider.")
    regions: list[Str] = Field(default_factory=list, description="Regions to consider.")
    max_price: float | None = Field(None, gt=0, description="Highest price per instance hour.")
    max_duration: Str | None = Field(None, description="Stop the run after this long, e.g. '8h'.")
    retry: DstackRetry | None = Field(None, description="Retry policy.")


class SlurmContainer(StrictModel):
    """The container every node of a Slurm job runs in."""

    runtime: Literal["pyxis", "docker", "podman", "apptainer"] = Field(
        "pyxis",
        description="pyxis (srun --container-image), docker or podman (one container per "
        "node, removed when the job ends) or apptainer (apptainer exec --nv).",
    )
    image: Str = Field(
        description="Image: 'nvcr.io#nvidia/pytorch:24.05-py3' (pyxis), a registry or local "
        "image name (docker, podman), or a .sif file or docker:// URI (apptainer)."
    )
    mounts: list[Str] = Field(
        default_factory=list,
        description="Bind mounts SRC:DST[:ro]; the recipe's volumes are added automatically.",
    )
    shm_size: Str = Field(
        "16g", description="docker/podman: size of /dev/shm in the container (Ray and NCCL use it)."
    )

    @field_validator("mounts")
    @classmethod
    def _mounts(cls, value: list[str]) -> list[str]:
        for mount in value:
            parts = mount.split(":")
            if (
                not 2 <= len(parts) <= 3
                or not all(parts[:2])
                or (len(parts) == 3 and parts[2] not in ("ro", "rw"))
            ):
                raise ValueError(
                    f"{mount!r} is not SRC:DST or SRC:DST:ro; write e.g. '/data:/data:ro'"
                )
        return value


class SlurmRequeue(StrictModel):
    """Requeue the job when its cluster fails or it is preempted, resuming from checkpoints."""

    retries: int = Field(
        3, ge=1, le=100, description="Attempts after the first (SLURM_RESTART_COUNT below it)."
    )
    signal_lead: int = Field(
        300,
        ge=10,
        le=86400,
        description="Seconds before the time limit (or a preemption) Slurm sends USR1, on "
        "which the trainer saves a checkpoint and the job requeues (#SBATCH --signal).",
    )


class SlurmSettings(StrictModel):
    """Slurm-only settings."""

    partition: Str | None = Field(None, description="Partition (sbatch --partition).")
    account: Str | None = Field(None, description="Account to charge (sbatch --account).")
    qos: Str | None = Field(None, description="Quality of service (sbatch --qos).")
    time: Str | None = Field(
        None, description="Time limit: minutes, HH:MM:SS or D-HH:MM:SS (sbatch --time)."
    )
    constraint: Str | None = Field(None, description="Node features (sbatch --constraint).")
    gpu_features: dict[Str, Str] = Field(
        default_factory=dict,
        description="The cluster's node feature for each accelerator type, e.g. {H100: h100, "
        "A100-80GB: a100}: with accelerator alternatives the job asks for any of them, "
        "every node the same one (--constraint=[h100|a100]).",
    )
    exclusive: bool = Field(True, description="Take whole nodes (sbatch --exclusive).")
    gpu_flag: Literal["gpus-per-node", "gres"] = Field(
        "gpus-per-node", description="How to ask for GPUs: --gpus-per-node=N or --gres=gpu:N."
    )
    container: SlurmContainer | None = Field(
        None,
        description="Run every node of the job in a container (pyxis, Docker, Podman, Apptainer).",
    )
    requeue: SlurmRequeue | None = Field(
        None,
        description="Requeue on a cluster failure (exit 75), a preemption or the time-limit "
        "warning while retries remain; each attempt logs apart and resumes from the newest "
        "checkpoint.",
    )
    modules: list[Str] = Field(
        default_factory=list, description="Environment modules to load (module load NAME)."
    )
    log_dir: Str = Field(
        "rlx-logs",
        description="Folder for per-job log folders (driver, head, one per worker); must be "
        "on shared storage.",
    )

    @model_validator(mode="before")
    @classmethod
    def _moved_container_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            old = [k for k in ("container_image", "container_mounts") if k in data]
            if old:
                raise ValueError(
                    f"{' and '.join(old)} moved under slurm.container; write container: "
                    "{runtime: pyxis, image: IMAGE, mounts: [SRC:DST]}"
                )
        return data

    @field_validator("partition", "account", "qos")
    @classmethod
    def _word(cls, value: str | None) -> str | None:
        # These land on #SBATCH lines, which no shell quoting protects.
        if value is not None and not SLURM_WORD.fullmatch(value):
            raise ValueError(
                f"{value!r} has characters Slurm names do not use; write a plain "
                "name such as 'gpu' or 'my-account'"
            )
        return value

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A recipe that maps no features carries none in its dump (RLX_RECIPE_JSON).
        data = handler(self)
        if not self.gpu_features:
            data.pop("gpu_features", None)
        return data

    @field_validator("gpu_features")
    @classmethod
    def _gpu_features(cls, value: dict[str, str]) -> dict[str, str]:
        for accelerator, feature in value.items():
            # A feature lands in a constraint expression on an #SBATCH line.
            if not SLURM_FEATURE.fullmatch(feature):
                raise ValueError(
                    f"{accelerator}: {feature!r} is not a Slurm feature name; write a plain "
                    "name such as 'h100'"
                )
        return value

    @field_validator("constraint")
    @classmethod
    def _constraint(cls, value: str | None) -> str | None:
        if value is not None and not SLURM_CONSTRAINT.fullmatch(value):
            raise ValueError(
                f"{value!r} is not a Slurm constraint expression; write e.g. 'h100&ib'"
            )
        return value

    @field_validator("log_dir")
    @classmethod
    def _log_dir(cls, value: str) -> str:
        if not LOG_DIR.fullmatch(value):
            raise ValueError(
                f"{value!r} must be a plain path (letters, digits, '_', '.', '/', "
                "'~', '-'): it goes on an #SBATCH line"
            )
        return value.rstrip("/") or "/"

    @field_validator("time")
    @classmethod
    def _time(cls, value: str | None) -> str | None:
        if value is not None and not SLURM_TIME.fullmatch(value):
            raise ValueError(
                f"{value!r} is not a Slurm time; write minutes, 'HH:MM:SS' or 'D-HH:MM:SS'"
            )
        return value


# --------------------------------------------------------------------------- the recipe


class Recipe(StrictModel):
    """An RL post-training job, described once for every backend."""

    name: Str = Field(
        description="Job name: lowercase letters, digits and '-', starting with a letter, "
        "at most 40 characters (used as cluster, run and job name)."
    )
    resources: Resources = Field(default_factory=Resources, description="Per-node resources.")
    env: dict[Str, Str] = Field(
        default_factory=dict, description="Plain environment variables for every node."
    )
    secrets: list[Str] = Field(
        default_factory=list,
        description="NAMES of secret environment variables; values are read from your "
        "environment at launch and never written to any file.",
    )
    workdir: Str | None = Field(
        None, description="Local folder synced to every node (SkyPilot/dstack) before setup."
    )
    file_mounts: dict[Str, Str] = Field(
        default_factory=dict,
        description="Remote path -> local path or bucket URL (s3://, gs://) on every node.",
    )
    volumes: list[Volume] = Field(
        default_factory=list, description="Shared storage for data, caches and checkpoints."
    )
    setup: Commands = Field(
        default_factory=list, description="Shell commands run once on every node before the job."
    )
    command: Commands | None = Field(
        None,
        description="Shell command the head runs once every node has joined; defaults to "
        "rlx's trainer (`rlx train`).",
    )
    ray: RaySettings = Field(default_factory=RaySettings, description="The job's Ray cluster.")
    trainer: TrainerSettings | None = Field(
        None, description="The PPO/GRPO trainer (needed unless `command` replaces it)."
    )
    sky: SkySettings | None = Field(None, description="SkyPilot settings.")
    dstack: DstackSettings | None = Field(None, description="dstack settings.")
    slurm: SlurmSettings | None = Field(None, description="Slurm settings.")

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not RECIPE_NAME.fullmatch(value):
            raise ValueError(
                f"{value!r} is not a valid job name; use lowercase letters, digits and '-', "
                "start with a letter, at most 40 characters, e.g. 'gsm8k-grpo'"
            )
        return value

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if not ENV_NAME.fullmatch(key):
                raise ValueError(f"{key!r} is not a valid environment variable name")
        return value

    @field_validator("secrets")
    @classmethod
    def _secret_names(cls, value: list[str]) -> list[str]:
        for i, key in enumerate(value):
            if not ENV_NAME.fullmatch(key):
                # Never echo the entry: it may be a secret value pasted by mistake.
                raise ValueError(
                    f"entry {i} is not an environment variable name; list secret NAMES only "
                    "(e.g. HF_TOKEN), never values"
                )
        if len(set(value)) != len(value):
            raise ValueError("a secret is listed twice; list each name once")
        return value

    def on_accelerators(
        self, train: Accelerator | None, rollout: Accelerator | None = None
    ) -> Recipe:
        """This recipe with one accelerator per node kind: `train` for the training nodes
        (every node, without groups) and `rollout` for the rollout group."""
        res = self.resources
        if res.groups is None:
            resources = res.model_copy(update={"accelerators": str(train) if train else None})
        else:
            groups = res.groups.model_copy(
                update={
                    "train": res.groups.train.model_copy(
                        update={"accelerators": str(train) if train else None}
                    ),
                    "rollout": res.groups.rollout.model_copy(
                        update={"accelerators": str(rollout) if rollout else None}
                    ),
                }
            )
            resources = res.model_copy(update={"groups": groups})
        return self.model_copy(update={"resources": resources})

    def alternatives(self) -> list[tuple[str, Recipe]]:
        """(label, recipe) for every accelerator alternative, the preferred first: the label
        names the GPUs ('H100:8', or 'train H100:8 + rollout L4:4' with groups) and the recipe
        asks for just those. One entry (the recipe itself) when there is nothing to choose."""
        train = self.resources.train_nodes.accelerator_options
        rollout_group = self.resources.rollout_nodes
        rollout = rollout_group.accelerator_options if rollout_group else ()
        if len(train) <= 1 and len(rollout) <= 1:
            label = " + ".join(
                f"{name} {group.accelerators}" if rollout_group else str(group.accelerators)
                for name, group in (self.resources.node_groups() or [("", self.resources)])
                if group.accelerators is not None
            )
            return [(label or "CPU", self)]
        out = []
        for first in train or (None,):
            for second in rollout or (None,):
                label = str(first) if rollout_group is None else f"train {first} + rollout {second}"
                out.append((label, self.on_accelerators(first, second)))
        return out

    @property
    def places(self) -> list[str]:
        """Where the job may run: resources.infra, else the older sky.infra (lint refuses
        both); [] for anywhere."""
        if self.resources.infra_list:
            return self.resources.infra_list
        return [self.sky.infra] if self.sky and self.sky.infra else []

    @property
    def head_command(self) -> list[str]:
        """Shell commands the head runs once the cluster is up."""
        return self.command if self.command is not None else ["rlx train"]
