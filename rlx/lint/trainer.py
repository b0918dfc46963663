"""Checks of the trainer section: batch sizes against the ranks, the rollout engine and its
tensor parallelism, the layout, the names the trainer resolves (tiny models, synthetic tasks,
rewards), checkpoint cadence and the best checkpoint's metric, and settings that do
nothing."""

from __future__ import annotations

from collections.abc import Iterator

from rlx.errors import RlxError
from rlx.lint.core import ERROR, WARNING, Check, Problem
from rlx.recipe import Recipe
from rlx.recipe.correction import rollout_correction_problem
from rlx.recipe.specs import (
    SYNTHETIC_PREFIX,
    TINY_PREFIX,
    synthetic_task_problem,
    tiny_spec_problem,
)
from rlx.trainer.rollout import choose_engine


def _dp_ranks(recipe: Recipe) -> int:
    """Training (data-parallel) ranks, as the trainer will place them: one per training GPU,
    or one per node on CPU-only jobs."""
    from rlx.plan.actors import plan_actors
    from rlx.plan.sizing import AUTO, with_sizes

    trainer = recipe.trainer
    if trainer is not None and trainer.rollout.tensor_parallel_size == AUTO:
        recipe = with_sizes(recipe, tensor_parallel_size=1)  # ranks do not depend on it
    try:
        return plan_actors(recipe).train_workers
    except RlxError:  # an impossible split layout; check_layout reports it
        train = recipe.resources.train_nodes
        return max(train.nodes * train.gpus_per_node, 1)


def check_has_work(recipe: Recipe) -> Iterator[Problem]:
    if recipe.trainer is None and recipe.command is None:
        yield Problem(
            ("trainer",),
            ERROR,
            "nothing to run: add a 'trainer:' section, or a 'command:' for your own program",
        )


def check_batch_divisibility(recipe: Recipe) -> Iterator[Problem]:
    trainer = recipe.trainer
    if trainer is None:
        return
    batch, ranks = trainer.batch, _dp_ranks(recipe)
    step = batch.prompts_per_step * trainer.rollout.n
    minibatch = batch.minibatch_size or step
    where = ("trainer", "batch")
    if step % ranks:
        yield Problem(
            (*where, "prompts_per_step"),
            ERROR,
            f"prompts_per_step x rollout.n = {step} sequences do not split evenly "
            f"over {ranks} training workers; make it a multiple of {ranks}",
        )
    elif step % minibatch:
        yield Problem(
            (*where, "minibatch_size"),
            ERROR,
            f"minibatch_size {minibatch} does not divide the {step} sequences of a "
            "step; pick a divisor",
        )
    elif minibatch % ranks:
        yield Problem(
            (*where, "minibatch_size"),
            ERROR,
            f"minibatch_size {minibatch} does not split over {ranks} training workers; "
            f"make it a multiple of {ranks}",
        )
    elif batch.micro_batch_size != "auto" and batch.micro_batch_size > minibatch // ranks:
        yield Problem(
            (*where, "micro_batch_size"),
            WARNING,
            f"micro_batch_size {batch.micro_batch_size} is larger than the "
            f"{minibatch // ranks} sequences each training worker gets per minibatch, so "
            f"micro-batches hold {minibatch // ranks}; lower it to say so",
        )


def check_tensor_parallel(recipe: Recipe) -> Iterator[Problem]:
    trainer, gpus = recipe.trainer, recipe.resources.engine_gpus_per_node
    if trainer is None:
        return
    tp = trainer.rollout.tensor_parallel_size
    where = "rollout node (groups.rollout)" if recipe.resources.groups else "node"
    if tp == "auto":  # chosen per alternative: rlx.lint.alternatives checks the choice
        return
    if tp > 1 and (gpus == 0 or gpus % tp):
        yield Problem(
            ("trainer", "rollout", "tensor_parallel_size"),
            ERROR,
            f"tensor_parallel_size {tp} does not divide the {gpus} GPUs per {where}; "
            "an engine must fit on one node",
        )


