"""One data-parallel rank of the trainer: its models, the per-sample forwards that precede an
update, and the update itself. Plain torch (and torch.distributed when there are several
ranks); the Ray actor (actors/workers.py) only moves batches in and numbers out.

The update, per step: ppo_epochs passes over this rank's share of the samples, each cut into
minibatches (one optimiser step each) and those into micro-batches (one forward/backward
each). Every micro-batch loss is divided by the token and sequence counts of the WHOLE
minibatch across all ranks (algos.loss_denominators, summed over ranks), so the gradient the
optimiser needs is the SUM over ranks and micro-batches. DDP averages, so under DDP the loss
is multiplied by the world size; FSDP2 is set to sum (sharding.shard). The gradient is then
the same however the minibatch is split over ranks and micro-batches (test_parallel.py).

How the models are shared between ranks (one module, DDP, FSDP2) is sharding.py's business;
under FSDP every rank runs the same number of forwards (see passes.PassPlanner.passes).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rlx.errors import RlxError
from rlx.recipe.correction import correction_bounds
from rlx.recipe.model import TrainerSettings, episode_token_budget
from rlx.runs import IS_TRUNCATED, IS_WEIGHT, MISMATCH_LOGGED
from rlx.trainer import algos
from rlx.trainer import packing as pack
from rlx.trainer.algos.mismatch import mismatch_metrics
from rlx.trainer.batch import (
    ADVANTAGES,
    BEHAV_LOGP,
    OLD_LOGP,
    REF_LOGP,
    RETURNS,
    VALUES,
    SequenceBatch,
)
from rlx.trainer.job import runs_ahead
from rlx.trainer.learn import sharding
from rlx.trainer.learn.models import (
    autocast,
    compute_dtype,
    load_causal_lm,
    load_value_model,
    make_optimizer,
    sequence_logprob,
)
from rlx.trainer.learn.passes import Measure, PassPlanner
from rlx.trainer.learn.scoring import ResponseScorer, TokenScores, response_values, score_responses
from rlx.trainer.model import lora
from rlx.trainer.model.attention import use_segment_attention
from rlx.trainer.seeding import derive_seed


def minibatches_per_epoch(settings: TrainerSettings) -> int:
    samples = settings.batch.prompts_per_step * settings.rollout.n
    return samples // (settings.batch.minibatch_size or samples)


def needs_old_logprobs(settings: TrainerSettings, ahead: bool) -> bool:
    """Old log-probs need their own forward only when the policy moves before some samples
    are used (several epochs or minibatches), when the KL penalty enters the reward, or when
    samples may be older than the policy (ahead, TrainJob.ahead: they are decoupled PPO's
    proximal log-probs). Otherwise the update's own log-probs, detached, are exactly the old
    ones."""
    several_updates = settings.batch.ppo_epochs > 1 or minibatches_per_epoch(settings) > 1
    kl_in_reward = settings.algo.kl.coef > 0 and settings.algo.kl.mode == "reward"
    return several_updates or kl_in_reward or ahead


def correction_on(settings: TrainerSettings) -> bool:
    """Whether the policy loss weighs tokens by pi_old / mu (algo.rollout_correction, its
    auto already decided by TrainJob.of; an undecided auto counts as on)."""
    return settings.algo.rollout_correction.on is not False


def sends_engine_logprobs(settings: TrainerSettings, ahead: bool) -> bool:
    """Whether the engines' sampling log-probs travel to the learner (BEHAV_LOGP): where the
    correction reads them, where samples may be stale (ahead, TrainJob.ahead), or where the
    engines run another dtype than the model (the mismatch is then measured). Otherwise
    engine and learner agree to float32 rounding and nothing extra is sent or computed."""
    rollout = settings.rollout
    other_dtype = rollout.dtype is not None and rollout.dtype != settings.model.dtype
    return correction_on(settings) or ahead or other_dtype


@dataclass
class UpdateStats:
    """Numbers from one rank's update, ready to be merged over ranks (merge_update_stats).

    weighted/weights: token-weighted means (value x tokens, tokens). sums: losses already
    divided by the global counts, so adding them over micro-batches and ranks gives the
    minibatch loss; divided by `updates` at the end. same: equal on every rank (grad norms).
    """

    weighted: dict[str, float] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    sums: dict[str, float] = field(default_factory=dict)
    same: dict[str, float] = field(default_factory=dict)
    maxima: dict[str, float] = field(default_factory=dict)  # largest over passes and ranks
    updates: int = 0
    notes: list[str] = field(default_factory=list)  # lines for the run's log

    def max(self, name: str, value: Tensor | float) -> None:
        self.maxima[name] = max(self.maxima.get(name, float("-inf")), float(value))

    def mean(self, name: str, value: Tensor | float, tokens: int) -> None:
        self.weighted[name] = self.weighted.get(name, 0.0) + float(value) * tokens
        self.weights[name] = self.weights.get(name, 0.0) + tokens

    def add(self, name: str, value: Tensor | float, into: str = "sums") -> None:
        table = self.sums if into == "sums" else self.same
        table[name] = table.get(name, 0.0) + float(value)


def merge_update_stats(per_rank: Sequence[UpdateStats]) -> dict[str, float]:
    """One set of step metrics from every rank's UpdateStats."""
    merged: dict[str, float] = {}
    first = per_rank[0]
    for name in first.weighted:
        total = sum(stats.weighted[name] for stats in per_rank)
        weight = sum(stats.weights[name] for stats in per_rank)
        merged[name] = total / max(weight, 1.0)
    updates = max(first.updates, 1)
    for name in first.sums:
        merged[name] = sum(stats.sums[name] for stats in per_rank) / updates
    for name, value in first.same.items():
        merged[name] = value / updates
    for name in first.maxima:
        merged[name] = max(stats.maxima.get(name, float("-inf")) for stats in per_rank)
    return merged


