"""The training loop: a single controller on the head node drives the actors step by step.

One step:
    sample prompts -> generate n responses each -> score them -> reference log-probs, critic
    values, old log-probs (only those the settings need) -> advantages -> ppo_epochs x
    minibatches of clipped policy (+ value, + KL, + entropy) updates -> push the weights to
    the rollout engines and prove they arrived -> metrics -> checkpoint every k steps.
"""

from __future__ import annotations

import os
import shlex
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO

import torch

from rlx.checkpoints import step_of
from rlx.errors import RlxError, first_line
from rlx.recipe.model import TrainerSettings
from rlx.runs import (
    CHECKPOINT_RETRIES,
    HOST_MEMORY,
    IS_WEIGHT,
    IS_WEIGHT_STD,
    RESPONSE_LENGTH,
    REWARD_MEAN,
    REWARD_STD,
    SAMPLES_FILE,
    STEP_TIME,
    TOKENS_PER_S,
    RunPaths,
    mirror_run,
)
from rlx.trainer import algos
from rlx.trainer.actors.cluster import Cluster, StepUpdate
from rlx.trainer.batch import (
    ADVANTAGES,
    BEHAV_LOGP,
    OLD_LOGP,
    REF_LOGP,
    RETURNS,
    VALUES,
    SequenceBatch,
    outcome_token_rewards,
    pack_rollout,
)
from rlx.trainer.checkpoint import (
    capture_rng_state,
    location_name,
    manager_for,
    open_manager,
    resolve_resume,
    restore_rng_state,
)
from rlx.trainer.checkpoint.best import Best, consider, restored
from rlx.trainer.checkpoint.faults import SaveFailed, failure_line, save_failure
from rlx.trainer.checkpoint.protocol import Location, SavedCheckpoint, SaveRequest
from rlx.trainer.checkpoint.resume import chosen_commits, moved_data
from rlx.trainer.checkpoint.training import (
    CONTROLLER_RNG,
    KILL_HOOK_ENV,
    LEARNER_STATE,
    TRAINER_STATE,
    kill_after_step,
)
from rlx.trainer.episodes.runner import EpisodeRunner, episode_metrics
from rlx.trainer.episodes.trajectory import check_trajectories
from rlx.trainer.filtering import BACKFILL_SEED_OFFSET, Round, group_spread, pick_groups
from rlx.trainer.inflight import RolloutQueue, check_staleness, staleness_metrics
from rlx.trainer.job import TrainJob
from rlx.trainer.learn.learner import needs_old_logprobs, sends_engine_logprobs
from rlx.trainer.report.console import StopRequest
from rlx.trainer.report.metrics import MetricsLogger, StepRecords
from rlx.trainer.report.progress import Progress
from rlx.trainer.rollout.base import SamplingArgs
from rlx.trainer.rollout.probe import Probe
from rlx.trainer.stall import (
    LEARNER_IDLE,
    SAVE_AT_STALL_S,
    StallClock,
    Stalled,
    bounded_call,
)
from rlx.trainer.tasks import validation
from rlx.trainer.tasks.data import PromptDataset, PromptSampler
from rlx.trainer.tasks.reward_terms import (
    RewardInputs,
    RewardTerms,
    TermScores,
    combine,
    term_metrics,
)

GIB = 2**30


def estimator_name(algorithm: str, norm_by_std: bool, baseline: str = "batch") -> str:
    if algorithm == "ppo":
        return "gae"
    if algorithm == "grpo":
        return "grpo" if norm_by_std else "grpo-no-std"
    if algorithm == "reinforce_pp":
        return "reinforce_pp-baseline" if baseline == "group" else "reinforce_pp"
    return algorithm


def prepared_forwards(settings: TrainerSettings, old_logprobs: bool) -> tuple[bool, bool]:
    """(whether a step runs the forwards the update reads: old, reference log-probs, critic
    values; whether they run before the advantages, in a call of their own).

    The advantages read the critic's values (PPO) and, with the KL in the reward, the old and
    reference log-probs: then the forwards run before them, a call of their own. Otherwise
    only the update reads them and the ranks run them in the update call."""
    kl = settings.algo.kl
    needs_prepare = old_logprobs or kl.coef > 0 or settings.algorithm == "ppo"
    prepare_first = settings.algorithm == "ppo" or (kl.coef > 0 and kl.mode == "reward")
    return needs_prepare, prepare_first


@dataclass
class RunInputs:
    """Everything the controller resolved before the actors started."""

    job: TrainJob
    paths: RunPaths
    tokenizer: Any
    data: PromptDataset
    rewards: RewardTerms | None  # None: the environment gives the reward
    probe: Probe
    env: dict[str, str]
    validation: PromptDataset | None = None  # held-out prompts (trainer.validation)
    validation_overlap: int = 0  # held-out prompts dropped as also in the training data
    environment: Callable[[], Any] | None = None  # the episodes' environment class, if any


