"""Pure RL math for language models, listed in the order of the chain.

Algorithms differ in how a raw reward becomes an advantage. Each arrow below is one or more
pure, jit-able functions of this package (jax, chex and numpy only: no config objects, no
string dispatch, hyperparameters keyword-only, math in float32):

    raw reward      r_bg placed on the last valid token: r_bgt   masked.place_on_last_token
        |                                                        selection.overlong_reward_penalty
        v  + KL     r_t - beta * kl_t                            kl.kl_k1 ... kl.kl_k3_st,
        |                                                        kl.kl_in_reward, controllers
        v
    return          G_t (reward-to-go) or GAE                    returns.discounted_returns,
        |                                                        returns.gae
        v  - baseline   b: group mean, leave-one-out, ...        baselines.*
    advantage       A = G - b
        |
        v  normalize    / group std, / batch std, whiten        normalization.*
    x grad log pi   per-token policy loss -> (sum, denominator)  policy_losses.*, aggregation.*
        |
        v
    update          the optimizer step (optax), outside core

Rollout correction (``rollout_correction``) reweights or masks the per-token policy-gradient
terms when the sampler's log-probs differ from the trainer's (numerics, stale weights).

Beside the chain: the preference (DPO family) losses, token log-probs and entropies from
logits, masked statistics, and sample selection (PODS, DAPO's group filter).

The names below are the same objects as in their modules, which stay importable
(``jaxrl_llm.core.gae is jaxrl_llm.core.returns.gae``). Lookups from a string name to a
function belong to the recipe layer and are not exported here.
"""

# ruff: noqa: I001  (the imports follow the chain, not the alphabet)

# --- raw reward: a sequence score enters on its last valid token; DAPO's length shaping ------
from jaxrl_llm.core.masked import place_on_last_token
from jaxrl_llm.core.selection import overlong_reward_penalty

# --- + KL: per-token estimators, KL folded into the reward, coefficient controllers --------
from jaxrl_llm.core.kl import (
    kl_k1,
    kl_abs,
    kl_k2,
    kl_k3,
    kl_k1_st,
    kl_k3_st,
    kl_in_reward,
    mean_sequence_kl,
    KLControllerState,
    KLController,
    fixed_kl_controller,
    adaptive_kl_controller,
)

# --- return: credit to tokens, and the sequence score read off the first token --------------
from jaxrl_llm.core.returns import discounted_returns_t, discounted_returns, gae_t, gae
from jaxrl_llm.core.masked import value_at_first_token

# --- - baseline -> advantage (A = score - baseline) ---------------------------------------
from jaxrl_llm.core.baselines import (
    group_count,
    group_mean_baseline,
    leave_one_out_baseline,
    length_weighted_baseline,
    given_baseline,
    critic_baseline,
    passk_advantage,
    gpg_scale,
)

# --- normalize -------------------------------------------------------------------------------
from jaxrl_llm.core.normalization import (
    group_std,
    scale_by_group_std,
    scale_by_batch_std,
    batch_whiten,
    normalize_then_sum,
)

# --- x grad log pi: per-token policy and value losses ---------------------------------------
from jaxrl_llm.core.policy_losses import (
    reinforce_loss,
    ppo_clip_loss,
    gspo_loss,
    cispo_loss,
    sapo_loss,
    gmpo_loss,
    clip_cov_loss,
    kl_cov_loss,
    dro_loss,
    dppo_loss,
    vespo_loss,
    ratio_metrics,
    value_loss,
    entropy_bonus,
    truncated_importance_weight,
)

# --- x grad log pi: rollout correction (sampler ≠ trainer, stale samples): IS weights, masks ----
from jaxrl_llm.core.rollout_correction import (
    importance_log_ratio,
    token_importance_weights,
    sequence_importance_weights,
    sequence_statistic,
    truncate_weights,
    within_bounds,
    rejection_divergence,
    check_correction_bounds,
    Correction,
    correction_weights,
    correction_metrics,
    decoupled_ppo_loss,
    weighted_reinforce_loss,
)

# --- x grad log pi: aggregation of per-token losses into (sum, denominator) pairs ----------
from jaxrl_llm.core.aggregation import (
    token_mean,
    token_sum,
    seq_mean_token_mean,
    seq_mean_token_sum,
    seq_mean_token_sum_norm,
    combine,
    finalize,
)