def check_rollout_engine(recipe: Recipe) -> Iterator[Problem]:
    trainer = recipe.trainer
    if trainer is None:
        return
    rollout = trainer.rollout
    if rollout.min_new_tokens > rollout.max_new_tokens:
        yield Problem(
            ("trainer", "rollout", "min_new_tokens"),
            ERROR,
            f"min_new_tokens {rollout.min_new_tokens} exceeds max_new_tokens "
            f"{rollout.max_new_tokens}",
        )


def check_group_size(recipe: Recipe) -> Iterator[Problem]:
    trainer = recipe.trainer
    if trainer is None or trainer.rollout.n >= 2:
        return
    if trainer.algorithm in ("grpo", "rloo"):
        yield Problem(
            ("trainer", "rollout", "n"),
            ERROR,
            f"{trainer.algorithm} compares responses within a group, so rollout.n "
            "must be at least 2 (8 or 16 is typical)",
        )
    elif trainer.algorithm == "reinforce_pp" and trainer.algo.baseline == "group":
        yield Problem(
            ("trainer", "rollout", "n"),
            ERROR,
            "reinforce_pp with baseline: group subtracts the mean of the prompt's responses, "
            "so rollout.n must be at least 2 (8 or 16 is typical), or write baseline: batch",
        )


def check_policy_loss(recipe: Recipe) -> Iterator[Problem]:
    """Loss combinations that contradict themselves (the learner would run them wrongly)."""
    trainer = recipe.trainer
    if trainer is None:
        return
    algo = trainer.algo
    if algo.policy_loss == "gspo" and algo.loss_agg != "seq-mean-token-mean":
        yield Problem(
            ("trainer", "algo", "loss_agg"),
            ERROR,
            f"gspo normalises each response's ratio by its length; {algo.loss_agg} would "
            "weigh responses by their length again; write loss_agg: seq-mean-token-mean",
        )
    if algo.policy_loss == "cispo" and algo.dual_clip is not None:
        yield Problem(
            ("trainer", "algo", "dual_clip"),
            ERROR,
            "cispo clips its weight and stops its gradient, so there is no ratio for a dual "
            "clip to cap; remove dual_clip, or write policy_loss: ppo",
        )


def check_overlong(recipe: Recipe) -> Iterator[Problem]:
    """algo.overlong reads single-turn responses against rollout.max_new_tokens."""
    trainer = recipe.trainer
    if trainer is None:
        return
    overlong, limit = trainer.algo.overlong, trainer.rollout.max_new_tokens
    used = overlong.mask_truncated or overlong.buffer > 0
    if used and trainer.environment is not None:
        yield Problem(
            ("trainer", "algo", "overlong"),
            ERROR,
            "overlong shaping reads one response against rollout.max_new_tokens, and an "
            "environment's episode has several turns and its own budget; remove algo.overlong "
            "(an environment can end an overlong episode with its own reward)",
        )
    elif overlong.buffer >= limit:
        yield Problem(
            ("trainer", "algo", "overlong", "buffer"),
            ERROR,
            f"an overlong buffer of {overlong.buffer} tokens covers the whole response budget "
            f"(rollout.max_new_tokens {limit}), so every response would be punished; write a "
            f"buffer below {limit} (DAPO: a fifth of the budget, here {limit // 5})",
        )


def check_filter_groups(recipe: Recipe) -> Iterator[Problem]:
    """Dynamic sampling keeps groups whose scores differ: a group of one never does."""
    trainer = recipe.trainer
    if trainer is None or trainer.batch.filter_groups is None:
        return
    if trainer.rollout.n < 2:
        yield Problem(
            ("trainer", "batch", "filter_groups"),
            ERROR,
            f"filter_groups keeps prompts whose responses' scores differ, and with rollout.n "
            f"{trainer.rollout.n} a prompt has one response, so none would ever train; write "
            "rollout.n: 2 or more (8 or 16 is typical), or remove filter_groups",
        )


