"""Slow, obvious reference implementations for masked stats, log-probs, KL and returns.

Plain numpy in float64 and Python loops, written to be read against the formulas (and, for
returns and GAE, line by line against verl's loops), not to be fast.
"""

from __future__ import annotations

import math

import numpy as np

# ----------------------------------------------------------------------------------------------
# masked.py
# ----------------------------------------------------------------------------------------------


def _selected(x, mask):
    x, mask = np.asarray(x, np.float64), np.asarray(mask, bool)
    return [float(v) for v, m in zip(x.ravel(), mask.ravel(), strict=True) if m]


def ref_masked_sum(x, mask):
    return sum(_selected(x, mask))


def ref_masked_mean(x, mask):
    values = _selected(x, mask)
    return sum(values) / len(values) if values else 0.0


def ref_masked_var(x, mask, ddof=0):
    values = _selected(x, mask)
    n = len(values)
    if n <= ddof:
        return 0.0
    mean = sum(values) / n
    return sum((v - mean) ** 2 for v in values) / (n - ddof)


def ref_masked_stat_last_axis(stat, x, mask, **kwargs):
    """Applies a whole-array reference statistic to every row along the last axis."""
    x, mask = np.asarray(x, np.float64), np.asarray(mask, bool)
    out = np.zeros(x.shape[:-1])
    for idx in np.ndindex(*x.shape[:-1]):
        out[idx] = stat(x[idx], mask[idx], **kwargs)
    return out


def ref_masked_whiten(x, mask, *, shift_mean=True, ddof=0, eps=1e-8, eps_as_floor=False):
    x, mask = np.asarray(x, np.float64), np.asarray(mask, bool)
    mean = ref_masked_mean(x, mask)
    var = ref_masked_var(x, mask, ddof)
    denom = math.sqrt(max(var, eps) if eps_as_floor else var + eps)
    out = np.zeros(x.shape)
    for idx in np.ndindex(*x.shape):
        if mask[idx]:
            out[idx] = (x[idx] - mean) / denom + (0.0 if shift_mean else mean)
    return out


def ref_last_valid_index(mask):
    mask = np.asarray(mask, bool)
    out = np.zeros(mask.shape[:-1], np.int64)
    for idx in np.ndindex(*mask.shape[:-1]):
        for t in range(mask.shape[-1]):
            if mask[idx][t]:
                out[idx] = t
    return out


def ref_first_valid_index(mask):
    mask = np.asarray(mask, bool)
    out = np.zeros(mask.shape[:-1], np.int64)
    for idx in np.ndindex(*mask.shape[:-1]):
        for t in reversed(range(mask.shape[-1])):
            if mask[idx][t]:
                out[idx] = t
    return out


def ref_place_on_last_token(value, mask):
    value, mask = np.asarray(value, np.float64), np.asarray(mask, bool)
    out = np.zeros(mask.shape)
    for idx in np.ndindex(*mask.shape[:-1]):
        valid = [t for t in range(mask.shape[-1]) if mask[idx][t]]
        if valid:
            out[idx][valid[-1]] = value[idx]
    return out


def ref_value_at_first_token(x, mask):
    x, mask = np.asarray(x, np.float64), np.asarray(mask, bool)
    out = np.zeros(mask.shape[:-1])
    for idx in np.ndindex(*mask.shape[:-1]):
        valid = [t for t in range(mask.shape[-1]) if mask[idx][t]]
        if valid:
            out[idx] = x[idx][valid[0]]
    return out


# ----------------------------------------------------------------------------------------------
# logprobs.py
# ----------------------------------------------------------------------------------------------


def ref_token_logprobs_and_entropy(logits, tokens, temperature=1.0):
    """log softmax(z)[y] and −Σ p log p per position, one position at a time in float64."""
    logits = np.asarray(logits, np.float64)
    tokens = np.asarray(tokens)
    batch, time, _ = logits.shape
    logp, entropy = np.zeros((batch, time)), np.zeros((batch, time))
    for b in range(batch):
        for t in range(time):
            z = logits[b, t] / temperature
            top = max(z)
            log_norm = top + math.log(sum(math.exp(v - top) for v in z))
            logp[b, t] = z[tokens[b, t]] - log_norm
            entropy[b, t] = -sum(
                math.exp(v - log_norm) * (v - log_norm) for v in z if v != -math.inf
            )
    return logp, entropy


# ----------------------------------------------------------------------------------------------
# kl.py
# ----------------------------------------------------------------------------------------------


def ref_kl(name, logp, logp_ref, log_ratio_clamp=None, value_clamp=None):
    """Elementwise k1/abs/k2/k3 with verl's clamps, one scalar at a time."""
    logp, logp_ref = np.asarray(logp, np.float64), np.asarray(logp_ref, np.float64)
    out = np.zeros(logp.shape)
    for idx in np.ndindex(*logp.shape):
        d = logp[idx] - logp_ref[idx]
        if log_ratio_clamp is not None:
            d = min(max(d, -log_ratio_clamp), log_ratio_clamp)
        value = {
            "k1": d,
            "abs": abs(d),
            "k2": 0.5 * d * d,
            "k3": math.exp(-d) - 1.0 + d,
        }[name]
        if value_clamp is not None:
            value = min(max(value, -value_clamp), value_clamp)
        out[idx] = value
    return out


def ref_adaptive_kl_beta(beta, observed_kl, n_steps, *, target, horizon):
    error = min(max(observed_kl / target - 1.0, -0.2), 0.2)
    return beta * (1.0 + error * n_steps / horizon)


def ref_mean_sequence_kl(kl, mask):
    kl, mask = np.asarray(kl, np.float64), np.asarray(mask, bool)
    per_sequence = []
    for idx in np.ndindex(*kl.shape[:-1]):
        if mask[idx].any():
            per_sequence.append(ref_masked_mean(kl[idx], mask[idx]))
    return sum(per_sequence) / len(per_sequence) if per_sequence else 0.0


# ----------------------------------------------------------------------------------------------
# returns.py — verl's loops (compute_gae_advantage_return, reinforce_plus_plus after #7300)
# ----------------------------------------------------------------------------------------------


def ref_discounted_returns(reward, mask, gamma):
    reward, mask = np.asarray(reward, np.float64), np.asarray(mask, bool)
    out = np.zeros(reward.shape)
    for idx in np.ndindex(*reward.shape[:-1]):
        running = 0.0
        for t in reversed(range(reward.shape[-1])):
            if mask[idx][t]:
                running = reward[idx][t] + gamma * running
                out[idx][t] = running
    return out


def ref_gae(reward, value, mask, gamma, lam):
    reward, value = np.asarray(reward, np.float64), np.asarray(value, np.float64)
    mask = np.asarray(mask, bool)
    adv, ret = np.zeros(reward.shape), np.zeros(reward.shape)
    for idx in np.ndindex(*reward.shape[:-1]):
        next_value, last_gae = 0.0, 0.0
        for t in reversed(range(reward.shape[-1])):
            if not mask[idx][t]:
                continue  # both accumulators carried through; outputs stay 0
            delta = reward[idx][t] + gamma * next_value - value[idx][t]
            last_gae = delta + gamma * lam * last_gae
            next_value = value[idx][t]
            adv[idx][t] = last_gae
            ret[idx][t] = last_gae + value[idx][t]
    return adv, ret
