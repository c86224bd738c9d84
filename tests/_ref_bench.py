"""Loop references for the advantage benchmark (``scripts/bench_advantages.py``).

Plain numpy, written the way the peers' reference code is: group estimators (GRPO, Dr. GRPO,
RLOO, REINFORCE++-baseline) loop over the prompts' groups in Python; reward-to-go and GAE loop
over time steps from the end, each step vectorised over the batch (verl's
``compute_gae_advantage_return`` / ``compute_reinforce_plus_plus_outcome_advantage`` loops).
Everything that is not the estimator's own loop (placing the score on the last token, k1 KL in
the reward, batch whitening) is vectorised numpy, as it is in verl.

Each function follows one recipe of ``jaxrl_llm.algorithms`` with its default hyperparameters
and the default numerics (group std ddof 0 with +1e-6 on the std; whitening ddof 0,
``rsqrt(var + 1e-8)``), so the benchmark can check that the jitted function it times computes
the same advantages. Inputs are ``[B, G, T]`` numpy arrays; the arithmetic runs in the inputs'
dtype (float32 in the benchmark, like the peers' torch code). Outputs are 0 on padding.
"""

from __future__ import annotations

import numpy as np

GROUP_STD_EPS = 1e-6
WHITEN_EPS = 1e-8


def token_rewards(reward_bg: np.ndarray, mask_bgt: np.ndarray) -> np.ndarray:
    """The sequence score on the last valid token of each completion (0 elsewhere)."""
    t_dim = mask_bgt.shape[-1]
    last_bg = t_dim - 1 - np.argmax(mask_bgt[..., ::-1], axis=-1)
    has_token_bg = mask_bgt.any(-1)
    r_bgt = np.zeros(mask_bgt.shape, reward_bg.dtype)
    np.put_along_axis(
        r_bgt, last_bg[..., None], np.where(has_token_bg, reward_bg, 0)[..., None], axis=-1
    )
    return r_bgt


def kl_k1_in_reward(r_bgt, logp_old_bgt, logp_ref_bgt, mask_bgt, beta: float) -> np.ndarray:
    """``r_t − β·(logp_old − logp_ref)`` on valid tokens."""
    return r_bgt - beta * np.where(mask_bgt, logp_old_bgt - logp_ref_bgt, 0)


def outcome_scores(r_bgt, mask_bgt) -> np.ndarray:
    """One number per sequence: the sum of its token rewards."""
    return np.where(mask_bgt, r_bgt, 0).sum(-1)


def group_loop(score_bg: np.ndarray, *, scale_by_std: bool, loo: bool = False) -> np.ndarray:
    """GRPO / Dr. GRPO / RLOO advantages per sequence, one Python iteration per group."""
    adv_bg = np.zeros_like(score_bg)
    for b in range(score_bg.shape[0]):
        s = score_bg[b]
        k = s.shape[0]
        if loo:
            baseline = (s.sum() - s) / max(k - 1, 1) if k > 1 else s
            adv_bg[b] = s - baseline
            continue
        a = s - s.mean()
        if scale_by_std:
            a = a / (np.sqrt(np.mean(a * a)) + GROUP_STD_EPS)
        adv_bg[b] = a
    return adv_bg


def reward_to_go_loop(r_bgt, mask_bgt, gamma: float) -> np.ndarray:
    """``G_t = r_t + γ·G_{t+1}`` on valid tokens, carried unchanged through masked ones;
    a loop over t from the end, vectorised over every sequence of the batch."""
    running = np.zeros(r_bgt.shape[:-1], r_bgt.dtype)
    out = np.zeros_like(r_bgt)
    for t in reversed(range(r_bgt.shape[-1])):
        m = mask_bgt[..., t]
        running = np.where(m, r_bgt[..., t] + gamma * running, running)
        out[..., t] = running
    return np.where(mask_bgt, out, 0)


def gae_loop(r_bgt, value_bgt, mask_bgt, gamma: float, lam: float) -> np.ndarray:
    """verl's GAE loop: ``δ_t = r_t + γV_next − V_t``, ``A_t = δ_t + γλA_next``; masked tokens
    carry ``V_next`` and ``A_next`` through unchanged."""
    next_value = np.zeros(r_bgt.shape[:-1], r_bgt.dtype)
    next_adv = np.zeros_like(next_value)
    out = np.zeros_like(r_bgt)
    for t in reversed(range(r_bgt.shape[-1])):
        m = mask_bgt[..., t]
        v = value_bgt[..., t]
        adv = r_bgt[..., t] + gamma * next_value - v + gamma * lam * next_adv
        next_value = np.where(m, v, next_value)
        next_adv = np.where(m, adv, next_adv)
        out[..., t] = next_adv
    return np.where(mask_bgt, out, 0)


def whiten(x_bgt, mask_bgt) -> np.ndarray:
    """``(x − μ)·rsqrt(σ² + 1e-8)`` over every valid token (ddof 0)."""
    values = x_bgt[mask_bgt]
    mean = values.mean() if values.size else 0.0
    var = np.mean((values - mean) ** 2) if values.size else 0.0
    return np.where(mask_bgt, (x_bgt - mean) / np.sqrt(var + WHITEN_EPS), 0)


def _broadcast(adv_bg, mask_bgt):
    return np.where(mask_bgt, adv_bg[..., None], 0)


ESTIMATOR = {
    "reinforce": "reward-to-go",
    "ppo": "GAE",
    "grpo": "GRPO",
    "dr_grpo": "Dr. GRPO",
    "rloo": "RLOO",
    "reinforce_pp": "REINFORCE++",
    "reinforce_pp_baseline": "REINFORCE++-baseline",
    "dapo": "GRPO",
    "gspo": "GRPO",
}


def recipe_advantages(name: str, data: dict, *, beta: float, gamma=1.0, lam=0.95) -> np.ndarray:
    """Advantages of recipe ``name`` (default numerics) on ``data``: a dict of ``reward_bg``,
    ``mask_bgt`` and, as needed, ``logp_old_bgt``, ``logp_ref_bgt``, ``value_bgt``.
    ``beta`` is the recipe's KL coefficient (used only by KL-in-reward recipes)."""
    mask = data["mask_bgt"]
    r = token_rewards(data["reward_bg"], mask)
    if name in ("reinforce", "ppo", "rloo", "reinforce_pp") and beta > 0:
        r = kl_k1_in_reward(r, data["logp_old_bgt"], data["logp_ref_bgt"], mask, beta)
    if name in ("reinforce", "reinforce_pp"):
        adv = reward_to_go_loop(r, mask, gamma)
        return whiten(adv, mask) if name == "reinforce_pp" else adv
    if name == "ppo":
        return whiten(gae_loop(r, data["value_bgt"], mask, gamma, lam), mask)
    score = outcome_scores(r, mask)
    if name == "rloo":
        return _broadcast(group_loop(score, scale_by_std=False, loo=True), mask)
    if name in ("grpo", "dapo", "gspo"):
        return _broadcast(group_loop(score, scale_by_std=True), mask)
    if name == "dr_grpo":
        return _broadcast(group_loop(score, scale_by_std=False), mask)
    if name == "reinforce_pp_baseline":
        return whiten(_broadcast(group_loop(score, scale_by_std=False), mask), mask)
    raise ValueError(f"no loop reference for recipe {name!r}")
