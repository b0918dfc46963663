"""What the trainer needs from a rollout engine, whichever it is.

Log-probs are those of the distribution the token was actually drawn from: logits divided
by the temperature, restricted to the top-p nucleus and renormalised, with EOS forbidden
before min_new_tokens. At temperature 1 and top_p 1 that is the model's own distribution,
so they equal a teacher-forced forward pass of the same weights.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from rlx.recipe.model import TrainerSettings
from rlx.trainer.batch import RolloutBatch
from rlx.trainer.weights import (
    DEFAULT_BUCKET_BYTES,
    BucketLayout,
    GroupAddress,
    NamedTensors,
    WeightGroup,
    buckets,
    receive_push,
)


@dataclass(frozen=True)
class SamplingArgs:
    """How an engine samples: n responses per prompt of at most max_new_tokens (at least
    min_new_tokens: EOS is forbidden before), at this temperature (0: greedy) within the
    top_p nucleus. The defaults sample from the model's own distribution."""

    n: int
    max_new_tokens: int
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0

    @classmethod
    def from_settings(cls, settings: TrainerSettings) -> SamplingArgs:
        rollout = settings.rollout
        return cls(
            rollout.n,
            rollout.max_new_tokens,
            rollout.min_new_tokens,
            rollout.temperature,
            rollout.top_p,
        )


@dataclass(frozen=True)
class EngineSite:
    """Where an engine of the job runs: what its class builds its arguments from, beside the
    settings (RolloutEngine.options_from)."""

    model_path: str
    use_gpu: bool
    device: str | None = None  # where an in-process engine computes
    tensor_parallel: int = 1
    in_process: bool = False  # the engine runs in a training worker's own process (colocated)
    # Makes the calling process ready for an engine that spreads over Ray's nodes, called
    # where the engine does.
    join_ray: Callable[[], None] | None = None