# --- update: the optimizer step is optax's (jaxrl_llm.train.update), nothing here -----------

# --- preference losses (DPO family): sequence log-probs, losses, implicit rewards ----------
from jaxrl_llm.core.preference import (
    sequence_logprob,
    sequence_length,
    dpo_sigmoid_loss,
    robust_dpo_loss,
    ipo_loss,
    hinge_loss,
    simpo_loss,
    exo_pair_loss,
    nca_pair_loss,
    bco_pair_loss,
    sppo_hard_loss,
    aot_loss,
    apo_loss,
    discopop_loss,
    wpo_weights,
    wpo_pair_weights,
    preference_rewards,
)

# --- log-prob helpers: token log-probs and entropies from logits, in f32 -------------------
from jaxrl_llm.core.logprobs import (
    token_logprobs,
    token_entropy,
    token_logprobs_and_entropy,
    token_logprobs_and_log_sum_sq,
)

# --- masked statistics ------------------------------------------------------------------------
from jaxrl_llm.core.masked import (
    masked_sum,
    masked_count,
    masked_mean,
    masked_var,
    masked_whiten,
    first_valid_index,
    last_valid_index,
)

# --- selection: which rollouts train -----------------------------------------------------
from jaxrl_llm.core.selection import pods_max_variance, dapo_group_filter

__all__ = [  # noqa: RUF022 (chain order, as the imports)
    # raw reward
    "place_on_last_token",
    "overlong_reward_penalty",
    # + KL
    "kl_k1",
    "kl_abs",
    "kl_k2",
    "kl_k3",
    "kl_k1_st",
    "kl_k3_st",
    "kl_in_reward",
    "mean_sequence_kl",
    "KLControllerState",
    "KLController",
    "fixed_kl_controller",
    "adaptive_kl_controller",
    # return
    "discounted_returns_t",
    "discounted_returns",
    "gae_t",
    "gae",
    "value_at_first_token",
    # - baseline -> advantage
    "group_count",
    "group_mean_baseline",
    "leave_one_out_baseline",
    "length_weighted_baseline",
    "given_baseline",
    "critic_baseline",
    "passk_advantage",
    "gpg_scale",
    # normalize
    "group_std",
    "scale_by_group_std",
    "scale_by_batch_std",
    "batch_whiten",
    "normalize_then_sum",
    # x grad log pi: policy and value losses
    "reinforce_loss",
    "ppo_clip_loss",
    "gspo_loss",
    "cispo_loss",
    "sapo_loss",
    "gmpo_loss",
    "clip_cov_loss",
    "kl_cov_loss",
    "dro_loss",
    "dppo_loss",
    "vespo_loss",
    "ratio_metrics",
    "value_loss",
    "entropy_bonus",
    "truncated_importance_weight",
    # x grad log pi: rollout correction
    "importance_log_ratio",
    "token_importance_weights",
    "sequence_importance_weights",
    "sequence_statistic",
    "truncate_weights",
    "within_bounds",
    "rejection_divergence",
    "check_correction_bounds",
    "Correction",
    "correction_weights",
    "correction_metrics",
    "decoupled_ppo_loss",
    "weighted_reinforce_loss",
    # x grad log pi: aggregation
    "token_mean",
    "token_sum",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
    "combine",
    "finalize",
    # preference losses
    "sequence_logprob",
    "sequence_length",
    "dpo_sigmoid_loss",
    "robust_dpo_loss",
    "ipo_loss",
    "hinge_loss",
    "simpo_loss",
    "exo_pair_loss",
    "nca_pair_loss",
    "bco_pair_loss",
    "sppo_hard_loss",
    "aot_loss",
    "apo_loss",
    "discopop_loss",
    "wpo_weights",
    "wpo_pair_weights",
    "preference_rewards",
    # log-prob helpers
    "token_logprobs",
    "token_entropy",
    "token_logprobs_and_entropy",
    "token_logprobs_and_log_sum_sq",
    # masked statistics
    "masked_sum",
    "masked_count",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "first_valid_index",
    "last_valid_index",
    # selection
    "pods_max_variance",
    "dapo_group_filter",
]
