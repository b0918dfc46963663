"""Pure RL math for the trainer: advantages, KL estimators, losses and their aggregation.

Tensors are batch-first: B sequences, T response tokens, V vocabulary entries. Every per-token
tensor travels with a mask (B, T) of 0/1 floats or bools marking the valid response tokens;
responses are right-padded. Nothing here knows about Ray, recipes or devices: the training
loop moves tensors around and calls these functions.
"""

from rlx.trainer.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    broadcast_to_tokens,
    compute_gae,
    get_advantage_estimator,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from rlx.trainer.algos.aggregation import (
    AGGREGATIONS,
    aggregate_loss,
    get_aggregation,
    loss_denominators,
)
from rlx.trainer.algos.common import MAX_LOG_RATIO, Metrics
from rlx.trainer.algos.correction import (
    CORRECTION_ACTIONS,
    CORRECTION_LEVELS,
    correction_bounds_problem,
    rollout_correction_weights,
)
from rlx.trainer.algos.kl import (
    KL_ESTIMATORS,
    get_kl_estimator,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_penalized_rewards,
)
from rlx.trainer.algos.losses import (
    POLICY_LOSSES,
    PolicyLoss,
    behavior_weights,
    cispo_policy_loss,
    clipped_value_loss,
    entropy_from_logits,
    get_policy_loss,
    gspo_policy_loss,
    logprobs_from_logits,
    ppo_policy_loss,
)
from rlx.trainer.algos.masked import (
    explained_variance,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from rlx.trainer.algos.overlong import overlong_penalty

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "CORRECTION_ACTIONS",
    "CORRECTION_LEVELS",
    "KL_ESTIMATORS",
    "MAX_LOG_RATIO",
    "POLICY_LOSSES",
    "AdvantageEstimator",
    "Metrics",
    "PolicyLoss",
    "aggregate_loss",
    "behavior_weights",
    "broadcast_to_tokens",
    "cispo_policy_loss",
    "clipped_value_loss",
    "compute_gae",
    "correction_bounds_problem",
    "entropy_from_logits",
    "explained_variance",
    "get_advantage_estimator",
    "get_aggregation",
    "get_kl_estimator",
    "get_policy_loss",
    "grpo_advantages",
    "gspo_policy_loss",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_penalized_rewards",
    "logprobs_from_logits",
    "loss_denominators",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "ppo_policy_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "rollout_correction_weights",
]