# Metrics of the passes (forward + backward) of the update: the share of the positions
# computed that were padding, and real (prompt + response) tokens per second of the passes
# (their mean weighted by tokens, over ranks).
PADDING_FRACTION = "perf/padding_fraction"
PASS_TOKENS_PER_S = "perf/pass_tokens_per_s"


# The checkpoint part that records LoRA adapters' base and config (lora.adapter_record);
# checkpoint/training.py lists it among the learner's parts under the same name.
LORA_PART = "lora"
# The checkpoint's name for each model's optimiser state.
OPTIMIZER_OF = {"policy": "optimizer", "critic": "critic_optimizer"}


def _state_dict_options(strict: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # A checkpoint holds what trains: a LoRA run's adapters, not its frozen base.
    return StateDictOptions(ignore_frozen_params=True, strict=strict)


class Learner:
    """Policy (+ optimiser, schedule), reference (KL), critic (PPO) of one rank."""

    def __init__(
        self,
        settings: TrainerSettings,
        policy_path: str,
        critic_path: str | None,
        device: torch.device,
        *,
        rank: int = 0,
        world_size: int = 1,
        strategy: sharding.Strategy | None = None,
        ahead: bool | None = None,
    ):
        self.settings = settings
        self.policy_path, self.critic_path = policy_path, critic_path
        self.device = device
        self.rank = rank
        self.world_size = world_size
        self.dtype = compute_dtype(settings.model.dtype, device)
        self.temperature = settings.rollout.temperature
        # Decided once for the run (rlx.plan.strategy.choose_strategy) and handed in; a
        # Learner built on its own reads the recipe's explicit setting.
        self.strategy = strategy or sharding.resolve_strategy(settings.parallel, world_size)
        # Whether samples may be older than the policy (TrainJob.ahead), likewise.
        self.ahead = runs_ahead(settings) if ahead is None else ahead
        trained_shard, frozen_shard = self._shard_specs()
        self._load_policy(trained_shard)
        self._load_reference(frozen_shard)
        self._load_critic(trained_shard)
        self.policy_scorer = ResponseScorer(self.policy, agree=self.collective)
        self.policy_ddp = self._data_parallel(self.policy_scorer)
        self.critic_ddp = self._data_parallel(self.critic) if self.critic is not None else None
        self.kl_estimator = algos.get_kl_estimator(settings.algo.kl.estimator)
        self.policy.eval()  # generation (colocated) and probes see eval mode; update() flips
        self.planner = self._plan_passes()
        self._notes: list[str] = []

    def _shard_specs(self) -> tuple[sharding.ShardSpec | None, sharding.ShardSpec | None]:
        """How FSDP shards the trained models and the frozen reference; None, None under
        any other strategy."""
        if self.strategy != "fsdp":
            return None, None
        parallel = self.settings.parallel
        mesh = sharding.make_mesh(self.device)
        mixed = self.dtype if self.dtype != torch.float32 else None
        trained = sharding.ShardSpec(
            mesh,
            self.device,
            param_dtype=mixed,
            offload=parallel.offload_optimizer,
            reshard_after_forward=parallel.reshard_after_forward,
        )
        # The frozen reference is stored in the compute dtype already.
        frozen = sharding.ShardSpec(
            mesh,
            self.device,
            offload=parallel.offload_reference,
            reshard_after_forward=parallel.reshard_after_forward,
        )
        return trained, frozen

    def _load_policy(self, shard: sharding.ShardSpec | None) -> None:
        settings = self.settings
        self.policy = load_causal_lm(
            settings.model,
            self.policy_path,
            self.device,
            trainable=True,
            shard=shard,
            seed=settings.seed,
        )
        self.optimizer, self.scheduler = make_optimizer(
            self.policy, settings.optim, settings.optim.lr, settings.steps
        )

    def _load_reference(self, shard: sharding.ShardSpec | None) -> None:
        """The reference model and its scorer, where the KL penalty is on."""
        settings = self.settings
        self.reference = self.reference_scorer = None
        if settings.algo.kl.coef > 0 and settings.model.lora is not None:
            # The base the adapters start from is the reference: no second copy of it.
            self.reference_scorer = ResponseScorer(
                self.policy, agree=self.collective, adapter_off=True
            )
        elif settings.algo.kl.coef > 0:
            self.reference = load_causal_lm(
                settings.model, self.policy_path, self.device, trainable=False, shard=shard
            )
            self.reference_scorer = ResponseScorer(self.reference, agree=self.collective)

    def _load_critic(self, shard: sharding.ShardSpec | None) -> None:
        """The critic, its optimiser and schedule (PPO)."""
        settings = self.settings
        self.critic = self.critic_optimizer = self.critic_scheduler = None
        if settings.algorithm != "ppo":
            return
        if self.critic_path is None:
            raise ValueError("ppo needs a critic model path")
        critic_settings = settings.critic_model or settings.model
        self.critic = load_value_model(
            critic_settings, self.critic_path, self.device, shard=shard, seed=settings.seed
        )
        self.critic_optimizer, self.critic_scheduler = make_optimizer(
            self.critic, settings.optim, settings.optim.critic_lr, settings.steps
        )

    def _plan_passes(self) -> PassPlanner:
        """The run's pass planner; where its packed rows attend by segments, every model is
        switched to segment attention."""
        planner = PassPlanner(
            self.settings,
            self.policy,
            self.reference,
            self.critic,
            device=self.device,
            dtype=self.dtype,
            across_ranks=self.world_size > 1 and self.strategy != "single",
        )
        if planner.by_segments:
            for model in (self.policy, self.reference, self.critic):
                if model is not None:
                    use_segment_attention(model)
        return planner

    # What the worker reports at start-up (actors/workers.py): the planner's decision.
    def _all_ranks(self, flag: bool) -> bool:
        return sharding.all_ranks(flag, self.device)

    @property
    def collective(self) -> Callable[[bool], bool] | None:
        """For code that runs the policy's forward outside the Learner (a colocated HF
        engine): the AND over ranks when every forward is a collective (FSDP), else None."""
        return self._all_ranks if self.strategy == "fsdp" else None

    @property
    def loss_scale(self) -> int:
        """What each rank's loss is multiplied by so that the reduced gradient is the sum of
        the ranks' gradients: DDP averages (x world size); FSDP2 here sums (x 1)."""
        return self.world_size if self.strategy == "ddp" else 1

    def _data_parallel(self, module: nn.Module) -> nn.Module:
        if self.strategy != "ddp":
            return module
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=device_ids)

    # ------------------------------------------------------------------ forwards

    def _scores(
        self,
        scorer: nn.Module,
        mb: SequenceBatch,
        *,
        entropy_grad: bool,
        packed: pack.PackedRows | None = None,
    ) -> TokenScores:
        """Log-probs and entropies of the response tokens, (b, r) each, at the sampling
        temperature: the distribution the rollout engine drew from. scorer: a
        ResponseScorer, or DDP over one; packed: the micro-batch's sequences as packed rows."""
        with autocast(self.device, self.dtype):
            return score_responses(
                scorer, mb, self.temperature, entropy_grad=entropy_grad, packed=packed
            )

    def _values(
        self, critic: nn.Module, mb: SequenceBatch, packed: pack.PackedRows | None = None
    ) -> Tensor:
        with autocast(self.device, self.dtype):
            return response_values(critic, mb, packed).float()  # (b, r)

    def _per_token(
        self,
        batch: SequenceBatch,
        fn: Callable[[SequenceBatch, pack.PackedRows | None], Tensor],
    ) -> Tensor:
        """fn over the passes, reassembled as one (B, R) tensor."""
        out = torch.zeros(batch.response_mask.shape, dtype=torch.float32)  # (B, R)
        for one in self.planner.passes(batch):
            mb, packed = self.planner.pass_inputs(batch, one)
            values = fn(mb, packed).float().cpu()  # (b, r)
            if one.counts:
                out[one.rows, : values.shape[1]] = values
        return torch.where(batch.response_mask, out, 0.0)

    # ------------------------------------------------------------------ packing check

    def check_packing(self, batch: SequenceBatch) -> None:
        """Once, on the first batch, where the passes are packed: two of its sequences packed
        in one row must score as each does alone (policy log-probs, and the critic's values),
        within rounding; if not, this run trains on padded micro-batches, with one line
        saying so (PassPlanner.check)."""
        if not self.planner.needs_check:
            return
        self._set_train(False)  # no dropout: the same numbers twice
        measures: list[Measure] = [
            (
                "log-probs",
                lambda mb, rows: (
                    self._scores(self.policy_scorer, mb, entropy_grad=False, packed=rows).logprobs
                ),
            )
        ]
        if self.critic is not None:
            critic = self.critic
            measures.append(("values", lambda mb, rows: self._values(critic, mb, rows)))
        note = self.planner.check(batch, measures, self.no_grad)
        if note is not None:
            self._notes.append(note)

    def take_notes(self) -> list[str]:
        notes, self._notes = self._notes, []
        return notes

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.optimizer, self.critic_optimizer) if o is not None]

    def move_optimizer_state(self, device: torch.device | str) -> int:
        """Move the optimisers' state tensors (AdamW's moments) to `device`: to the host
        while a colocated engine generates on the GPU, back before the update. Returns the
        bytes moved. A no-op on CPU and where FSDP already keeps the state on the host."""
        device = torch.device(device)
        moved = 0
        for optimizer in self._optimizers():
            for state in optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.device != device:
                        # step counters stay where the optimiser keeps them (a host scalar)
                        if value.dim() == 0 and key == "step":
                            continue
                        state[key] = value.to(device, non_blocking=True)
                        moved += value.numel() * value.element_size()
        if moved and device.type == "cpu" and torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies have landed before their memory is freed
        return moved

    @contextlib.contextmanager
    def no_grad(self) -> Iterator[None]:
        """inference_mode, or no_grad under FSDP: FSDP2 gathers weights into buffers it keeps,
        and a buffer first made in inference mode can never be written in training. On the
        way out the sharded roots are resharded: FSDP2 keeps a root's weights gathered after
        a forward (for the backward that follows in training), and while gathered the module
        shows the gathered tensors, not its shards, to parameters() and state_dict()."""
        if self.strategy != "fsdp":
            with torch.inference_mode():
                yield
            return
        try:
            with torch.no_grad():
                yield
        finally:
            for module in (self.policy, self.reference, self.critic):
                if module is not None:
                    sharding.reshard(module)

    def prepare(self, batch: SequenceBatch, *, old_logprobs: bool) -> dict[str, Tensor]:
        self.check_packing(batch)
        with self.no_grad():
            return self._prepare(batch, old_logprobs=old_logprobs)

    def _prepare(self, batch: SequenceBatch, *, old_logprobs: bool) -> dict[str, Tensor]:
        """What the advantages and the update need besides the samples, each (B, R): reference
        log-probs (KL on), critic values (PPO), old log-probs (when needs_old_logprobs)."""
        out: dict[str, Tensor] = {}
        if self.reference_scorer is not None:
            reference = self.reference_scorer
            out[REF_LOGP] = self._per_token(
                batch,
                lambda mb, packed: (
                    self._scores(reference, mb, entropy_grad=False, packed=packed).logprobs
                ),
            )
        if self.critic is not None:
            critic = self.critic
            out[VALUES] = self._per_token(
                batch, lambda mb, packed: self._values(critic, mb, packed)
            )
        if old_logprobs:
            policy = self.policy_scorer
            out[OLD_LOGP] = self._per_token(
                batch,
                lambda mb, packed: (
                    self._scores(policy, mb, entropy_grad=False, packed=packed).logprobs
                ),
            )
        return out

    def probe(self, prompt_ids: list[int], response_ids: list[int]) -> float:
        """The policy's log-prob of a fixed sequence. A collective forward under FSDP: every
        rank calls it."""
        with self.no_grad():
            return sequence_logprob(self.policy, prompt_ids, response_ids)

    # ------------------------------------------------------------------ the update

    def update(self, batch: SequenceBatch, step: int) -> UpdateStats:
        """ppo_epochs x minibatches of optimiser steps over this rank's samples."""
        settings = self.settings
        samples = settings.batch.prompts_per_step * settings.rollout.n
        per_rank = (settings.batch.minibatch_size or samples) // self.world_size
        self.check_packing(batch)
        stats = UpdateStats()
        self._set_train(True)
        try:
            for epoch in range(settings.batch.ppo_epochs):
                order = self._order(len(batch), step, epoch)
                for start in range(0, len(batch), per_rank):
                    self._update_minibatch(batch.select(order[start : start + per_rank]), stats)
            self.scheduler.step()
            if self.critic_scheduler is not None:
                self.critic_scheduler.step()
        finally:
            self._set_train(False)
        stats.mean("lr", self.scheduler.get_last_lr()[0], 1)
        stats.notes.extend(self.take_notes())
        return stats

    def _set_train(self, mode: bool) -> None:
        self.policy.train(mode)
        if self.critic is not None:
            self.critic.train(mode)

    def _order(self, count: int, step: int, epoch: int) -> Tensor:
        """The order samples are visited in: shuffled (from the seed, step, epoch and rank,
        so a resumed run repeats it) when there is more than one minibatch."""
        if minibatches_per_epoch(self.settings) == 1:
            return torch.arange(count)
        seed = derive_seed(self.settings.seed, "minibatches", step, epoch, self.rank)
        generator = torch.Generator().manual_seed(seed)
        return torch.randperm(count, generator=generator)

    def _global_counts(self, mask: Tensor) -> tuple[Tensor, Tensor]:
        tokens, seqs = algos.loss_denominators(mask)
        if self.world_size > 1:
            counts = torch.stack([tokens, seqs]).to(self.device)
            dist.all_reduce(counts)
            tokens, seqs = counts.cpu().unbind()
        return tokens, seqs

    def _update_minibatch(self, minibatch: SequenceBatch, stats: UpdateStats) -> None:
        tokens, seqs = self._global_counts(minibatch.response_mask)
        passes = self.planner.passes(minibatch)
        for index, one in enumerate(passes):
            started = time.perf_counter()
            mb, packed = self.planner.pass_inputs(minibatch, one)
            sync = index == len(passes) - 1  # DDP all-reduces once, after the last backward
            with self._maybe_no_sync(self.policy_ddp, sync):
                self._policy_backward(mb, tokens, seqs, stats, one.counts, packed)
            if self.critic_ddp is not None:
                with self._maybe_no_sync(self.critic_ddp, sync):
                    self._critic_backward(mb, tokens, seqs, stats, one.counts, packed)
            if one.counts:
                if packed is not None:
                    computed, real = packed.positions, packed.real_tokens
                else:
                    computed, real = self.planner.padded_cost(mb)
                stats.mean(PADDING_FRACTION, 1.0 - real / max(computed, 1), computed)
                seen = mb.num_tokens  # the sequences' own, however the pass ran them
                stats.mean(PASS_TOKENS_PER_S, seen / (time.perf_counter() - started), seen)
        clip = self.settings.optim.grad_clip
        norm = sharding.clip_grad_norm(list(self.policy.parameters()), clip)
        stats.add("grad_norm", norm, "same")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.critic is not None and self.critic_optimizer is not None:
            norm = sharding.clip_grad_norm(list(self.critic.parameters()), clip)
            stats.add("critic/grad_norm", norm, "same")
            self.critic_optimizer.step()
            self.critic_optimizer.zero_grad(set_to_none=True)
        stats.updates += 1

    @staticmethod
    @contextlib.contextmanager
    def _maybe_no_sync(module: nn.Module, sync: bool) -> Iterator[None]:
        if sync or not hasattr(module, "no_sync"):
            yield
        else:
            with module.no_sync():
                yield

    def _aggregate(self, per_token: Tensor, mask: Tensor, tokens: Tensor, seqs: Tensor) -> Tensor:
        return algos.aggregate_loss(
            per_token,
            mask,
            self.settings.algo.loss_agg,
            num_global_tokens=tokens,
            num_global_seqs=seqs,
            token_budget=episode_token_budget(self.settings),
        )

    def policy_loss(
        self,
        mb: SequenceBatch,
        tokens: Tensor,
        seqs: Tensor,
        packed: pack.PackedRows | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The policy's loss on a micro-batch already on the device: clipped surrogate, plus
        kl.coef x KL to the reference (kl mode "loss"), minus entropy_coef x entropy, each
        aggregated over the minibatch's global counts (tokens, seqs). Returns it (to be
        minimised; with a graph when gradients are on) and its detached pieces: loss/policy,
        loss/kl, per-token means kl and entropy, and the policy loss's metrics (algo.policy_loss:
        PPO's clipped surrogate, GSPO or CISPO)."""
        algo = self.settings.algo
        mask = mb.response_mask
        scores = self._scores(
            self.policy_ddp, mb, entropy_grad=algo.entropy_coef > 0, packed=packed
        )
        logp, entropy = scores.logprobs, scores.entropy  # (b, r) each
        # Without an old forward the update's own log-probs, detached, are exactly pi_old
        # (needs_old_logprobs): the policy has not moved before this pass.
        old_logp = mb.fields[OLD_LOGP] if OLD_LOGP in mb.fields else logp.detach()
        weight, weight_metrics = None, {}
        if BEHAV_LOGP in mb.fields:
            weight, weight_metrics = self._engine_weights(old_logp, mb.fields[BEHAV_LOGP], mask)
        pg_per_token, pieces = algos.get_policy_loss(algo.policy_loss)(
            logp,
            old_logp,
            mb.fields[ADVANTAGES],
            mask,
            clip_eps_low=algo.clip_eps,
            clip_eps_high=algo.clip_eps_high,
            dual_clip_c=algo.dual_clip,
            behavior_weight=weight,
        )
        pieces.update(weight_metrics)
        pg_loss = self._aggregate(pg_per_token, mask, tokens, seqs)
        pieces["loss/policy"] = pg_loss.detach()
        loss = pg_loss
        if algo.kl.coef > 0 and algo.kl.mode == "loss":
            kl_per_token = torch.where(mask, self.kl_estimator(logp, mb.fields[REF_LOGP]), 0.0)
            kl_loss = self._aggregate(kl_per_token, mask, tokens, seqs)
            loss = loss + algo.kl.coef * kl_loss
            pieces["loss/kl"] = kl_loss.detach()
            pieces["kl"] = algos.masked_mean(kl_per_token.detach(), mask)
        if algo.entropy_coef > 0:
            loss = loss - algo.entropy_coef * self._aggregate(entropy, mask, tokens, seqs)
        pieces["entropy"] = algos.masked_mean(entropy.detach(), mask)
        return loss, pieces

    def _engine_weights(
        self, old_logp: Tensor, engine_logp: Tensor, mask: Tensor
    ) -> tuple[Tensor | None, dict[str, Tensor | float]]:
        """The mismatch between the engines' log-probs (mu) and pi_old on this micro-batch's
        sampled tokens (mismatch/kl, log_ppl_diff, max_abs_logprob_diff), and with
        algo.rollout_correction on the one weight pi_old / mu of every token: with stale
        samples it is decoupled PPO's (pi_old is then the proximal policy), whose figures keep
        their offpolicy/ names too."""
        settings = self.settings
        metrics: dict[str, Tensor | float] = {}
        if bool(mask.any()):  # NaN where nothing was measured: leave the step's figure alone
            measured = mismatch_metrics(engine_logp, old_logp, mask)
            metrics.update({k: v for k, v in measured.items() if k in MISMATCH_LOGGED})
        if not correction_on(settings):
            return None, metrics
        correction = settings.algo.rollout_correction
        low, high = correction_bounds(settings.algo)
        weight, weight_metrics = algos.rollout_correction_weights(
            old_logp,
            engine_logp,
            mask,
            level=correction.level,
            action=correction.action,
            low=low,
            high=high,
        )
        if not metrics:  # no token measured: no weight to report either (not a mean of 0)
            return weight, metrics
        metrics.update(weight_metrics)
        if self.ahead:
            # The share the action changed (truncated_fraction or masked_fraction).
            changed = next(v for k, v in weight_metrics.items() if k.endswith("_fraction"))
            metrics[IS_WEIGHT] = weight_metrics["mismatch/weight_mean"]
            metrics["offpolicy/weight_sq_mean"] = weight_metrics["mismatch/weight_sq_mean"]
            metrics[IS_TRUNCATED] = changed
        return weight, metrics

    def _policy_backward(
        self,
        mb: SequenceBatch,
        tokens: Tensor,
        seqs: Tensor,
        stats: UpdateStats,
        counts: bool,
        packed: pack.PackedRows | None,
    ) -> None:
        loss, pieces = self.policy_loss(mb, tokens, seqs, packed)
        (loss * (self.loss_scale if counts else 0.0)).backward()
        if not counts:
            return
        count = int(mb.response_mask.sum())
        for name, value in pieces.items():
            if name.startswith("loss/"):  # already divided by the global counts: summed
                stats.add(name, value)
            elif name.startswith("mismatch/max_"):
                stats.max(name, value)
            else:
                stats.mean(name, value, count)

    def _critic_backward(
        self,
        mb: SequenceBatch,
        tokens: Tensor,
        seqs: Tensor,
        stats: UpdateStats,
        counts: bool,
        packed: pack.PackedRows | None,
    ) -> None:
        assert self.critic_ddp is not None
        algo = self.settings.algo
        mask = mb.response_mask
        values = self._values(self.critic_ddp, mb, packed)  # (b, r)
        vf_per_token, vf_metrics = algos.clipped_value_loss(
            values, mb.fields[VALUES], mb.fields[RETURNS], mask, clip_eps=algo.value_clip
        )
        vf_loss = self._aggregate(vf_per_token, mask, tokens, seqs)
        (algo.vf_coef * vf_loss * (self.loss_scale if counts else 0.0)).backward()
        if not counts:
            return
        stats.add("loss/value", vf_loss.detach())
        stats.mean("vf_clipfrac", vf_metrics["vf_clipfrac"], int(mask.sum()))

    # ------------------------------------------------------------------ checkpoints

    def _stateful(self) -> list[tuple[str, nn.Module, torch.optim.Optimizer]]:
        pairs = [("policy", self.policy, self.optimizer)]
        if self.critic is not None:
            assert self.critic_optimizer is not None
            pairs.append(("critic", self.critic, self.critic_optimizer))
        return pairs

    def sharded_state(self) -> dict[str, Any]:
        """The large state as DCP saves and loads it: {"policy", "optimizer"[, "critic",
        "critic_optimizer"]}, keyed by parameter names (optimiser state too), each tensor
        this rank's part (whole for plain and DDP modules, a DTensor shard under FSDP)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        state: dict[str, Any] = {}
        for name, module, optimizer in self._stateful():
            weights, state[OPTIMIZER_OF[name]] = get_state_dict(
                module, optimizer, options=_state_dict_options(strict=True)
            )
            # A frozen weight tied to another (a LoRA base's output head) slips through.
            frozen = {
                n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad
            }
            state[name] = {key: value for key, value in weights.items() if key not in frozen}
        return state

    def load_sharded_state(self, state: dict[str, Any]) -> None:
        """Put back what sharded_state gave (filled from a checkpoint)."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        for name, module, optimizer in self._stateful():
            key = OPTIMIZER_OF[name]
            if name not in state or key not in state:
                raise ValueError(f"the checkpoint has no {name} (not a PPO run?)")
            result = set_state_dict(
                module,
                optimizer,
                model_state_dict=state[name],
                optim_state_dict=state[key],
                options=_state_dict_options(strict=False),
            )
            # Frozen weights (a LoRA base) are not in checkpoints; everything trained must be.
            trained = {n for n, p in module.named_parameters() if p.requires_grad}
            missing = trained & set(getattr(result, "missing_keys", ()))
            if missing:
                raise RlxError(
                    f"the checkpoint's {name} lacks {sorted(missing)[0]} (and "
                    f"{len(missing) - 1} more): it was saved by a run with another "
                    "trainer.model.lora; set RLX_RUN_ID to start a new run"
                )

    def _adapted(self) -> list[tuple[str, nn.Module, str, str]]:
        """(name, model, base as the recipe names it, its folder) of each model with LoRA."""
        settings = self.settings
        out = []
        if settings.model.lora is not None:
            out.append(("policy", self.policy, settings.model.path, self.policy_path))
        critic = settings.critic_model or settings.model
        if self.critic is not None and critic.lora is not None and self.critic_path is not None:
            out.append(("critic", self.critic.body, critic.path, self.critic_path))
        return out

    def state_parts(self) -> dict[str, Any]:
        """The small state, identical on every rank: the schedules and, with LoRA, what the
        adapters were trained on and peft's config of them."""
        parts: dict[str, Any] = {"scheduler": self.scheduler.state_dict()}
        if self.critic_scheduler is not None:
            parts["critic_scheduler"] = self.critic_scheduler.state_dict()
        adapted = self._adapted()
        if adapted:
            parts[LORA_PART] = {
                name: lora.adapter_record(model, base, folder)
                for name, model, base, folder in adapted
            }
        return parts

    def load_parts(self, parts: dict[str, Any]) -> None:
        records = parts.get(LORA_PART) or {}
        for name, _, base, folder in self._adapted():
            if name not in records:
                raise RlxError(
                    f"the checkpoint holds no {name} adapters (a run without "
                    "trainer.model.lora?); set RLX_RUN_ID to start a new run"
                )
            lora.check_base(records[name], base, folder, name)
        self.scheduler.load_state_dict(parts["scheduler"])
        if self.critic_scheduler is not None:
            if "critic_scheduler" not in parts:
                raise ValueError("the checkpoint has no critic_scheduler (not a PPO run?)")
            self.critic_scheduler.load_state_dict(parts["critic_scheduler"])
