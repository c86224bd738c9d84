"""Named algorithms as recipes: compositions of the chain, a policy loss and an aggregation.

A :class:`~jaxrl_llm.recipe.Recipe` is a value made of functions, not a class to subclass: the
advantage chain, the objective (per-token loss, aggregation, KL and entropy terms), the critic,
the selection, and what it requires of the trainer (see :mod:`jaxrl_llm.recipe`). Each function
below is a docstring, like the paper it comes from, and one composition; variants are keyword
arguments (or ``functools.partial``), never subclasses. Hyperparameters are named as in the
literature: ``beta`` (KL coefficient), ``gamma``, ``lam``, ``clip_eps`` or
``clip_low``/``clip_high``, ``kl_estimator``; ``numerics`` picks this project's conventions or a
peer's preset (``"verl"``, ``"trl"``, ``"openrlhf"``; see :mod:`jaxrl_llm.numerics`).

Where the KL goes follows the seed documents: ``ppo``, ``reinforce``, ``rloo`` and
``reinforce_pp`` shape the token rewards with the KL between the rollout policy and the
reference (k1 by default), so it flows into returns and advantages; ``grpo``, ``dr_grpo``,
``reinforce_pp_baseline``, ``dapo`` and ``gspo`` add it as a separate per-token loss term on the
current policy (k3 by default).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

from jaxrl_llm import chain as ch
from jaxrl_llm import numerics as nm
from jaxrl_llm import recipe as rc
from jaxrl_llm.core import kl as _kl
from jaxrl_llm.core import policy_losses as pl
from jaxrl_llm.core import preference as pref
from jaxrl_llm.recipe import PreferenceRecipe, Recipe, Selection

# --------------------------------------------------------------------------------------------
# The recipes.


def reinforce(
    *,
    beta: float = 0.01,
    gamma: float = 1.0,
    kl_estimator: str = "k1",
    kl_controller: _kl.KLController | None = None,
    loss_agg_mode: str | None = None,
    entropy_coef: float = 0.0,
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """REINFORCE (Williams 1992, "Simple statistical gradient-following algorithms"):
    ``∇J = E[Σ_t G_t ∇log π(y_t | ·)]`` with ``G_t = Σ_{k≥t} γ^{k−t}(r_k − β·KL_k)``.

    Chain: KL in reward → reward-to-go. No baseline, no normalisation; loss ``−G_t·log π``
    summed over tokens and averaged over sequences (``seq-mean-token-sum``).
    """
    n = nm.resolve(numerics)
    return rc.make_recipe(
        "reinforce",
        numerics=n,
        advantage=ch.chain(
            *rc.reward_stages(n),
            *rc.kl_reward_stages(beta, kl_estimator, n, kl_controller),
            ch.discounted_return(gamma),
        ),
        objective=rc.reinforce_objective(
            agg=rc.agg_mode("seq-mean-token-sum", loss_agg_mode, n),
            entropy_coef=entropy_coef,
            text="−A·log π (vanilla policy gradient, no ratio, no clip)",
        ),
        hparams=dict(beta=beta, gamma=gamma, kl_estimator=kl_estimator, entropy_coef=entropy_coef),
    )


def ppo(
    *,
    beta: float = 0.05,
    gamma: float = 1.0,
    lam: float = 0.95,
    clip_eps: float = 0.2,
    clip_low: float | None = None,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    value_clip: float | None = 0.2,
    kl_estimator: str = "k1",
    kl_controller: _kl.KLController | None = None,
    loss_agg_mode: str | None = None,
    entropy_coef: float = 0.0,
    axis_name: str | None = None,
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """PPO for RLHF (Schulman et al. 2017, arXiv:1707.06347; Ouyang et al. 2022,
    arXiv:2203.02155): per-token rewards ``r_t − β·KL_t`` with the score on the last token, GAE
    with a learned critic (arXiv:1506.02438), batch-whitened advantages, clipped surrogate
    ``max(−A·ρ, −A·clip(ρ, 1−ε_low, 1+ε_high))`` (dual clip ``c`` optional, arXiv:1912.09729),
    clipped value loss regressed on the unwhitened GAE returns ``A_t + V_t``.
    """
    n = nm.resolve(numerics)
    low, high = rc.clip_range(clip_eps, clip_low, clip_high)
    returns = ch.chain(
        *rc.reward_stages(n),
        *rc.kl_reward_stages(beta, kl_estimator, n, kl_controller),
        ch.gae(gamma, lam),
    )
    return rc.make_recipe(
        "ppo",
        numerics=n,
        advantage=ch.chain(returns, rc.whiten_stage(n, axis_name)),
        objective=rc.ppo_objective(
            clip_low=low,
            clip_high=high,
            dual_clip=dual_clip,
            numerics=n,
            agg=rc.agg_mode("token-mean", loss_agg_mode, n),
            entropy_coef=entropy_coef,
            label="PPO clip + value loss",
            text=(
                f"clipped surrogate −min(ρA, clip(ρ, 1−{low:g}, 1+{high:g})A) + a clipped value "
                "loss"
            ),
        ),
        critic=rc.gae_critic(returns, value_clip=value_clip),
        hparams=dict(
            beta=beta,
            gamma=gamma,
            lam=lam,
            clip_low=low,
            clip_high=high,
            value_clip=value_clip,
            kl_estimator=kl_estimator,
            entropy_coef=entropy_coef,
        ),
    )


def grpo(
    *,
    beta: float = 0.04,
    clip_eps: float = 0.2,
    clip_low: float | None = None,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    scale_by_std: bool = True,
    kl_estimator: str = "k3",
    loss_agg_mode: str | None = None,
    entropy_coef: float = 0.0,
    pods_num_keep: int | None = None,
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300): ``A_i = (r_i − mean(r))/(std(r) +
    ε)`` over the G answers of a prompt, the same for every token; PPO's clipped surrogate;
    ``β·k3(π_θ ‖ π_ref)`` as a loss term; per-sequence token mean (``seq-mean-token-mean``).

    ``pods_num_keep`` enables PODS down-sampling (arXiv:2504.13818) before the advantages.
    """
    n = nm.resolve(numerics)
    low, high = rc.clip_range(clip_eps, clip_low, clip_high)
    return rc.make_recipe(
        "grpo",
        numerics=n,
        advantage=ch.chain(
            *rc.reward_stages(n), ch.outcome_return(), *rc.group_norm_stages(n, scale_by_std)
        ),
        objective=rc.ppo_objective(
            clip_low=low,
            clip_high=high,
            dual_clip=dual_clip,
            numerics=n,
            agg=rc.agg_mode("seq-mean-token-mean", loss_agg_mode, n),
            kl=rc.kl_term(beta, kl_estimator, n),
            entropy_coef=entropy_coef,
        ),
        selection=Selection(pods_num_keep=pods_num_keep),
        hparams=dict(
            beta=beta,
            clip_low=low,
            clip_high=high,
            scale_by_std=scale_by_std,
            pods_num_keep=pods_num_keep,
            kl_estimator=kl_estimator,
            entropy_coef=entropy_coef,
        ),
    )


