"""Numerical conventions: this project's defaults and presets that reproduce verl, TRL, OpenRLHF.

Peers agree on the formulas and disagree on small choices that change numbers: the ddof of a
group std, where eps goes, whether whitening uses an eps inside the rsqrt or a variance floor,
what a group of one sample gets, which clamps guard exp(), and the loss denominator. A
:class:`Numerics` value names every such choice; recipes read it when they are *built* (never
inside traced math) and pass plain keyword arguments down to ``jaxrl_llm.core``. See
``docs/numerics.md`` for each difference with its formula and for how verl, TRL and OpenRLHF
compute each estimator (where the peers' numbers come from).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Numerics:
    """Every numerical convention a recipe depends on.

    Attributes:
      name: preset name, for logs and ``explain``.
      group_std_ddof: ddof of the group std in GRPO-style normalisation.
      group_std_eps: added to the group std: ``(r − μ)/(σ + eps)``.
      group_singleton_baseline: baseline of a one-member group under the group mean; ``None``
        means the member's own score (advantage 0), a number means that constant (verl: 0, so
        ``A = r``).
      loo_singleton_baseline: the same rule for leave-one-out (verl's loop RLOO: 0, so
        ``A = r``; TRL and verl's vectorised RLOO: advantage 0).
      singleton_std: the std used for a one-member group (no spread to measure).
      whiten_ddof: ddof of the variance in batch whitening.
      whiten_eps: eps of batch whitening.
      whiten_eps_as_floor: ``rsqrt(max(var, eps))`` (OpenRLHF) instead of ``rsqrt(var + eps)``.
      log_ratio_clamp: clamp of ``logπ − logπ_old`` before ``exp`` in PPO-style ratios.
      gspo_log_ratio_clamp: clamp (upper) of GSPO's sequence log-ratio.
      kl_log_ratio_clamp: clamp of ``−Δ`` inside k3's ``exp`` (verl 20).
      kl_value_clamp: clamp of the KL estimate's value (verl 10 on k3; OpenRLHF 10 on all).
      kl_value_clamp_all: apply ``kl_value_clamp`` to every estimator, not only k3.
      dual_clip: dual-clip constant ``c`` for PPO with ``A < 0`` (verl: 3.0, always on).
      reward_clip: clip of the sequence score before the chain (OpenRLHF ±10).
      loss_agg_mode: loss aggregation for every recipe whose aggregation is not its defining
        feature (all but Dr. GRPO and GSPO); ``None`` keeps each recipe's own (the paper's).
      skip_masked_tokens: GAE and discounted returns carry their recursion through interior
        masked tokens (verl); False treats them as steps with r = V = 0 that are discounted
        (OpenRLHF's ``get_advantages_and_returns`` / ``get_cumulative_returns``).
      shaping_after_baseline: for outcome estimators with a baseline, take the baseline (and
        group std) on the raw score, then apply the score clip and add the KL in the reward as
        its per-token reward-to-go (OpenRLHF's ``compute_advantages_and_returns``); False is the
        seeds' chain (clip, KL into the reward, return, baseline).
      group_kl_in_reward: ``grpo``, ``dr_grpo`` and ``reinforce_pp_baseline`` put their KL in
        the reward (k1 by default) instead of the loss when their ``kl_in_reward`` is not given
        (OpenRLHF's default for ``group_norm``, ``dr_grpo``, ``reinforce_baseline``).
      ipo_length_normalize: IPO on the length-averaged margin (TRL) or the raw token-summed
        margin (OpenRLHF's ``DPOLoss(ipo=True)``).
      recipe_loss_agg_modes: ``(recipe, mode)`` pairs that beat ``loss_agg_mode`` for one
        recipe, including those whose aggregation is otherwise fixed: GSPO (verl and TRL:
        token-mean, OpenRLHF: seq-mean-token-mean), RLOO (TRL: a mean over sequences of the
        sequence loss, ``seq-mean-token-sum``) and Dr. GRPO (OpenRLHF's ``dr_grpo`` estimator
        keeps the actor's token-mean loss).
      value_clip: the default value-loss clip of ``ppo`` (``None``: the recipe's 0.2).
      token_mean_kl: the KL loss term is a token mean over the minibatch whatever the loss's
        aggregation (OpenRLHF's ``kl_loss = masked_mean(kl, action_mask)`` in
        ``PPOActor``); False: it follows the loss's mode (verl, TRL).
      token_mean_entropy: the same for the entropy bonus (OpenRLHF's ``masked_mean(entropy)``,
        TRL's ``Σ m H / Σ m`` for every ``loss_type``); False: it follows the loss's mode (verl).
      dpo_sigmoid_label_smoothing: DPO's sigmoid loss applies ``label_smoothing`` (cDPO,
        Mitchell 2023; OpenRLHF, ours); False: TRL 1.16's sigmoid, which ignores it.
      critic_follows_actor_agg: the critic's value loss is aggregated with the actor's
        ``loss_agg_mode`` (verl: ``critic.loss_agg_mode`` interpolates the actor's;
        ``compute_value_loss`` passes it to ``agg_loss``) instead of a token mean.
    """

    name: str = "jaxrl_llm"
    group_std_ddof: int = 0
    group_std_eps: float = 1e-6
    group_singleton_baseline: float | None = None
    loo_singleton_baseline: float | None = None
    singleton_std: float = 1.0
    whiten_ddof: int = 0
    whiten_eps: float = 1e-8
    whiten_eps_as_floor: bool = False
    log_ratio_clamp: float | None = 20.0
    gspo_log_ratio_clamp: float | None = 10.0
    kl_log_ratio_clamp: float | None = 20.0
    kl_value_clamp: float | None = None
    kl_value_clamp_all: bool = False
    dual_clip: float | None = None
    reward_clip: tuple[float, float] | None = None
    loss_agg_mode: str | None = None
    skip_masked_tokens: bool = True
    shaping_after_baseline: bool = False
    group_kl_in_reward: bool = False
    ipo_length_normalize: bool = True
    recipe_loss_agg_modes: tuple[tuple[str, str], ...] = ()
    value_clip: float | None = None
    critic_follows_actor_agg: bool = False
    token_mean_kl: bool = False
    token_mean_entropy: bool = False
    dpo_sigmoid_label_smoothing: bool = True

    def kl_kwargs(self, estimator: str) -> dict:
        """Clamp keywords for a KL estimator under these conventions."""
        base = estimator.rstrip("+")
        is_k3 = base in ("k3", "low_var_kl")
        kwargs = {}
        if is_k3 and self.kl_log_ratio_clamp is not None:
            kwargs["log_ratio_clamp"] = self.kl_log_ratio_clamp
        if self.kl_value_clamp is not None and (is_k3 or self.kl_value_clamp_all):
            kwargs["value_clamp"] = self.kl_value_clamp
        return kwargs

    def recipe_loss_agg_mode(self, recipe: str) -> str | None:
        """This preset's aggregation for ``recipe``, or ``None`` (see ``recipe_loss_agg_modes``)."""
        return dict(self.recipe_loss_agg_modes).get(recipe)


DEFAULT = Numerics()

VERL = Numerics(
    name="verl",
    group_std_ddof=1,
    group_std_eps=1e-6,
    group_singleton_baseline=0.0,
    loo_singleton_baseline=0.0,
    singleton_std=1.0,
    whiten_ddof=1,
    whiten_eps=1e-8,
    whiten_eps_as_floor=False,
    log_ratio_clamp=20.0,
    gspo_log_ratio_clamp=10.0,
    kl_log_ratio_clamp=20.0,
    kl_value_clamp=10.0,
    kl_value_clamp_all=False,
    dual_clip=3.0,
    reward_clip=None,
    loss_agg_mode="token-mean",
    recipe_loss_agg_modes=(("gspo", "token-mean"),),
    value_clip=0.5,
    critic_follows_actor_agg=True,
)

TRL = Numerics(
    name="trl",
    group_std_ddof=1,
    group_std_eps=1e-4,
    group_singleton_baseline=None,
    loo_singleton_baseline=None,
    singleton_std=1.0,
    whiten_ddof=1,
    whiten_eps=1e-8,
    whiten_eps_as_floor=False,
    log_ratio_clamp=None,
    gspo_log_ratio_clamp=None,
    kl_log_ratio_clamp=None,
    kl_value_clamp=None,
    dual_clip=None,
    reward_clip=None,
    loss_agg_mode="token-mean",
    recipe_loss_agg_modes=(("gspo", "token-mean"), ("rloo", "seq-mean-token-sum")),
    token_mean_entropy=True,
    dpo_sigmoid_label_smoothing=False,
)

OPENRLHF = Numerics(
    name="openrlhf",
    group_std_ddof=1,
    group_std_eps=1e-9,
    group_singleton_baseline=None,
    loo_singleton_baseline=None,
    singleton_std=1.0,
    whiten_ddof=0,
    whiten_eps=1e-8,
    whiten_eps_as_floor=True,
    log_ratio_clamp=20.0,
    gspo_log_ratio_clamp=None,
    kl_log_ratio_clamp=None,
    kl_value_clamp=10.0,
    kl_value_clamp_all=True,
    dual_clip=None,
    reward_clip=(-10.0, 10.0),
    loss_agg_mode="token-mean",
    skip_masked_tokens=False,
    shaping_after_baseline=True,
    group_kl_in_reward=True,
    ipo_length_normalize=False,
    recipe_loss_agg_modes=(("gspo", "seq-mean-token-mean"), ("dr_grpo", "token-mean")),
    value_clip=0.5,
    token_mean_kl=True,
    token_mean_entropy=True,
)

PRESETS: dict[str, Numerics] = {
    "default": DEFAULT,
    "jaxrl_llm": DEFAULT,
    "verl": VERL,
    "trl": TRL,
    "openrlhf": OPENRLHF,
}


def resolve(numerics: Numerics | str | None) -> Numerics:
    """A :class:`Numerics` from a preset name, an instance, or ``None`` (the default)."""
    if numerics is None:
        return DEFAULT
    if isinstance(numerics, Numerics):
        return numerics
    if isinstance(numerics, str) and numerics in PRESETS:
        return PRESETS[numerics]
    raise ValueError(
        f"numerics={numerics!r} is not a preset; expected one of {sorted(PRESETS)} or a "
        "jaxrl_llm.numerics.Numerics instance"
    )