def check_rollout_correction(recipe: Recipe) -> Iterator[Problem]:
    trainer = recipe.trainer
    if trainer is None:
        return
    problem = rollout_correction_problem(trainer.algo)
    if problem is not None:
        yield Problem(("trainer", "algo", "rollout_correction"), ERROR, problem)


def check_rollout_dtype(recipe: Recipe) -> Iterator[Problem]:
    """A colocated HF engine in another dtype than the policy needs weights of its own, pushed
    whole after each update: a LoRA policy pushes its adapters alone, so it cannot feed one."""
    trainer = recipe.trainer
    if trainer is None or trainer.rollout.dtype is None or trainer.model.lora is None:
        return
    gpus = recipe.resources.engine_gpus_per_node
    model_dtype = trainer.model.dtype
    if model_dtype == "auto":
        model_dtype = "bfloat16" if recipe.resources.total_gpus > 0 else "float32"
    engine = choose_engine(trainer.rollout.engine, gpus)
    if trainer.layout == "colocated" and engine == "hf" and trainer.rollout.dtype != model_dtype:
        yield Problem(
            ("trainer", "rollout", "dtype"),
            ERROR,
            f"a colocated hf engine in {trainer.rollout.dtype} beside a {model_dtype} LoRA "
            "policy would need the whole weights pushed, and LoRA pushes the adapters alone; "
            "remove rollout.dtype, or use engine: vllm or layout: split",
        )


def check_layout(recipe: Recipe) -> Iterator[Problem]:
    trainer = recipe.trainer
    if trainer is None:
        return
    total = recipe.resources.total_gpus
    tp = trainer.rollout.tensor_parallel_size
    tp = 1 if tp == "auto" else tp  # auto divides rollout_gpus by its rule
    if recipe.resources.groups is not None:
        return  # the rollout group decides rollout_gpus: rlx.lint.groups checks it
    if trainer.layout == "split" and total > 0:
        if not 0 < trainer.rollout_gpus < total:
            yield Problem(
                ("trainer", "rollout_gpus"),
                ERROR,
                f"layout: split needs 0 < rollout_gpus < {total} (the job's GPUs) "
                "so both training and rollout get GPUs",
            )
        elif trainer.rollout_gpus % tp:
            yield Problem(
                ("trainer", "rollout_gpus"),
                ERROR,
                f"rollout_gpus {trainer.rollout_gpus} is not a multiple of "
                f"tensor_parallel_size {tp}",
            )
    elif trainer.layout == "colocated" and trainer.rollout_gpus:
        # (split on a CPU-only job: rollout_gpus is the number of rollout actors)
        yield Problem(
            ("trainer", "rollout_gpus"), WARNING, "rollout_gpus is ignored with layout: colocated"
        )


def check_staleness_layout(recipe: Recipe) -> Iterator[Problem]:
    """Rollouts can run during the update only on engines of their own."""
    trainer = recipe.trainer
    if trainer is None or trainer.rollout.max_staleness == 0 or trainer.layout == "split":
        return
    k = trainer.rollout.max_staleness
    yield Problem(
        ("trainer", "rollout", "max_staleness"),
        ERROR,
        f"max_staleness {k} needs layout: split (colocated engines live in the training "
        "workers, so nothing can generate while they train); set layout: split with "
        "rollout_gpus, or max_staleness: 0",
    )