def dr_grpo(
    *,
    beta: float = 0.0,
    clip_eps: float = 0.2,
    clip_low: float | None = None,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    max_completion_length: int | None = None,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    pods_num_keep: int | None = None,
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783):
    GRPO without the std division (``A_i = r_i − mean(r)``) and without the per-sequence length
    normaliser: token losses are summed and divided by a constant (``max_completion_length``,
    default the padded T) times the number of sequences (``seq-mean-token-sum-norm``); no KL.
    """
    n = nm.resolve(numerics)
    low, high = rc.clip_range(clip_eps, clip_low, clip_high)
    return rc.make_recipe(
        "dr_grpo",
        numerics=n,
        advantage=ch.chain(
            *rc.reward_stages(n), ch.outcome_return(), *rc.group_norm_stages(n, False)
        ),
        objective=rc.ppo_objective(
            clip_low=low,
            clip_high=high,
            dual_clip=dual_clip,
            numerics=n,
            agg="seq-mean-token-sum-norm",
            agg_norm=max_completion_length,
            kl=rc.kl_term(beta, kl_estimator, n),
            entropy_coef=entropy_coef,
            text=(
                f"clipped surrogate −min(ρA, clip(ρ, 1−{low:g}, 1+{high:g})A), token sums ÷ a "
                "constant length"
            ),
        ),
        selection=Selection(pods_num_keep=pods_num_keep),
        hparams=dict(
            beta=beta,
            clip_low=low,
            clip_high=high,
            max_completion_length=max_completion_length,
            pods_num_keep=pods_num_keep,
            kl_estimator=kl_estimator,
            entropy_coef=entropy_coef,
        ),
    )


def rloo(
    *,
    beta: float = 0.05,
    kl_estimator: str = "k1",
    kl_controller: _kl.KLController | None = None,
    loss_agg_mode: str | None = None,
    entropy_coef: float = 0.0,
    pods_num_keep: int | None = None,
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics", arXiv:2402.14740):
    ``A_i = R_i − 1/(G−1)·Σ_{j≠i} R_j`` with ``R_i = r_i − β·Σ_t KL_t`` (KL folded into the
    sequence reward), no std, no clipping: REINFORCE on whole sequences.
    """
    n = nm.resolve(numerics)
    return rc.make_recipe(
        "rloo",
        numerics=n,
        advantage=ch.chain(
            *rc.reward_stages(n),
            *rc.kl_reward_stages(beta, kl_estimator, n, kl_controller),
            ch.outcome_return(),
            ch.leave_one_out_baseline(singleton_baseline=n.loo_singleton_baseline),
        ),
        objective=rc.reinforce_objective(
            agg=rc.agg_mode("seq-mean-token-sum", loss_agg_mode, n),
            entropy_coef=entropy_coef,
            text="−A·log π summed over each sequence (REINFORCE, no ratio, no clip)",
        ),
        selection=Selection(pods_num_keep=pods_num_keep),
        hparams=dict(
            beta=beta,
            kl_estimator=kl_estimator,
            pods_num_keep=pods_num_keep,
            entropy_coef=entropy_coef,
        ),
    )