class Trainer:
    def __init__(
        self,
        inputs: RunInputs,
        cluster: Cluster,
        *,
        out: TextIO,
        err: TextIO,
        memory_of: Callable[[], int],
        stop: StopRequest | None = None,
    ):
        self.inputs = inputs
        self.job = inputs.job
        self.settings = inputs.job.settings
        self.cluster = cluster
        self.out = out
        self.err = err
        self.memory_of = memory_of
        self.stop = stop or StopRequest()
        settings = self.settings
        self.sampler = PromptSampler(
            len(inputs.data), settings.batch.prompts_per_step, settings.seed, settings.data.shuffle
        )
        self.max_staleness = settings.rollout.max_staleness
        # Dynamic sampling's later rounds draw here, in step order (filtering.py).
        self.backfill: PromptSampler | None = None
        if settings.batch.filter_groups is not None:
            self.backfill = PromptSampler(
                len(inputs.data),
                settings.batch.prompts_per_step,
                settings.seed + BACKFILL_SEED_OFFSET,
                settings.data.shuffle,
            )
        self.episodes: EpisodeRunner | None = None
        if inputs.environment is not None:  # multi-turn episodes (episodes/runner.py)
            self.episodes = EpisodeRunner(
                settings, inputs.environment, inputs.tokenizer, inputs.data, self.say
            )
        # Rollouts of the steps ahead, started in step order (inflight.py): at
        # max_staleness 0 each step's rollout starts after the previous update's push.
        self.queue = RolloutQueue(
            self.sampler, self.submit_rollout, self.max_staleness, settings.steps
        )
        self.samples: StepRecords | None = None  # the prompts and versions each step trained
        self.estimator = algos.get_advantage_estimator(
            estimator_name(
                settings.algorithm, settings.algo.norm_adv_by_std, settings.algo.baseline
            )
        )
        self.old_logprobs = needs_old_logprobs(settings, self.job.ahead)
        self.engine_logprobs = sends_engine_logprobs(settings, self.job.ahead)
        self.needs_prepare, self.prepare_first = prepared_forwards(settings, self.old_logprobs)
        ckpt = inputs.paths.checkpoint_root
        self.manager = (
            None
            if ckpt is None
            else open_manager(ckpt, inputs.paths.run_id, settings.checkpoint.keep)
        )
        self.logger: MetricsLogger | None = None
        self.checkpoint_bytes: int | None = None  # size on disk of the last save
        self.uploading: tuple[int, Path] | None = None  # a save's step and folder, uploading
        self.newest_saved: int | None = None  # the newest complete checkpoint's step
        self.saves_retried = 0  # transient store errors the ranks retried in saves
        # checkpoint.best (checkpoint/best.py): the best complete step, and the best that
        # the save under way (its step) makes once it is complete.
        self.best: Best | None = None
        self.best_pending: tuple[int, Best | None] | None = None
        self.validated: tuple[int, dict[str, float]] | None = None  # the newest val/* metrics
        self.exported: Path | None = None  # the Hugging Face folder written at the end
        # The stall watchdog (stall.py): every wait of a step ends with its window.
        self.clock = StallClock(settings.stall_timeout)
        cluster.clock = self.clock

    def say(self, message: str) -> None:
        print(message, file=self.out, flush=True)

    def submit_rollout(self, rows: list[int], step: int) -> Any:
        """Start step `step`'s rollout of these prompt rows: one generate call, or the first
        turn of the step's episodes (the later turns are played when it is collected, or at
        max_staleness > 0 from now on, beside the updates)."""
        cluster = self.cluster
        if self.episodes is None:
            prompt_ids = [self.inputs.data.prompt_token_ids[i] for i in rows]
            return cluster.submit_generate(prompt_ids, step)

        def submit(prompt_ids: list[list[int]], sampling: SamplingArgs, stream: str) -> Any:
            return cluster.submit_generate(prompt_ids, step, sampling, stream)

        return self.episodes.start(rows, step, submit, cluster.sampling, ahead=self.job.ahead)

    # ------------------------------------------------------------------ the run

    def run(self) -> int:
        """Resume if there is something to resume, then train to the last step. Returns the
        last step done. A step that stalls (stall.py) raises Stalled, exit 75, with the
        step a retry resumes from."""
        try:
            return self._run()
        except Stalled as stall:
            self.save_at_stall(stall)
            raise stall.with_line(self.newest_saved, self.manager is not None) from None

    def save_at_stall(self, stall: Stalled) -> None:
        """Save the last finished step where the learner still answers (stall.py) and no
        checkpoint holds it yet; a save that fails or stalls too is said and left."""
        done = stall.step - 1  # the step whose update the training ranks hold
        if self.manager is None or done < 1 or (self.newest_saved or 0) >= done:
            return
        if stall.phase not in LEARNER_IDLE or (
            stall.phase == "generation" and self.settings.layout != "split"
        ):
            return  # the engines are in the training ranks' processes: they may not answer
        self.clock.reopen(min(self.clock.window, SAVE_AT_STALL_S))
        try:
            with self.clock.phase_of("save at the stall"):
                self._save(done)
                self.finish_saves()
        except Exception as exc:  # stalled too, failed, a rank gone: the older checkpoints stay
            first = first_line(exc)
            self.say(f"the save of step {done} at the stall did not finish: {first}")
            return
        if self.newest_saved == done:
            self.say(f"step {done} saved at the stall (the training ranks still answered)")

    def _run(self) -> int:
        settings = self.settings
        self.clock = StallClock(settings.stall_timeout)  # the first window opens now
        self.cluster.clock = self.clock
        with self.clock.phase_of("resume"):
            start = self.resume()
        self.clock.step = start + 1
        self.clock.phase = "head's own work"  # between the phases below
        self.cluster_report()
        self.logger = MetricsLogger(
            self.inputs.paths.run_dir,
            tensorboard=settings.logging.tensorboard,
            wandb_project=settings.logging.wandb_project,
            run_name=self.inputs.paths.run_id,
            config=self.inputs.job.recipe.model_dump(mode="json"),
            console_every=settings.logging.every,
            start_step=start + 1,
            env=self.inputs.env,
            stream=self.out,
        )
        self.samples = StepRecords(self.inputs.paths.run_dir / SAMPLES_FILE, start + 1)
        self.data_note()
        try:
            if start == 0 and validation.due(settings, 0):
                with self.clock.phase_of("validation"):
                    self.logger.log(0, self.validate(0))
            with Progress(max(settings.steps - start, 0), "steps", stream=self.err) as bar:
                for step in range(start + 1, settings.steps + 1):
                    done = step - 1  # steps done; the cadence saved multiples of `every`
                    if (
                        self.stop.checkpoint_first
                        and self.manager is not None
                        and done > start
                        and done % settings.checkpoint.every
                    ):
                        self.save(done)
                    if self.stop.checkpoint_first and self.stop.received is not None:
                        self.finish_saves()
                        self.stopping_note(done)
                        self.stop.leave_soon()  # bounds Ray's teardown (a GCS may be gone)
                    self.stop.check_between_steps()
                    metrics = self.step(step)
                    if validation.due(settings, step):
                        with self.clock.phase_of("validation"):
                            metrics.update(self.validate(step))
                    if self.manager is not None:
                        metrics[CHECKPOINT_RETRIES] = float(self.store_retries())
                    self.logger.log(step, metrics)
                    bar.update()
                    if self.manager is not None and (
                        step % settings.checkpoint.every == 0 or step == settings.steps
                    ):
                        self.save(step)
                    kill_after_step(os.environ.get(KILL_HOOK_ENV), step)
                    self.clock.step_done(step)
            with self.clock.phase_of("weight push"):
                self.cluster.finish_pushes()  # the last push proven, like every other
            with self.clock.phase_of("save"):
                self.finish_saves(final=True)
        finally:
            self.logger.close()
            self.samples.close()
            if self.episodes is not None:
                self.episodes.close()
        self.exported = self.export()
        return max(start, settings.steps)

    def stopping_note(self, done: int) -> None:
        """What a stop that saves first leaves: the step a retry resumes from, and how long
        after the signal it was durable (the figure to hold against the platform's grace)."""
        name = signal.Signals(self.stop.signum or signal.SIGTERM).name
        seconds = time.monotonic() - (self.stop.received or time.monotonic())
        if self.manager is None:
            self.say(f"stopping on {name}: no checkpoint.dir, so a retry starts at step 0")
            return
        self.say(
            f"stopping on {name}: step {done} is in {self.manager.run_dir}, {seconds:.1f} s "
            "after the signal; exit 75 so the job is retried and resumes there"
        )

    def validate(self, step: int) -> dict[str, float]:
        inputs = self.inputs
        assert inputs.validation is not None
        started = time.perf_counter()
        scores = validation.validate(
            self.cluster,
            inputs.validation,
            inputs.rewards,
            inputs.tokenizer,
            self.settings,
            step,
            self.episodes,
            scorer=self.score,
        )
        self.validated = (step, dict(scores))
        return {**scores, "time/validate": time.perf_counter() - started}

    def data_note(self) -> None:
        """What the run trains on (a dataset by id at its commit) and validates on."""
        self.say(f"data: {len(self.inputs.data)} prompts from {self.inputs.data.source}")
        held_out = self.inputs.validation
        if held_out is None:
            return
        dropped = self.inputs.validation_overlap
        also = f", {dropped} dropped as also in the training data" if dropped else ""
        self.say(f"validation: {len(held_out)} held-out prompts from {held_out.source}{also}")

    def cluster_report(self) -> None:
        cluster = self.cluster
        ranks = ", ".join(f"rank {r} on {ip}" for r, ip in enumerate(cluster.train.ips))
        self.say(f"training workers: {ranks}")
        strategy = cluster.strategy
        sharding = {
            "single": "one rank, unsharded",
            "ddp": "DDP (every rank a full replica)",
            "fsdp": "FSDP2 (weights, gradients and optimiser state sharded over the ranks)",
        }[strategy.strategy]
        self.say(f"sharding: {sharding}; {strategy.reason}")
        for note in cluster.notes:
            self.say(note)
        if cluster.rollout.ips:
            engines = ", ".join(f"{i} on {ip}" for i, ip in enumerate(cluster.rollout.ips))
            self.say(f"rollout workers: {engines}")

    # ------------------------------------------------------------------ one step

    def step(self, step: int) -> dict[str, float]:
        """One step: generate (or take the rollout queued ahead), score, prepare the
        forwards the advantages read, advantages, update and push; its metrics."""
        timer = _Timer()
        self.term_scores: list[TermScores] = []  # every scoring call's, for the metrics
        with self.clock.phase_of("generation"):
            self.queue.fill(step)  # this step's rollout and, with max_staleness k, k more
            rows, rollout = self.queue.take(step, show_progress=True)  # B = P * n
        timer.lap("generate")
        self.stop.check()  # a step stopped here is redone on resume, like any unsaved step
        batch = pack_rollout(rollout)
        rewards = self.rewards(step, rows, rollout, batch)
        timer.lap("reward")
        filtering: dict[str, float] = {}
        if self.backfill is not None:
            with self.clock.phase_of("generation"):  # more rounds, each scored
                rows, rollout, batch, rewards, filtering = self.filter_groups(
                    step, rows, rollout, batch, rewards
                )
            timer.lap("generate")
        self.check_versions(step, rows, rollout.row_versions)
        mask = batch.response_mask  # (B, R) the tokens that train: the model's own
        if rewards.trains is not None:  # a failed sample or episode trains no token
            batch = replace(batch, response_mask=mask & rewards.trains.unsqueeze(1))
        batch, shaped, shaping = self.overlong(batch, rollout, rewards)

        extra = {}
        if self.needs_prepare and self.prepare_first:
            with self.clock.phase_of("training ranks' forwards (prepare)"):
                extra = self.cluster.prepare(batch, self.old_logprobs)
        timer.lap("prepare")
        batch, returns, kl_reward = self.with_advantages(batch, rollout, shaped, extra)
        update = self.update(batch, step, timer)
        self.check_mismatch(update.metrics, step)

        metrics, response_tokens = self.sample_metrics(rollout, rewards, mask, update.metrics)
        metrics.update(shaping)
        metrics.update(filtering)
        metrics.update(term_metrics(self.term_scores))
        if kl_reward is not None:
            metrics["kl"] = float(algos.masked_mean(kl_reward, mask))
        if self.settings.algorithm == "ppo":
            metrics["value/explained_variance"] = float(
                algos.explained_variance(extra[VALUES], returns, mask)
            )
            metrics["value/mean"] = float(algos.masked_mean(extra[VALUES], mask))
        self.add_sync_metrics(metrics, update.probe_diff, rollout.row_versions, step)
        self.add_speed_metrics(metrics, timer, response_tokens, batch.num_tokens)
        return metrics

    def check_versions(self, step: int, rows: list[int], versions: torch.Tensor) -> None:
        """The weights each sample was made with, (B,), within max_staleness of the ones
        this step's update starts from; recorded with the step's prompts."""
        policy_version = step - 1  # the weights this step's update starts from
        check_staleness(versions, policy_version, self.max_staleness)
        if self.samples is not None:
            n = self.settings.rollout.n
            self.samples.write(step, prompts=rows, versions=versions.tolist()[:: max(n, 1)])

    def rewards(
        self, step: int, rows: list[int], rollout: Any, batch: SequenceBatch
    ) -> StepRewards:
        """The rollout scored: by the reward function (one outcome per response), or by the
        episodes' turns, whose trajectories are checked against what was sampled."""
        with self.clock.phase_of("reward"):
            return self._rewards(step, rows, rollout, batch)

    def _rewards(
        self, step: int, rows: list[int], rollout: Any, batch: SequenceBatch
    ) -> StepRewards:
        inputs, n = self.inputs, self.settings.rollout.n
        mask = batch.response_mask  # (B, R) the tokens that train: the model's own
        episodes = rollout.episodes
        if episodes is None:
            responses = inputs.tokenizer.batch_decode(
                rollout.response_lists(), skip_special_tokens=True
            )
            prompts = [inputs.data.prompts[i] for i in rows for _ in range(n)]
            answers = [inputs.data.answers[i] for i in rows for _ in range(n)]
            extra = RewardInputs.of_rows(inputs.data, rows, n, rollout.response_lists())
            terms = self.score_terms(prompts, responses, answers, extra)
            self.term_scores.append(terms)
            self.check_failed(step, terms)
            outcome, trained, valid = combine(
                terms.values, terms.weights, self.settings.reward_aggregate, n
            )  # (B,) each
            scores, trained = outcome.float(), trained.float()
            return StepRewards(outcome_token_rewards(trained, mask), scores, valid, trained=trained)
        # What trains is what was sampled, id for id, at every sampled position.
        checked = check_trajectories(batch, episodes, step)
        token_rewards = rollout.token_rewards  # (B, R) each turn's on its last token
        assert token_rewards is not None
        scores = token_rewards.sum(dim=1)  # (B,) each episode's reward
        trains = torch.tensor([e.failure is None for e in episodes])  # (B,)
        return StepRewards(token_rewards, scores, trains, checked)

    def score_terms(
        self,
        prompts: list[str],
        responses: list[str],
        answers: list[str | None],
        extra: RewardInputs | None = None,
    ) -> TermScores:
        """Every reward term over the samples, here on the head, within the step's stall
        window (stall.bounded_call): a call that does not return is named by its term."""
        terms = self.inputs.rewards
        assert terms is not None
        under_way = [terms.terms[0]]

        def who() -> str:
            term = under_way[0]
            started = getattr(term.scorer, "started", None)
            if started is not None:  # a function: the sample it hangs on
                where = f"sample {max(started[0] - 1, 0)} of {len(prompts)}"
            else:
                where = f"{len(prompts)} samples"
            return f"reward {term.source} ({where})"

        def scored() -> TermScores:
            rows, errors = [], []
            for term in terms.terms:
                under_way[0] = term
                values, error = term.scorer(prompts, responses, answers, extra)
                rows.append(values)
                errors.append(error)
            return TermScores.of(terms, rows, errors, len(prompts))

        return bounded_call(scored, self.clock, who)

    def score(
        self,
        prompts: list[str],
        responses: list[str],
        answers: list[str | None],
        extra: RewardInputs | None = None,
    ) -> list[float]:
        """The samples' total rewards (the weighted sum of the terms), NaN where one
        failed: validation's scorer."""
        return self.score_terms(prompts, responses, answers, extra).outcome().tolist()

    def check_failed(self, step: int, terms: TermScores) -> None:
        """Stop, in one line and before the update, when more than trainer.reward_max_failed
        of the samples have no reward: the last checkpoint is kept."""
        failed = terms.failed
        share = float(failed.float().mean()) if len(failed) else 0.0
        bound = self.settings.reward_max_failed
        if share <= bound:
            return
        raise RlxError(
            f"step {step}: {int(failed.sum())} of {len(failed)} samples ({share:.0%}) have no "
            f"reward, more than trainer.reward_max_failed {bound:g}: {terms.failure_line()}; "
            "nothing of this step was trained and the last checkpoint is kept; fix the "
            "reward and run again to resume from it"
        )

    def filter_groups(
        self, step: int, rows: list[int], rollout: Any, batch: SequenceBatch, rewards: StepRewards
    ) -> tuple[list[int], Any, SequenceBatch, StepRewards, dict[str, float]]:
        """Dynamic sampling (filtering.py): more rounds of prompts from the backfill sampler
        until prompts_per_step groups vary or max_rounds calls are made; the step's rows,
        rollout, batch and rewards of the groups picked, and the filtering's metrics."""
        spec = self.settings.batch.filter_groups
        assert spec is not None and self.backfill is not None
        wanted = self.settings.batch.prompts_per_step
        rounds = [self.round_of(rows, rollout, batch, rewards)]
        while (
            sum(int(one.varied.sum()) for one in rounds) < wanted and len(rounds) < spec.max_rounds
        ):
            more = next(self.backfill)
            extra = self.submit_rollout(more, step).collect(show_progress=True)
            extra_batch = pack_rollout(extra)
            extra_rewards = self.rewards(step, more, extra, extra_batch)
            rounds.append(self.round_of(more, extra, extra_batch, extra_rewards))
        picked = pick_groups(rounds, wanted)
        metrics = {
            "batch/kept_groups": float(picked.kept),
            "batch/dropped_groups": float(picked.dropped),
            "batch/sampling_rounds": float(picked.rounds),
        }
        if picked.short:
            self.say(
                f"step {step}: {picked.kept} of {wanted} prompts' responses differed in score "
                f"after {picked.rounds} generate calls (batch.filter_groups.max_rounds "
                f"{spec.max_rounds}); the step also trains {wanted - picked.kept} groups of "
                "equal scores, which move nothing under a group baseline; raise max_rounds, "
                "or give prompts the policy sometimes solves"
            )
        if len(rounds) == 1 and not picked.dropped:
            return rows, rollout, batch, rewards, metrics  # every group varied at once
        batch = pack_rollout(picked.rollout)
        if picked.rollout.episodes is not None:
            rewards = self.rewards(step, picked.rows, picked.rollout, batch)
        else:
            trained = picked.trained if picked.trained is not None else picked.scores
            token_rewards = outcome_token_rewards(trained, batch.response_mask)
            rewards = StepRewards(token_rewards, picked.scores, torch.isfinite(picked.scores))
        return picked.rows, picked.rollout, batch, rewards, metrics

    def round_of(
        self, rows: list[int], rollout: Any, batch: SequenceBatch, rewards: StepRewards
    ) -> Round:
        """A generate call's groups, each marked by whether its scores vary: the outcome, or
        the reward after algo.overlong's penalty (batch.filter_groups.on)."""
        spec = self.settings.batch.filter_groups
        assert spec is not None
        values = rewards.scores  # (B,)
        if spec.on == "reward":
            values = self.overlong(batch, rollout, rewards)[1].token_rewards.sum(dim=1)
        varied = group_spread(values, self.settings.rollout.n, spec.tolerance, rewards.trains)
        return Round(rows, rollout, rewards.scores, varied, rewards.trained)

    def overlong(
        self, batch: SequenceBatch, rollout: Any, rewards: StepRewards
    ) -> tuple[SequenceBatch, StepRewards, dict[str, float]]:
        """algo.overlong on a single-turn step (DAPO): responses the limit cut leave the loss
        and their group's baseline (mask_truncated), and the soft length penalty joins what
        the advantages read (buffer). The outcome, rewards.scores, is left as scored: the
        metrics report it. (batch, rewards for the advantages, the shaping's metrics)."""
        overlong = self.settings.algo.overlong
        if rollout.episodes is not None or not (overlong.mask_truncated or overlong.buffer):
            return batch, rewards, {}
        mask = batch.response_mask  # (B, R)
        cut = ~rollout.finished.bool()  # (B,) no EOS: the limit ended them
        metrics = {"overlong/truncated_fraction": float(cut.float().mean())}
        token_rewards, trains = rewards.token_rewards, rewards.trains
        if overlong.buffer:
            penalty = algos.overlong_penalty(
                mask.sum(dim=1),
                self.settings.rollout.max_new_tokens,
                overlong.buffer,
                overlong.penalty,
            )  # (B,)
            token_rewards = token_rewards + outcome_token_rewards(penalty, mask)  # (B, R)
            metrics["overlong/penalty_mean"] = float(penalty.mean())
        if overlong.mask_truncated:
            keep = ~cut  # (B,)
            batch = replace(batch, response_mask=mask & keep.unsqueeze(1))
            token_rewards = torch.where(keep.unsqueeze(1), token_rewards, 0.0)
            trains = keep if trains is None else trains & keep
        return batch, replace(rewards, token_rewards=token_rewards, trains=trains), metrics

    def check_mismatch(self, metrics: dict[str, float], step: int) -> None:
        """Stop, in one line, at a mismatch no dtype or kernel difference explains: the
        engines then serve other weights than the learner trains."""
        bound = self.settings.algo.rollout_correction.max_mismatch_kl
        kl = metrics.get("mismatch/kl")
        if bound is None or kl is None or kl <= bound:
            return
        raise RlxError(
            f"step {step}: mismatch/kl {kl:.4g} between the engines' log-probs and the "
            f"learner's is above algo.rollout_correction.max_mismatch_kl {bound:g}; the engines "
            "likely serve other weights (check sync/probe_diff, rollout.dtype and the LoRA "
            "adapter the engines load), or raise the bound if this mismatch is expected; "
            "the last checkpoint is kept"
        )

    def with_advantages(
        self,
        batch: SequenceBatch,
        rollout: Any,
        rewards: StepRewards,
        extra: dict[str, torch.Tensor],
    ) -> tuple[SequenceBatch, torch.Tensor, torch.Tensor | None]:
        """The batch with what the update reads (advantages, and the fields the settings
        need); (batch, returns, the KL penalty per token when the KL is in the reward)."""
        settings = self.settings
        algo, mask = settings.algo, batch.response_mask
        token_rewards = rewards.token_rewards
        kl_reward = None
        if algo.kl.coef > 0 and algo.kl.mode == "reward":
            token_rewards, kl_reward = algos.kl_penalized_rewards(
                token_rewards,
                extra[OLD_LOGP],
                extra[REF_LOGP],
                mask,
                kl_coef=algo.kl.coef,
                estimator=algo.kl.estimator,
            )
        advantages, returns = self.estimator(
            token_rewards,
            mask,
            values=extra.get(VALUES),
            group_size=settings.rollout.n,
            gamma=algo.gamma,
            gae_lambda=algo.gae_lambda,
            row_valid=rewards.trains,
        )  # (B, R) each
        if settings.algorithm == "ppo":
            advantages = algos.masked_whiten(advantages, mask)  # (B, R)
        batch = self.with_update_fields(batch, extra, advantages, returns)
        if self.engine_logprobs:  # the mismatch, the correction, decoupled PPO's weight
            batch = batch.with_fields(**{BEHAV_LOGP: rollout.logprobs})
        return batch, returns, kl_reward

    def update(self, batch: SequenceBatch, step: int, timer: _Timer) -> StepUpdate:
        """The ranks' update and the push to the engines, timed; its notes said."""
        prepare_in_update = self.needs_prepare and not self.prepare_first
        with self.clock.phase_of("training ranks' update"):
            update = self.cluster.update(
                batch, step, prepare=prepare_in_update, probe=self.inputs.probe
            )
        timer.lap("update")
        # The update call's time holds the ranks' forwards and the engines' refresh: count
        # them under their own names.
        timer.move("update", "prepare", update.prepare_seconds)
        timer.move("update", "sync", update.sync_seconds)
        for note in update.notes:
            self.say(note)
        return update

    def sample_metrics(
        self,
        rollout: Any,
        rewards: StepRewards,
        mask: torch.Tensor,
        stats: dict[str, float],
    ) -> tuple[dict[str, float], float]:
        """The step's metrics begun: rewards and lengths, then the update's stats, then the
        episodes'; (metrics, the responses' tokens)."""
        lengths = mask.sum(dim=1).float()  # (B,) the model's tokens
        scores, trains = rewards.scores, rewards.trains
        scored = scores if trains is None else scores[trains]  # failed episodes have none
        metrics: dict[str, float] = {
            REWARD_MEAN: float(scored.mean()) if len(scored) else 0.0,
            REWARD_STD: float(scored.std()) if len(scored) > 1 else 0.0,
            RESPONSE_LENGTH: float(lengths.mean()),
            "response_length/max": float(lengths.max()),
            "response/finished": float(rollout.finished.float().mean()),
            **stats,
        }
        if rollout.episodes is not None:
            metrics.update(episode_metrics(rollout))
            metrics["episode/checked_tokens"] = float(rewards.checked)
        return metrics, float(lengths.sum())

    def add_sync_metrics(
        self,
        metrics: dict[str, float],
        probe_diff: float | None,
        versions: torch.Tensor,
        step: int,
    ) -> None:
        """The push's proof and size, and with rollouts ahead the samples' staleness and the
        spread of their off-policy weights."""
        if probe_diff is not None:  # with rollouts ahead: the previous step's push's proof
            metrics["sync/probe_diff"] = probe_diff
        pushed = self.cluster.push_bytes()
        if pushed:  # per engine: the adapters alone with LoRA
            metrics["sync/bytes"] = float(pushed)
        metrics.pop("mismatch/weight_sq_mean", None)  # offpolicy/weight_std says it
        if self.job.ahead:
            metrics.update(staleness_metrics(versions, step - 1, self.max_staleness))
            square = metrics.pop("offpolicy/weight_sq_mean", None)
            if square is not None:
                spread = square - metrics[IS_WEIGHT] ** 2
                metrics[IS_WEIGHT_STD] = max(spread, 0.0) ** 0.5

    def add_speed_metrics(
        self, metrics: dict[str, float], timer: _Timer, response_tokens: float, tokens: int
    ) -> None:
        """The step's time, tokens per second (generated, trained) and the phases' times,
        and the host memory the run holds."""
        total = timer.total()
        metrics[STEP_TIME] = total
        metrics[TOKENS_PER_S] = response_tokens / max(total, 1e-9)
        metrics["generation/tokens_per_s"] = response_tokens / max(timer.laps["generate"], 1e-9)
        trained = tokens * self.settings.batch.ppo_epochs
        metrics["train/tokens_per_s"] = trained / max(timer.laps["update"], 1e-9)
        for name, seconds in timer.laps.items():
            metrics[f"time/{name}"] = seconds
        metrics[HOST_MEMORY] = self.memory_of() / GIB

    def with_update_fields(
        self,
        batch: SequenceBatch,
        extra: dict[str, torch.Tensor],
        advantages: torch.Tensor,
        returns: torch.Tensor,
    ) -> SequenceBatch:
        """Only what the update reads travels to the workers (and what they compute in the
        update call themselves does not travel at all)."""
        fields = {ADVANTAGES: advantages}
        if OLD_LOGP in extra:
            fields[OLD_LOGP] = extra[OLD_LOGP]
        kl = self.settings.algo.kl
        if kl.coef > 0 and kl.mode == "loss" and REF_LOGP in extra:
            fields[REF_LOGP] = extra[REF_LOGP]
        if self.settings.algorithm == "ppo":
            fields[VALUES] = extra[VALUES]
            fields[RETURNS] = returns
        return batch.with_fields(**fields)

    # ------------------------------------------------------------------ checkpoints

    def save(self, step: int) -> Location | None:
        """Every rank writes its shard into one temporary folder picked here; rank 0 adds the
        small parts and commits it. Into object storage the upload goes on while training
        does (remote.py): the next save, a stop and the run's end wait for it. A save that
        stalls leaves its folder uncommitted: a resume never takes it for a checkpoint."""
        with self.clock.phase_of("save"):
            return self._save(step)

    def _save(self, step: int) -> Location | None:
        assert self.manager is not None
        self.finish_saves()
        state = {
            "step": step,
            # Before the prompts of the steps in flight were drawn: a resume draws them again.
            "sampler": self.queue.sampler_state_after(step),
            # Drawn only when a step trains: as it is after this one.
            "backfill": None if self.backfill is None else self.backfill.state_dict(),
            "world_size": self.cluster.plan.train_workers,
            "algorithm": self.settings.algorithm,
            "data_revisions": dict(self.inputs.data.revisions),
        }
        # The best once this step is saved: the step itself where it was validated and beats it.
        validated = self.validated[1] if self.validated and self.validated[0] == step else None
        best = consider(self.best, self.settings.checkpoint.best, step, validated)
        state["best"] = None if best is None else best.to_json()
        self.best_pending = (step, best)
        controller_parts = {TRAINER_STATE: state, CONTROLLER_RNG: capture_rng_state()}
        rng_states = self.cluster.call_all("rng_state")
        try:
            temporary = self.manager.begin(step)
        except Exception as exc:  # the controller's own disk or store refused the save
            self.save_failed(save_failure(exc, step, self.manager.run_dir), None)
            return None
        request = SaveRequest(
            folder=str(temporary),
            manager=self.manager,
            step=step,
            controller_parts=controller_parts,
            rng_states=rng_states,
            kill_spec=os.environ.get(KILL_HOOK_ENV),  # read now: a test hook
            best_step=None if best is None else best.step,
        )
        try:
            saved = self.cluster.call_all("save_checkpoint", request)[0]
        except SaveFailed as failure:
            # Only what the ranks report as a failed save: a rank that died (kill -9, OOM)
            # ends the run as a crash does, its half-written step left for the resume to skip.
            self.save_failed(failure, temporary)
            return None
        if saved is None:  # staged; uploading
            self.uploading = (step, temporary)
            return self.manager.location(step)
        self.saved(saved)
        return saved.path

    def finish_saves(self, final: bool = False) -> None:
        """Wait for the save whose upload is under way (if any) to be complete. final: the
        run's last save, which no later one can make up for."""
        if self.uploading is None:
            return
        _, folder = self.uploading
        self.uploading = None
        try:
            saved = self.cluster.call_all("finish_checkpoint")[0]
        except SaveFailed as failure:  # as in save: a rank's death is no failed save
            self.save_failed(failure, folder, final)
            return
        self.saved(saved)

    def save_failed(self, failure: SaveFailed, folder: Path | None, final: bool = False) -> None:
        """A save failed for good: what it left goes (unless the store stopped answering:
        the next save clears it), then the run stops with one line, or with
        checkpoint.on_failure: continue warns and trains on (never past its last save)."""
        assert self.manager is not None
        if not failure.try_again and folder is not None:  # None: no save was begun
            self.manager.abandon(failure.step, folder)
        line = failure_line(failure, self.newest_saved)
        final = final or failure.step >= self.settings.steps
        if self.settings.checkpoint.on_failure == "continue" and not final:
            print(
                f"warning: {line}; training on (checkpoint.on_failure: continue), the next "
                "save tries again",
                file=self.err,
                flush=True,
            )
            return
        raise failure.stopping(line)

    def store_retries(self) -> int:
        """Transient store errors retried since the run began: the saves' and the
        controller's own (listing and clearing the run's checkpoints)."""
        own = getattr(self.manager, "retries", None)
        return self.saves_retried + (0 if own is None else own.count)

    def saved(self, saved: SavedCheckpoint) -> None:
        self.checkpoint_bytes = saved.bytes
        self.saves_retried += saved.retries
        self.newest_saved = step_of(str(saved.path))
        self.say(f"checkpoint {saved.path} ({format_bytes(saved.bytes)} on disk)")
        if self.best_pending is not None and self.best_pending[0] == self.newest_saved:
            best = self.best_pending[1]
            if best is not None and best != self.best:
                self.say(f"best checkpoint: {best.line()}")
            self.best = best
        self.best_pending = None
        mirror_run(self.inputs.paths, self.err)

    def best_record(self) -> dict[str, Any] | None:
        """result.json's `best`: checkpoint.best's step, its value and its checkpoint."""
        if self.best is None or self.manager is None:
            return None
        return {**self.best.to_json(), "checkpoint": str(self.manager.location(self.best.step))}

    def export(self) -> Path | None:
        """The newest checkpoint as a Hugging Face folder, <run folder>/model."""
        if self.manager is None or (latest := self.manager.latest()) is None:
            return None
        from rlx.trainer.checkpoint.export import export_checkpoint

        try:
            exported = export_checkpoint(latest, self.inputs.paths.run_dir / "model", replace=True)
        except (RlxError, OSError, ValueError) as exc:
            # The run itself succeeded and its checkpoint is complete: say how to retry.
            first = first_line(exc)
            retry = f"rlx export {shlex.quote(str(latest))} OUT"
            print(
                f"warning: no Hugging Face export ({first}); try `{retry}`",
                file=self.err,
                flush=True,
            )
            return None
        self.say(
            f"exported {location_name(latest)} to {exported.folder} ({exported.dtype}, "
            f"{format_bytes(exported.bytes)})"
        )
        return exported.folder

    def check_data_revisions(self, path: Any, state: dict[str, Any]) -> None:
        """The dataset repositories read now are at the commits the checkpoint's run read
        (resume.moved_data), unless the recipe names another commit outright."""
        data = self.settings.data
        moved = moved_data(
            state.get("data_revisions") or {},
            self.inputs.data.revisions,
            chosen_commits([data.train, *(source.train for source in data.mix or ())]),
        )
        if moved is not None:
            raise RlxError(f"cannot resume from {path}: {moved}")

    def resume(self) -> int:
        """Load the checkpoint the settings point at (none: start at step 0). Returns its step."""
        setting = self.settings.checkpoint.resume
        if setting not in ("auto", "never"):
            manager = manager_for(setting)  # a checkpoint named by its path: of its own kind
        elif self.manager is not None:
            manager = self.manager
        else:
            self.proven(0, self.cluster.sync_weights(0, self.inputs.probe, push=False))
            return 0
        path = resolve_resume(setting, manager, self.say)
        if path is None:
            self.proven(0, self.cluster.sync_weights(0, self.inputs.probe, push=False))
            return 0
        parts = manager.load_parts(path, (TRAINER_STATE, CONTROLLER_RNG, LEARNER_STATE))
        if LEARNER_STATE not in parts:
            raise RlxError(
                f"checkpoint {path} is a single-file checkpoint of an older rlx; resume it "
                "with that version, or set RLX_RUN_ID to start a new run"
            )
        state = parts[TRAINER_STATE]
        if state["algorithm"] != self.settings.algorithm:
            raise RlxError(
                f"checkpoint {path} is from a {state['algorithm']} run, this recipe trains "
                f"{self.settings.algorithm}; set RLX_RUN_ID to start a new run"
            )
        self.check_data_revisions(path, state)
        step = int(state["step"])
        # Complete: what a retry resumes from, should the loading below stall (the step a
        # stall names is the one the run goes on to).
        self.newest_saved = step
        self.clock.step = step + 1
        try:
            self.sampler.load_state_dict(state["sampler"])
            if self.backfill is not None and state.get("backfill") is not None:
                self.backfill.load_state_dict(state["backfill"])
        except ValueError as exc:
            raise RlxError(f"cannot resume from {path}: {exc}") from None
        restore_rng_state(parts[CONTROLLER_RNG])
        loaded = self.cluster.call_all("load_checkpoint", manager, path)
        self.best, note = restored(state.get("best"), self.settings.checkpoint.best)
        if note is not None:
            self.say(note)
        memory = max(report.host_bytes for report in loaded)
        self.say(
            f"resumed from {path} (step {step}); loading took at most {format_bytes(memory)} "
            "of host memory per training worker"
        )
        if self.best is not None:
            self.say(f"best checkpoint so far: {self.best.line()}")
        if not all(report.rng_restored for report in loaded):
            self.say(
                f"note: the checkpoint has {state['world_size']} training workers' random "
                f"states and this run has {self.cluster.plan.train_workers}; their random "
                "streams start afresh"
            )
        self.proven(step, self.cluster.sync_weights(step, self.inputs.probe))
        return step

    def proven(self, step: int, diff: float) -> None:
        """Say how closely the engines matched the policy before the first step: the figure
        to hold against the tolerance on a new model, GPU or dtype."""
        cluster = self.cluster
        self.say(
            f"weights of step {step} proven on every engine: probe difference {diff:.3g} "
            f"(tolerance {cluster.last_tolerance:.3g}, {cluster.engine_dtype})"
        )


def format_bytes(count: int | None) -> str:
    if count is None:
        return "size unknown"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"


@dataclass(frozen=True)
class StepRewards:
    """A step's rollout scored."""

    token_rewards: torch.Tensor  # (B, R) each response's reward, on the tokens that earn it
    scores: torch.Tensor  # (B,) each response's (or episode's) reward
    trains: torch.Tensor | None = None  # (B,) bool: the samples or episodes that did not fail
    checked: int | None = None  # the episodes' tokens checked against what was sampled
    trained: torch.Tensor | None = None  # (B,) the total the advantages read, before shaping


class _Timer:
    """Seconds spent in each phase of a step."""

    def __init__(self) -> None:
        self.started = self.last = time.perf_counter()
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = self.laps.get(name, 0.0) + now - self.last
        self.last = now

    def move(self, source: str, target: str, seconds: float) -> None:
        """Count `seconds` of lap `source` under `target` instead."""
        seconds = min(seconds, self.laps.get(source, 0.0))
        self.laps[source] = self.laps.get(source, 0.0) - seconds
        self.laps[target] = self.laps.get(target, 0.0) + seconds

    def total(self) -> float:
        return time.perf_counter() - self.started
