"""Slow, obvious references for whole recipes: loops over prompts, answers and tokens, float64.

Each follows the recipe's documented composition literally (see jaxrl_llm/algorithms.py), with
the numerics of a preset, so the fast chain can be checked number by number.
"""

from __future__ import annotations

import math

import numpy as np

from jaxrl_llm.numerics import Numerics


def _valid(mask_t):
    return [t for t in range(len(mask_t)) if mask_t[t]]


def _kl(estimator, lp, lr, n: Numerics):
    d = lp - lr
    base = estimator.rstrip("+")
    if base in ("k1", "kl"):
        v = d
    elif base == "abs":
        v = abs(d)
    elif base in ("k2", "mse"):
        v = 0.5 * d * d
    else:  # k3
        x = -d
        if n.kl_log_ratio_clamp is not None:
            x = min(max(x, -n.kl_log_ratio_clamp), n.kl_log_ratio_clamp)
        v = math.exp(x) - x - 1.0
    is_k3 = base in ("k3", "low_var_kl")
    if n.kl_value_clamp is not None and (is_k3 or n.kl_value_clamp_all):
        v = min(max(v, -n.kl_value_clamp), n.kl_value_clamp)
    return v


def _std(values, ddof):
    k = len(values)
    if k <= ddof:
        return None
    mu = sum(values) / k
    return math.sqrt(sum((v - mu) ** 2 for v in values) / (k - ddof))


def reference_advantages(name: str, rollout, n: Numerics, **hp) -> np.ndarray:
    """Advantages of recipe ``name`` built with numerics ``n`` and hyperparameters ``hp``."""
    reward = np.asarray(rollout.reward_bg, np.float64)
    mask = np.asarray(rollout.mask_bgt, bool)
    b_dim, g_dim, t_dim = mask.shape
    members = (
        np.ones((b_dim, g_dim), bool) if rollout.mask_bg is None else np.asarray(rollout.mask_bg)
    )
    mask = mask & members[..., None]
    lp_old = None if rollout.logp_old_bgt is None else np.asarray(rollout.logp_old_bgt, np.float64)
    lp_ref = None if rollout.logp_ref_bgt is None else np.asarray(rollout.logp_ref_bgt, np.float64)
    values = None if rollout.value_bgt is None else np.asarray(rollout.value_bgt, np.float64)
    beta = hp.get("beta", 0.0)
    gamma = hp.get("gamma", 1.0)
    lam = hp.get("lam", 0.95)
    estimator = hp.get("kl_estimator", "k1")
    kl_in_reward = name in ("reinforce", "ppo", "rloo", "reinforce_pp") and beta > 0

    # 1. token rewards: score on the last valid token; shaping.
    r = np.zeros((b_dim, g_dim, t_dim))
    for b in range(b_dim):
        for g in range(g_dim):
            valid = _valid(mask[b, g])
            if not valid:
                continue
            s = reward[b, g]
            if n.reward_clip is not None:
                s = min(max(s, n.reward_clip[0]), n.reward_clip[1])
            r[b, g, valid[-1]] = s
            if kl_in_reward:
                for t in valid:
                    r[b, g, t] -= beta * _kl(estimator, lp_old[b, g, t], lp_ref[b, g, t], n)

    # 2. return.
    ret = np.zeros_like(r)
    for b in range(b_dim):
        for g in range(g_dim):
            valid = _valid(mask[b, g])
            if name in ("reinforce", "reinforce_pp"):
                running = 0.0
                for t in reversed(range(t_dim)):
                    if mask[b, g, t]:
                        running = r[b, g, t] + gamma * running
                        ret[b, g, t] = running
            elif name == "ppo":
                next_v, running = 0.0, 0.0
                for t in reversed(range(t_dim)):
                    if mask[b, g, t]:
                        delta = r[b, g, t] + gamma * next_v - values[b, g, t]
                        running = delta + gamma * lam * running
                        next_v = values[b, g, t]
                        ret[b, g, t] = running
            else:
                total = sum(r[b, g, t] for t in valid)
                for t in valid:
                    ret[b, g, t] = total

    # 3. baseline and group normalisation (per prompt, over members).
    adv = ret.copy()
    if name in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "dapo", "gspo"):
        for b in range(b_dim):
            idx = [g for g in range(g_dim) if members[b, g] and mask[b, g].any()]
            score = {}
            for g in idx:
                valid = _valid(mask[b, g])
                score[g] = ret[b, g, valid[0]]
            k = len(idx)
            for g in idx:
                if name == "rloo":
                    if k == 1:
                        base = (
                            score[g]
                            if n.loo_singleton_baseline is None
                            else n.loo_singleton_baseline
                        )
                    else:
                        base = (sum(score.values()) - score[g]) / (k - 1)
                else:
                    if k == 1:
                        base = (
                            score[g]
                            if n.group_singleton_baseline is None
                            else n.group_singleton_baseline
                        )
                    else:
                        base = sum(score.values()) / k
                scale = 1.0
                if name in ("grpo", "dapo", "gspo") and hp.get("scale_by_std", True):
                    centered = [score[j] - (sum(score.values()) / k) for j in idx]
                    sd = _std(centered, n.group_std_ddof) if k > 1 else None
                    sd = n.singleton_std if sd is None else sd
                    scale = 1.0 / (sd + n.group_std_eps)
                for t in _valid(mask[b, g]):
                    adv[b, g, t] = (ret[b, g, t] - base) * scale

    # 4. batch whitening.
    if name in ("ppo", "reinforce_pp", "reinforce_pp_baseline"):
        vals = [
            adv[b, g, t]
            for b in range(b_dim)
            for g in range(g_dim)
            for t in range(t_dim)
            if mask[b, g, t]
        ]
        if vals:
            mu = sum(vals) / len(vals)
            denom = max(len(vals) - n.whiten_ddof, 1)
            var = sum((v - mu) ** 2 for v in vals) / denom if len(vals) > n.whiten_ddof else 0.0
            inv = 1 / math.sqrt(
                max(var, n.whiten_eps) if n.whiten_eps_as_floor else var + n.whiten_eps
            )
            for b in range(b_dim):
                for g in range(g_dim):
                    for t in range(t_dim):
                        if mask[b, g, t]:
                            adv[b, g, t] = (adv[b, g, t] - mu) * inv
    return np.where(mask, adv, 0.0)