def reinforce_pp(
    *,
    beta: float = 0.01,
    gamma: float = 1.0,
    clip_eps: float = 0.2,
    clip_low: float | None = None,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    kl_estimator: str = "k1",
    kl_controller: _kl.KLController | None = None,
    loss_agg_mode: str | None = None,
    entropy_coef: float = 0.0,
    axis_name: str | None = None,
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """REINFORCE++ (Hu et al. 2025, arXiv:2501.03262): token rewards ``r_t − β·KL_t``,
    reward-to-go, then whitening over every valid token of the global batch (not per prompt);
    PPO's clipped surrogate with a token mean.
    """
    n = nm.resolve(numerics)
    low, high = rc.clip_range(clip_eps, clip_low, clip_high)
    return rc.make_recipe(
        "reinforce_pp",
        numerics=n,
        advantage=ch.chain(
            *rc.reward_stages(n),
            *rc.kl_reward_stages(beta, kl_estimator, n, kl_controller),
            ch.discounted_return(gamma),
            rc.whiten_stage(n, axis_name),
        ),
        objective=rc.ppo_objective(
            clip_low=low,
            clip_high=high,
            dual_clip=dual_clip,
            numerics=n,
            agg=rc.agg_mode("token-mean", loss_agg_mode, n),
            entropy_coef=entropy_coef,
        ),
        hparams=dict(
            beta=beta,
            gamma=gamma,
            clip_low=low,
            clip_high=high,
            kl_estimator=kl_estimator,
            entropy_coef=entropy_coef,
        ),
    )


def reinforce_pp_baseline(
    *,
    beta: float = 0.01,
    clip_eps: float = 0.2,
    clip_low: float | None = None,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    kl_estimator: str = "k3",
    loss_agg_mode: str | None = None,
    entropy_coef: float = 0.0,
    axis_name: str | None = None,
    pods_num_keep: int | None = None,
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """REINFORCE++-baseline (Hu et al. 2025, arXiv:2501.03262): ``r_i − mean(group)`` (no
    per-group std), then global batch whitening; ``β·k3`` as a loss term; clipped surrogate.
    """
    n = nm.resolve(numerics)
    low, high = rc.clip_range(clip_eps, clip_low, clip_high)
    return rc.make_recipe(
        "reinforce_pp_baseline",
        numerics=n,
        advantage=ch.chain(
            *rc.reward_stages(n),
            ch.outcome_return(),
            *rc.group_norm_stages(n, False),
            rc.whiten_stage(n, axis_name),
        ),
        objective=rc.ppo_objective(
            clip_low=low,
            clip_high=high,
            dual_clip=dual_clip,
            numerics=n,
            agg=rc.agg_mode("token-mean", loss_agg_mode, n),
            kl=rc.kl_term(beta, kl_estimator, n),
            entropy_coef=entropy_coef,
        ),
        selection=Selection(pods_num_keep=pods_num_keep),
        hparams=dict(
            beta=beta,
            clip_low=low,
            clip_high=high,
            pods_num_keep=pods_num_keep,
            kl_estimator=kl_estimator,
            entropy_coef=entropy_coef,
        ),
    )


def dapo(
    *,
    beta: float = 0.0,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = None,
    max_length: int | None = None,
    overlong_buffer: int | None = None,
    overlong_penalty: float = 1.0,
    dynamic_sampling: bool = True,
    kl_estimator: str = "k3",
    loss_agg_mode: str | None = None,
    entropy_coef: float = 0.0,
    pods_num_keep: int | None = None,
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """DAPO (Yu et al. 2025, arXiv:2503.14476): GRPO's group-normalised advantage with
    clip-higher (``ε_low = 0.2``, ``ε_high = 0.28``), a token mean over the whole batch,
    dynamic sampling (prompts whose answers all score the same are dropped and refilled), soft
    overlong punishment (when ``max_length`` and ``overlong_buffer`` are given) and no KL.
    """
    n = nm.resolve(numerics)
    if (max_length is None) != (overlong_buffer is None):
        raise ValueError(
            "dapo: give both `max_length` and `overlong_buffer` for overlong shaping, or neither"
        )
    shaping = (
        ()
        if max_length is None
        else (
            ch.overlong_penalty(
                max_length=max_length,
                buffer_length=overlong_buffer,
                penalty_factor=overlong_penalty,
            ),
        )
    )
    return rc.make_recipe(
        "dapo",
        numerics=n,
        advantage=ch.chain(
            *rc.reward_stages(n), *shaping, ch.outcome_return(), *rc.group_norm_stages(n, True)
        ),
        objective=rc.ppo_objective(
            clip_low=float(clip_low),
            clip_high=float(clip_high),
            dual_clip=dual_clip,
            numerics=n,
            agg=loss_agg_mode or "token-mean",
            kl=rc.kl_term(beta, kl_estimator, n),
            entropy_coef=entropy_coef,
            label="PPO clip-higher",
            text=(
                f"clip-higher surrogate −min(ρA, clip(ρ, 1−{clip_low:g}, 1+{clip_high:g})A), "
                "token mean over the batch"
            ),
        ),
        selection=Selection(pods_num_keep=pods_num_keep, dynamic_sampling=dynamic_sampling),
        hparams=dict(
            beta=beta,
            clip_low=clip_low,
            clip_high=clip_high,
            max_length=max_length,
            overlong_buffer=overlong_buffer,
            dynamic_sampling=dynamic_sampling,
            kl_estimator=kl_estimator,
            entropy_coef=entropy_coef,
            pods_num_keep=pods_num_keep,
        ),
    )


def gspo(
    *,
    beta: float = 0.0,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    pods_num_keep: int | None = None,
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071): GRPO's
    advantage with a sequence-level importance ratio ``s_i = exp(mean_t(log π − log π_old))``
    clipped to ``[1−ε_low, 1+ε_high]`` (paper: 3e-4, 4e-4); ``seq-mean-token-mean``.
    """
    n = nm.resolve(numerics)
    clip = dict(
        clip_low=float(clip_low), clip_high=float(clip_high), log_ratio_clamp=n.gspo_log_ratio_clamp
    )
    return rc.make_recipe(
        "gspo",
        numerics=n,
        advantage=ch.chain(
            *rc.reward_stages(n), ch.outcome_return(), *rc.group_norm_stages(n, True)
        ),
        objective=rc.objective(
            functools.partial(pl.gspo_loss, **clip),
            agg="seq-mean-token-mean",
            ratio_metrics=functools.partial(pl.ratio_metrics, **clip),
            kl=rc.kl_term(beta, kl_estimator, n),
            entropy_coef=entropy_coef,
            label="GSPO sequence ratio",
            text=(
                f"sequence-ratio surrogate −min(sA, clip(s, 1−{clip_low:g}, 1+{clip_high:g})A), "
                "s = exp(mean_t log ρ_t)"
            ),
        ),
        selection=Selection(pods_num_keep=pods_num_keep),
        hparams=dict(
            beta=beta,
            clip_low=clip_low,
            clip_high=clip_high,
            kl_estimator=kl_estimator,
            entropy_coef=entropy_coef,
            pods_num_keep=pods_num_keep,
        ),
    )


def _reference_losses(
    beta: float, label_smoothing: float, discopop_tau: float
) -> dict[str, Callable]:
    """``loss_type -> PairLogprobs -> f32[P]`` for the losses against a reference."""

    def with_ref(fn: Callable, *, lengths: bool = False, **kw) -> Callable:
        def loss(pairs: rc.PairLogprobs):
            if pairs.ref_chosen_p is None or pairs.ref_rejected_p is None:
                raise ValueError("dpo: reference log-probs are required (ref_chosen_p)")
            args = (pairs.logp_chosen_p, pairs.logp_rejected_p, pairs.ref_chosen_p)
            args += (pairs.ref_rejected_p,)
            if lengths:
                args += (pairs.len_chosen_p, pairs.len_rejected_p)
            return fn(*args, beta=beta, **kw)

        return loss

    smoothed = dict(label_smoothing=label_smoothing)
    return {
        "sigmoid": with_ref(pref.dpo_sigmoid_loss, **smoothed),
        "ipo": with_ref(pref.ipo_loss, lengths=True),
        "hinge": with_ref(pref.hinge_loss),
        "robust": with_ref(pref.robust_dpo_loss, **smoothed),
        "exo_pair": with_ref(pref.exo_pair_loss, label_smoothing=label_smoothing or 1e-3),
        "nca_pair": with_ref(pref.nca_pair_loss),
        "bco_pair": with_ref(pref.bco_pair_loss),
        "sppo_hard": with_ref(pref.sppo_hard_loss),
        "aot": with_ref(pref.aot_loss, paired=True, **smoothed),
        "aot_unpaired": with_ref(pref.aot_loss, paired=False, **smoothed),
        "apo_zero": with_ref(pref.apo_loss, anchor="zero"),
        "apo_down": with_ref(pref.apo_loss, anchor="down"),
        "discopop": with_ref(pref.discopop_loss, tau=discopop_tau),
    }


_PREFERENCE_TEXT = {
    "sigmoid": "−log σ(βΔ) on the policy-vs-reference log-ratio margin Δ",
    "ipo": "(Δ̄ − 1/(2β))², Δ̄ the length-averaged margin",
    "hinge": "max(0, 1 − βΔ)",
    "robust": "noise-robust −[(1−ε)log σ(βΔ) − ε log σ(−βΔ)]/(1−2ε)",
    "simpo": "−log σ(β(logπ(y_w)/|y_w| − logπ(y_l)/|y_l|) − γ), reference-free",
    "exo_pair": "KL(σ(βΔ) ‖ 1−ε), the reverse KL to the labels (EXO)",
    "nca_pair": "−log σ(βρ_w) − ½log σ(−βρ_w) − ½log σ(−βρ_l) (NCA)",
    "bco_pair": "−log σ(βρ_w) − log σ(−βρ_l), a chosen-vs-rejected classifier (BCO)",
    "sppo_hard": "(ρ_w − 1/(2β))² + (ρ_l + 1/(2β))² (SPPO, hard probabilities)",
    "aot": "−log σ(β(sort(m) − sort(m_ref))) over the batch's sorted margins (AOT)",
    "aot_unpaired": "−log σ(β(sort(ρ_w) − sort(ρ_l))) over the batch (AOT, unpaired)",
    "apo_zero": "(1 − σ(βρ_w)) + σ(βρ_l): raise chosen, lower rejected (APO-zero)",
    "apo_down": "σ(βρ_w) + 1 − σ(βΔ): lower both, rejected more (APO-down)",
    "discopop": "(1−σ(βΔ/τ))·(−log σ(βΔ)) + σ(βΔ/τ)·exp(−βΔ) (DiscoPOP)",
}
# Former names of a loss type (TRL renamed "aot_pair" to "aot_unpaired").
_PREFERENCE_ALIASES = {"aot_pair": "aot_unpaired"}


def _wpo_weighted(loss: Callable) -> Callable:
    """``loss`` with each pair's value times WPO's ``w(y_w)·w(y_l)`` (a constant)."""

    def weighted(pairs: rc.PairLogprobs):
        if pairs.weight_chosen_p is None or pairs.weight_rejected_p is None:
            raise ValueError("dpo: use_weighting needs weight_chosen_p and weight_rejected_p")
        return loss(pairs) * pref.wpo_pair_weights(pairs.weight_chosen_p, pairs.weight_rejected_p)

    return weighted


def dpo(
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    discopop_tau: float = 0.05,
    use_weighting: bool = False,
    numerics: nm.Numerics | str | None = None,
) -> PreferenceRecipe:
    """DPO (Rafailov et al. 2023, arXiv:2305.18290) and its family, offline on preference pairs:
    ``−log σ(β[(log π(y_w) − log π_ref(y_w)) − (log π(y_l) − log π_ref(y_l))])``.

    ``loss_type`` (TRL's names; formulas and papers in :mod:`jaxrl_llm.core.preference`):
    ``"sigmoid"`` (DPO; cDPO with ``label_smoothing``), ``"ipo"`` (Azar et al.,
    length-averaged), ``"hinge"`` (SLiC), ``"robust"`` (rDPO), ``"simpo"`` (reference-free,
    length-normalised, margin ``simpo_gamma``), ``"exo_pair"`` (EXO; ``label_smoothing`` is its
    ε, 1e-3 when 0), ``"nca_pair"``, ``"bco_pair"``, ``"sppo_hard"``, ``"aot"`` /
    ``"aot_unpaired"`` (formerly ``"aot_pair"``; batch-sorted, so the loss depends on the
    micro-batch), ``"apo_zero"`` / ``"apo_down"``, ``"discopop"`` (gate temperature
    ``discopop_tau``). ``use_weighting`` multiplies each pair's loss by WPO's weights (Zhou et
    al. 2024), which the trainer computes from the policy's logits. DPO is the seeds' side
    branch: no reward model, no rollouts, no advantage; :func:`jaxrl_llm.compute_advantages`
    does not apply to it.
    """
    nm.resolve(numerics)  # validates the name; no preset changes a preference loss
    loss_type = _PREFERENCE_ALIASES.get(loss_type, loss_type)
    if loss_type not in _PREFERENCE_TEXT:
        raise ValueError(f"dpo: loss_type={loss_type!r}; expected one of {tuple(_PREFERENCE_TEXT)}")
    if beta <= 0:
        raise ValueError(f"dpo: `beta` must be > 0, got {beta!r}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"dpo: `label_smoothing` must be in [0, 0.5), got {label_smoothing!r}")
    if not discopop_tau > 0:
        raise ValueError(f"dpo: `discopop_tau` must be > 0, got {discopop_tau!r}")
    if loss_type == "simpo":

        def loss(pairs: rc.PairLogprobs):
            return pref.simpo_loss(
                pairs.logp_chosen_p,
                pairs.logp_rejected_p,
                pairs.len_chosen_p,
                pairs.len_rejected_p,
                beta=beta,
                gamma=simpo_gamma,
            )

        requires = {rc.PREFERENCE_PAIRS}
    else:
        loss = _reference_losses(beta, label_smoothing, discopop_tau)[loss_type]
        requires = {rc.PREFERENCE_PAIRS, rc.REFERENCE_LOGPROBS}
    label, text = f"DPO {loss_type}", _PREFERENCE_TEXT[loss_type]
    if use_weighting:
        loss = _wpo_weighted(loss)
        requires.add(rc.SEQUENCE_WEIGHTS)
        label, text = label + " + WPO", text + ", weighted by WPO's w(y_w)·w(y_l)"
    return PreferenceRecipe(
        name="dpo",
        loss=loss,
        beta=float(beta),
        requires=frozenset(requires),
        label=label,
        text=text,
        hparams=types.MappingProxyType(
            dict(
                beta=beta,
                loss_type=loss_type,
                label_smoothing=label_smoothing,
                discopop_tau=discopop_tau,
                use_weighting=use_weighting,
            )
        ),
    )


RECIPES: dict[str, Callable[..., rc.AnyRecipe]] = {
    "reinforce": reinforce,
    "ppo": ppo,
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
    "reinforce_pp_baseline": reinforce_pp_baseline,
    "dapo": dapo,
    "gspo": gspo,
    "dpo": dpo,
}

ONLINE_RECIPES = tuple(name for name, fn in RECIPES.items() if isinstance(fn(), Recipe))


def get(name: str, **hparams) -> rc.AnyRecipe:
    """Builds the recipe called ``name`` (the CLI and config layer's lookup)."""
    if name not in RECIPES:
        raise ValueError(f"unknown algorithm {name!r}; available: {', '.join(RECIPES)}")
    return RECIPES[name](**hparams)


__all__ = [
    "ONLINE_RECIPES",
    "RECIPES",
    "PreferenceRecipe",
    "Recipe",
    "Selection",
    "dapo",
    "dpo",
    "dr_grpo",
    "get",
    "grpo",
    "gspo",
    "ppo",
    "reinforce",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "rloo",
]