class RolloutEngine(abc.ABC):
    """What the trainer needs from a generator of rollouts. Besides generating and taking
    weights, an engine answers for its own lifecycle (the arguments it is built with, the
    process it needs, sleeping while the policy trains, what it says for the run's log),
    each a no-op here unless the engine needs it: whoever holds an engine never asks which
    kind it holds."""

    # The process holding this engine keeps CUDA's default allocator settings (see
    # rlx.trainer.allocator.use_allocator_settings).
    keeps_default_allocator: ClassVar[bool] = False
    # Colocated: the engine loads its own weights from the model's files, sizing its share
    # of the GPU from the memory still free, so it is built before the learner fills it
    # (otherwise after the learner, over or beside the policy module).
    starts_before_learner: ClassVar[bool] = False
    # The engine splits one model over several GPUs (tensor parallel).
    splits_over_gpus: ClassVar[bool] = False
    # Prompts one generate call takes well when a caller holds many (an evaluation): an
    # engine that schedules its own batches takes them all, one that pads takes a few.
    prompts_per_call: ClassVar[int] = 8

    @classmethod
    def options_from(cls, settings: TrainerSettings, site: EngineSite) -> dict[str, Any]:
        """This engine's own arguments for an engine of the job, built from the settings
        and where it runs (the model path and dtype aside)."""
        return {}

    @classmethod  # noqa: B027 - most engines need nothing beyond rlx's own packages
    def check_installed(cls, settings: TrainerSettings, on_gpus: bool) -> None:
        """Raise RlxError (what to change) where this machine lacks what the engine needs."""

    def notes(self) -> list[str]:
        """What the engine says once at start-up, for the run's log."""
        return []

    def take_part(self, max_new_tokens: int) -> None:  # noqa: B027 - most engines run alone
        """A rank without prompts of its own joins the other ranks' generate (an engine over
        a policy sharded across ranks)."""

    # Colocated, around each update: sleep frees the engine's memory while the policy
    # trains; wake_weights maps its weights' memory again before a push, wake_cache its
    # cache once the push's own buffers are freed. Engines that hold no memory of their own
    # beside the policy do nothing.

    def sleep(self) -> None:  # noqa: B027 - most engines keep their memory
        """Give back the memory the engine holds (its weights and cache)."""

    def wake_weights(self) -> None:  # noqa: B027
        """Map the weights' memory again (their values are whatever the next push writes)."""

    def wake_cache(self) -> None:  # noqa: B027
        """Map the cache again."""

    @abc.abstractmethod
    def generate(
        self,
        prompt_token_ids: list[list[int]],
        sampling: SamplingArgs,
        *,
        seed: int | None = None,
    ) -> RolloutBatch:
        """sampling.n samples per prompt; the same seed and inputs give the same samples.
        temperature 0 is greedy decoding (log-probs then of the untempered model)."""

    # A weight push is begin_weights, load_weight_bucket once per bucket, finish_weights:
    # the sender streams buckets of a bounded size, never the whole state in one object.

    def begin_weights(self) -> None:  # noqa: B027 - most engines need no preparation
        """A push starts: buckets follow, then finish_weights."""

    @abc.abstractmethod
    def load_weight_bucket(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Copy some named tensors (HF parameter names) into the engine's model; returns
        how many it took."""

    @abc.abstractmethod
    def finish_weights(self, version: int) -> None:
        """Every bucket of the push has landed: the engine now holds weights `version`."""

    def load_weights(
        self, weights: NamedTensors, version: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> None:
        """A whole push in one call, streamed in buckets of at most bucket_bytes."""
        items = weights.items() if isinstance(weights, Mapping) else weights
        self.begin_weights()
        loaded = 0
        for bucket in buckets(items, bucket_bytes):
            taken = self.load_weight_bucket(bucket)
            if taken != len(bucket):
                raise RuntimeError(f"the engine took {taken} of the {len(bucket)} tensors sent")
            loaded += taken
        if loaded == 0:
            raise ValueError("load_weights: no tensors given")
        self.finish_weights(version)

    # Split layout: pushes come over the weight group (weights.py). The engine joins it once,
    # taking `weight_receivers` consecutive ranks from first_rank (one per process that holds
    # its weights); each push is then one receive_weights call.

    @property
    def weight_receivers(self) -> int:
        return 1

    @property
    def push_device(self) -> torch.device:
        """Where this engine receives pushed tensors (in-process engines)."""
        return torch.device("cpu")

    def join_weight_group(self, address: GroupAddress, first_rank: int) -> None:
        self._weight_group = WeightGroup.join(address, first_rank, self.push_device)

    def receive_weights(
        self, layouts: Sequence[BucketLayout], version: int, *, drop: int = 0, skip: bool = False
    ) -> int:
        """Receive a whole push from the group's rank 0 and load it; with every tensor
        loaded the engine holds weights `version`. Returns the tensors loaded. drop and skip
        are test hooks (receive_push)."""
        group = getattr(self, "_weight_group", None)
        if group is None:
            raise RuntimeError("receive_weights before join_weight_group")
        if not skip:
            self.begin_weights()
        loaded = receive_push(group, layouts, self.load_weight_bucket, drop=drop, skip=skip)
        if not skip and loaded == sum(len(layout.names) for layout in layouts):
            self.finish_weights(version)
        return loaded

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """The version passed to the last load_weights (0 before any)."""

    @abc.abstractmethod
    def logprob_probe(self, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> float:
        """Sum of log-probs (temperature 1) of response_ids following prompt_ids.

        Two engines holding the same weights agree on it; the trainer compares it with the
        policy's own value to prove a weight push arrived.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release the engine's model and memory; the engine is unusable afterwards."""

    def close_before_exit(self) -> None:
        """The process ends next (its actor is killed): release what would outlive it. All of
        close() unless an engine knows that nothing of it does."""
        self.close()


def check_sampling_args(prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingArgs) -> None:
    if not prompt_token_ids:
        raise ValueError("generate needs at least one prompt")
    for index, ids in enumerate(prompt_token_ids):
        if len(ids) == 0:
            raise ValueError(f"prompt {index} is empty; every prompt needs at least one token")
    if sampling.n < 1:
        raise ValueError(f"n must be at least 1, got {sampling.n}")
    longest, shortest = sampling.max_new_tokens, sampling.min_new_tokens
    if longest < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {longest}")
    if not 0 <= shortest <= longest:
        raise ValueError(f"min_new_tokens must be in [0, max_new_tokens={longest}], got {shortest}")
    if sampling.temperature < 0:
        raise ValueError(
            f"temperature must be > 0 for sampling (0: greedy), got {sampling.temperature}"
        )
    if not 0 < sampling.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {sampling.top_p}")