def check_colocated_tensor_parallel(recipe: Recipe) -> Iterator[Problem]:
    trainer = recipe.trainer
    if trainer is None:
        return
    tp = trainer.rollout.tensor_parallel_size
    gpus = recipe.resources.engine_gpus_per_node
    if tp in (1, "auto") or gpus == 0:  # auto is 1 wherever an engine takes one GPU
        return
    where = ("trainer", "rollout", "tensor_parallel_size")
    if choose_engine(trainer.rollout.engine, gpus) == "hf":
        yield Problem(
            where,
            ERROR,
            f"tensor_parallel_size {tp} needs engine: vllm (an hf engine runs on one GPU); "
            "set engine: vllm, or tensor_parallel_size: 1",
        )
    elif trainer.layout == "colocated":
        yield Problem(
            where,
            ERROR,
            f"tensor_parallel_size {tp} needs layout: split with rollout_gpus a multiple of "
            f"{tp} (colocated engines run one per training GPU)",
        )


def check_trainer_specs(recipe: Recipe) -> Iterator[Problem]:
    """The names the trainer resolves on the head before any worker starts: tiny model
    specs, synthetic tasks and built-in rewards."""
    from rlx.trainer.tasks.rewards import reward_spec_problem

    trainer = recipe.trainer
    if trainer is None:
        return
    models = [("model", trainer.model.path)]
    if trainer.algorithm == "ppo" and trainer.critic_model is not None:
        models.append(("critic_model", trainer.critic_model.path))
    for field, spec in models:
        problem = tiny_spec_problem(spec) if spec.startswith(TINY_PREFIX) else None
        if problem:
            yield Problem(("trainer", field, "path"), ERROR, f"{spec!r} {problem}")
    data = trainer.data.train
    datasets: list[tuple[tuple[str | int, ...], str]] = [(("trainer", "data", "train"), data)]
    datasets += [
        (("trainer", "data", "mix", i, "train"), source.train)
        for i, source in enumerate(trainer.data.mix)
    ]
    if trainer.validation is not None:
        datasets.append((("trainer", "validation", "data"), trainer.validation.data))
    for where, spec in datasets:
        problem = synthetic_task_problem(spec) if spec.startswith(SYNTHETIC_PREFIX) else None
        if problem:
            yield Problem(where, ERROR, problem)
    for term, where in zip(trainer.reward_terms(), trainer.reward_term_fields(), strict=True):
        reward = term.function
        if reward is None:
            continue
        field = (*where, "function")
        problem = reward_spec_problem(reward if trainer.rewards else trainer.reward.function)
        if problem:
            yield Problem(field, ERROR, problem)
        elif reward == "math_exact" and "math" in data.lower():
            yield Problem(
                field,
                WARNING,
                "math_exact scores 1 only when the WHOLE response equals the answer, so "
                "'The answer is \\boxed{5}.' scores 0; use math_verify for MATH-style answers",
            )


def check_reward_secrets(recipe: Recipe) -> Iterator[Problem]:
    """A reward server's auth_secret names a secret the recipe lists: only those reach the
    nodes (their values from the launching environment, never written down)."""
    trainer = recipe.trainer
    if trainer is None or trainer.rewards is None:
        return
    for i, term in enumerate(trainer.rewards):
        name = term.auth_secret
        if name is not None and name not in recipe.secrets:
            listed = ", ".join(recipe.secrets) if recipe.secrets else "none"
            yield Problem(
                ("trainer", "rewards", i, "auth_secret"),
                ERROR,
                f"{name} is not in the recipe's secrets: (listed: {listed}); add it there "
                f"(secrets: [{name}]) so its value reaches the nodes from your environment",
            )


def check_packing_budget(recipe: Recipe) -> Iterator[Problem]:
    """Packed passes hold at most max_tokens_per_micro_batch tokens: with packing on, one
    sequence (a prompt and its longest response or episode) must fit in it, or every longer
    one runs alone above the budget the plan sized the memory for."""
    from rlx.plan.budget import sequence_tokens

    trainer = recipe.trainer
    if trainer is None or trainer.batch.packing is not True:
        return
    budget = trainer.batch.max_tokens_per_micro_batch
    longest = sequence_tokens(trainer)
    if budget is not None and budget < longest:
        yield Problem(
            ("trainer", "batch", "max_tokens_per_micro_batch"),
            ERROR,
            f"{budget} tokens per packed pass hold no whole sequence (data.max_prompt_length "
            f"+ the response budget = {longest} tokens); write max_tokens_per_micro_batch: "
            f"{longest} or more, or leave it unset (micro_batch_size sequences)",
        )


