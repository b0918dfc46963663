"""Rollout engines in the training workers (layout: colocated), and what they need around an
update.

Every training worker holds an engine over its own policy: HF generate on the very nn.Module
being trained (no copy, nothing to push), or a vLLM engine on the same GPU that sleeps while
the policy trains and is woken and reloaded after each update. (layout: split puts engines
in actors of their own instead: actors/cluster.py, Cluster.sync_weights.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from rlx.trainer.rollout.base import RolloutEngine
from rlx.trainer.rollout.hf import HFEngine
from rlx.trainer.weights import DEFAULT_BUCKET_BYTES, dtype_named


class SharedModuleEngine(HFEngine):
    """HF generate over the policy module itself (colocated on CPU, or GPU without vLLM):
    the update writes the engine's weights, so a "push" only records the version."""

    def mark_version(self, version: int) -> None:
        self._version = int(version)


class ColocatedEngine:
    """The engine a training worker holds, and what it needs around an update. A vLLM
    engine sleeps (frees its GPU memory) while the policy trains where the platform lets
    it; where it cannot (vLLM's CPU build) it keeps its memory and the run goes on."""

    def __init__(
        self,
        engine: RolloutEngine,
        shares_policy: bool,
        can_sleep: bool = False,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        dtype: torch.dtype | None = None,
    ):
        self.engine = engine
        self.bucket_bytes = bucket_bytes
        self.dtype = dtype  # the engine's: pushed tensors are cast to it before they move
        self._state_away = False  # the learner's optimiser state is on the host for now
        self.shares_policy = shares_policy
        self.can_sleep = can_sleep
        self._asleep = False

    def release(self, learner: Any = None) -> None:
        """Before forwards and the update: a vLLM engine gives back its GPU memory, then the
        learner's optimiser state comes back to the GPU (moved off it for generation)."""
        if self.can_sleep and not self._asleep:
            self.engine.sleep()
            self._asleep = True
            if learner is not None and self._state_away:
                learner.move_optimizer_state(learner.device)
                self._state_away = False

    def refresh(self, policy: nn.Module, version: int, learner: Any = None) -> None:
        """After the update: make the engine generate with the policy's new weights. A
        sleeping engine wakes into the room the learner leaves (its optimiser state moves to
        the host; gradients are already freed after each step) in the order that keeps the
        peak lowest: the weights' memory first, then the push (each parameter cast to the
        engine's dtype where it lies, gathered whole under FSDP, handed to the in-process
        engine without leaving the device), and only once the push's buffers are freed the
        KV cache."""
        if self.shares_policy:
            assert isinstance(self.engine, SharedModuleEngine)
            self.engine.mark_version(version)
            return
        engine = self.engine
        waking = self._asleep
        if waking:
            if learner is not None and learner.device.type == "cuda":
                self._state_away = learner.move_optimizer_state("cpu") > 0
            engine.wake_weights()
        from rlx.trainer.model.push import engine_tensors

        # Parameters one at a time (the engine streams them in buckets), not a state-dict
        # copy; tied weights appear once. A sharded policy gathers each on every rank.
        engine.load_weights(engine_tensors(policy, self.dtype), version, self.bucket_bytes)
        if waking:
            engine.wake_cache()
            self._asleep = False


SLEEP_REFUSED = (
    "note: vLLM cannot sleep on this platform (its CPU build); the colocated engine keeps "
    "its memory while the policy trains"
)


def make_colocated_engine(
    kind: str,
    policy: nn.Module | None,
    model_path: str,
    *,
    dtype: str,
    options: Mapping[str, Any] | None = None,
    collective: Callable[[bool], bool] | None = None,
    say: Callable[[str], None] | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> ColocatedEngine:
    """kind is 'hf' or 'vllm' (already resolved from 'auto'); options: the engine's own
    arguments (its class's options_from, in_process; an HF engine over the policy takes
    none). collective: the policy is
    sharded over the ranks (see HFEngine). `say` gets the one note about sleep mode where
    the platform refuses it, and the HF engine's where it decodes through transformers'
    forward (None: keep quiet)."""
    if kind == "hf":
        if policy is None:
            raise ValueError("a colocated hf engine generates with the policy module itself")
        wanted = dtype_named(dtype)
        if next(policy.parameters()).dtype != wanted:
            return _own_weights_engine(policy, model_path, wanted, collective, bucket_bytes)
        shared = SharedModuleEngine(policy, collective=collective)
        for note in shared.notes() if say is not None else ():
            say(note)
        return ColocatedEngine(shared, shares_policy=True)
    from rlx.trainer.rollout.vllm import VLLMEngine, sleep_mode_available

    can_sleep = sleep_mode_available()
    if not can_sleep and say is not None:
        say(SLEEP_REFUSED)
    arguments = {"enable_sleep_mode": can_sleep, **(options or {})}
    engine = VLLMEngine(model_path, dtype=dtype, **arguments)
    return ColocatedEngine(engine, False, can_sleep, bucket_bytes, dtype_named(dtype))


def _own_weights_engine(
    policy: nn.Module,
    model_path: str,
    dtype: torch.dtype,
    collective: Callable[[bool], bool] | None,
    bucket_bytes: int,
) -> ColocatedEngine:
    """An HF engine of its own in `dtype` beside the policy (rollout.dtype other than the
    model's: e.g. a bfloat16 engine beside a float32 learner), pushed to after each update
    as a vLLM engine is. Whole weights in one process: not for a sharded policy or LoRA."""
    if collective is not None or hasattr(policy, "peft_config"):
        raise ValueError(
            "trainer.rollout.dtype other than the model's needs, colocated, an HF engine of its "
            "own, which a sharded or LoRA policy cannot push to; leave rollout.dtype unset"
        )
    device = next(policy.parameters()).device
    engine = HFEngine(model_path, dtype=dtype, device=device)
    return ColocatedEngine(engine, False, False, bucket_bytes, dtype)