def check_checkpoint_cadence(recipe: Recipe) -> Iterator[Problem]:
    trainer = recipe.trainer
    if trainer and trainer.checkpoint.dir and trainer.checkpoint.every > trainer.steps:
        yield Problem(
            ("trainer", "checkpoint", "every"),
            WARNING,
            f"every {trainer.checkpoint.every} steps but the run has "
            f"{trainer.steps}; only the final checkpoint will be written",
        )


def check_checkpoint_best(recipe: Recipe) -> Iterator[Problem]:
    """checkpoint.best names a metric the run logs, at validated steps it saves."""
    from rlx.runs import validation_metrics
    from rlx.trainer.tasks.rewards import answer_extractor

    trainer = recipe.trainer
    if trainer is None or trainer.checkpoint.best is None:
        return
    checkpoint, validation = trainer.checkpoint, trainer.validation
    metric = checkpoint.best.metric
    where = ("trainer", "checkpoint", "best")
    if checkpoint.dir is None:
        yield Problem(
            where,
            ERROR,
            "keeps the best checkpoint, but checkpoint.dir is unset (no checkpoints); set "
            "checkpoint.dir or drop checkpoint.best",
        )
    if validation is None:
        yield Problem(
            (*where, "metric"),
            ERROR,
            f"{metric} is a validation metric, but the recipe has no trainer.validation "
            "section; add one (data, every, n) or drop checkpoint.best",
        )
        return
    logged = validation_metrics(validation.n, answer_extractor(trainer) is not None)
    if metric not in logged:
        yield Problem(
            (*where, "metric"),
            ERROR,
            f"the run never logs {metric}; with validation.n {validation.n} and this reward "
            f"it logs {', '.join(logged)}",
        )
    if checkpoint.dir is not None and checkpoint.every % validation.every:
        yield Problem(
            ("trainer", "checkpoint", "every"),
            WARNING,
            f"only a step both validated and saved can be the best: saves every "
            f"{checkpoint.every} steps and validation every {validation.every} meet at "
            "their common multiples and the last step; make checkpoint.every a multiple of "
            "validation.every",
        )


def check_unused_settings(recipe: Recipe) -> Iterator[Problem]:
    trainer = recipe.trainer
    if trainer is None:
        return
    critic = trainer.critic_model
    # (with a lora of its own, rlx.lint.lora's check_critic_lora_unused says it, once)
    if trainer.algorithm != "ppo" and critic is not None and critic.lora is None:
        yield Problem(
            ("trainer", "critic_model"),
            WARNING,
            f"{trainer.algorithm} has no critic; critic_model is ignored",
        )
    if trainer.algorithm != "reinforce_pp" and trainer.algo.baseline != "batch":
        yield Problem(
            ("trainer", "algo", "baseline"),
            WARNING,
            f"baseline is read by algorithm reinforce_pp only; {trainer.algorithm} ignores it",
        )
    if recipe.command is not None:
        yield Problem(
            ("command",),
            WARNING,
            "command replaces rlx's trainer, so the trainer section is only "
            "passed along (as RLX_RECIPE_JSON)",
        )


CHECKS: list[Check] = [
    check_has_work,
    check_batch_divisibility,
    check_tensor_parallel,
    check_rollout_engine,
    check_group_size,
    check_policy_loss,
    check_rollout_correction,
    check_overlong,
    check_filter_groups,
    check_rollout_dtype,
    check_layout,
    check_staleness_layout,
    check_colocated_tensor_parallel,
    check_trainer_specs,
    check_reward_secrets,
    check_packing_budget,
    check_checkpoint_cadence,
    check_checkpoint_best,
    check_unused_settings,
]
