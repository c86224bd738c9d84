"""Slow, obvious reference implementations for policy losses, aggregation and preference losses.

Pure Python loops over numpy float64 arrays, one token (or one sequence, or one pair) at a
time, written straight from the formulas in the docstrings of ``jaxrl_llm.core.policy_losses``,
``aggregation`` and ``preference``. No vectorisation tricks: these are what the fast code is
checked against. Masked positions are never read.
"""

from __future__ import annotations

import math

import numpy as np


def _sequences(shape):
    """Every index of the leading (sequence) axes of a ``[..., T]`` array."""
    return np.ndindex(*shape[:-1])


def _clip(x, lo, hi):
    return min(max(x, lo), hi)


def log_sigmoid(z):
    z = float(z)
    if z >= 0:
        return -math.log1p(math.exp(-z))
    return z - math.log1p(math.exp(z))


# ---------------------------------------------------------------------------------------------
# Policy losses. Each returns (loss, dloss/dlogp) as float64 arrays of the input shape.


def reinforce(logp, adv, mask):
    loss = np.zeros(logp.shape)
    grad = np.zeros(logp.shape)
    for idx in np.ndindex(*logp.shape):
        if mask[idx]:
            loss[idx] = -float(adv[idx]) * float(logp[idx])
            grad[idx] = -float(adv[idx])
    return loss, grad


def ppo(logp, logp_old, adv, mask, *, clip_low, clip_high, dual_clip=None, log_ratio_clamp=None):
    loss = np.zeros(logp.shape)
    grad = np.zeros(logp.shape)
    for idx in np.ndindex(*logp.shape):
        if not mask[idx]:
            continue
        a = float(adv[idx])
        log_ratio = float(logp[idx]) - float(logp_old[idx])
        dlog = 1.0  # d log_ratio / d logp
        if log_ratio_clamp is not None and abs(log_ratio) > log_ratio_clamp:
            log_ratio = math.copysign(log_ratio_clamp, log_ratio)
            dlog = 0.0
        r = math.exp(log_ratio)
        unclipped = -a * r
        clipped = -a * _clip(r, 1 - clip_low, 1 + clip_high)
        if clipped > unclipped:  # the clip is active: constant in r
            value, dvalue = clipped, 0.0
        else:
            value, dvalue = unclipped, -a * r * dlog
        if dual_clip is not None and a < 0 and -dual_clip * a < value:
            value, dvalue = -dual_clip * a, 0.0
        loss[idx] = value
        grad[idx] = dvalue
    return loss, grad


def gspo(logp, logp_old, adv, mask, *, clip_low, clip_high, log_ratio_clamp=10.0):
    loss = np.zeros(logp.shape)
    grad = np.zeros(logp.shape)
    num_tokens = logp.shape[-1]
    for seq in _sequences(logp.shape):
        total, length = 0.0, 0
        for t in range(num_tokens):
            if mask[(*seq, t)]:
                total += float(logp[(*seq, t)]) - float(logp_old[(*seq, t)])
                length += 1
        log_s = total / max(length, 1)
        clamped = log_ratio_clamp is not None and log_s > log_ratio_clamp
        r = math.exp(log_ratio_clamp if clamped else log_s)
        for t in range(num_tokens):
            idx = (*seq, t)
            if not mask[idx]:
                continue
            a = float(adv[idx])
            unclipped = -a * r
            clipped = -a * _clip(r, 1 - clip_low, 1 + clip_high)
            if clipped > unclipped or clamped:
                loss[idx], grad[idx] = max(unclipped, clipped), 0.0
            else:
                loss[idx], grad[idx] = unclipped, -a * r  # d r_t / d logp_t = r_t
    return loss, grad


def cispo(logp, logp_old, adv, mask, *, clip_low, clip_high):
    loss = np.zeros(logp.shape)
    grad = np.zeros(logp.shape)
    for idx in np.ndindex(*logp.shape):
        if mask[idx]:
            r = math.exp(float(logp[idx]) - float(logp_old[idx]))
            w = _clip(r, 1 - clip_low, 1 + clip_high)
            loss[idx] = -w * float(adv[idx]) * float(logp[idx])
            grad[idx] = -w * float(adv[idx])
    return loss, grad


def value_loss(value, value_old, ret, mask, *, clip_eps=None):
    loss = np.zeros(value.shape)
    for idx in np.ndindex(*value.shape):
        if not mask[idx]:
            continue
        v, v_old, r = float(value[idx]), float(value_old[idx]), float(ret[idx])
        err = (v - r) ** 2
        if clip_eps is not None:
            v_clipped = _clip(v, v_old - clip_eps, v_old + clip_eps)
            err = max(err, (v_clipped - r) ** 2)
        loss[idx] = 0.5 * err
    return loss


def ratio_metrics(logp, logp_old, adv, mask, *, clip_low, clip_high, dual_clip=None):
    sums = dict.fromkeys(
        [
            "clip_fraction_low",
            "clip_fraction_high",
            "clip_fraction",
            "dual_clip_fraction",
            "ratio_mean",
            "approx_kl",
        ],
        0.0,
    )
    count = 0
    for idx in np.ndindex(*logp.shape):
        if not mask[idx]:
            continue
        count += 1
        a = float(adv[idx])
        log_r = float(logp[idx]) - float(logp_old[idx])
        r = math.exp(log_r)
        low = a < 0 and r < 1 - clip_low
        high = a > 0 and r > 1 + clip_high
        sums["clip_fraction_low"] += low
        sums["clip_fraction_high"] += high
        sums["clip_fraction"] += low or high
        sums["dual_clip_fraction"] += dual_clip is not None and a < 0 and r > dual_clip
        sums["ratio_mean"] += r
        sums["approx_kl"] += (r - 1) - log_r
    return {k: (v, float(count)) for k, v in sums.items()}


# ---------------------------------------------------------------------------------------------
# Aggregation: (sum, denominator) with the token axis last.


def aggregate(loss, mask, mode, *, norm=None):
    num_tokens = loss.shape[-1]
    norm = num_tokens if norm is None else norm
    total, denominator = 0.0, 0.0
    for seq in _sequences(loss.shape):
        seq_sum, length = 0.0, 0
        for t in range(num_tokens):
            if mask[(*seq, t)]:
                seq_sum += float(loss[(*seq, t)])
                length += 1
        if mode == "token-mean":
            total += seq_sum
            denominator += length
        elif mode == "token-sum":
            total += seq_sum
        elif mode == "seq-mean-token-mean":
            if length:
                total += seq_sum / length
                denominator += 1
        elif mode == "seq-mean-token-sum":
            if length:
                total += seq_sum
                denominator += 1
        elif mode == "seq-mean-token-sum-norm":
            if length:
                total += seq_sum
                denominator += norm
        else:
            raise ValueError(mode)
    return total, denominator


def finalize(total, denominator):
    return total / denominator if denominator > 0 else total


# ---------------------------------------------------------------------------------------------
# Preference losses, one pair at a time.


def dpo_family(loss_type, lw, ll, rw, rl, *, beta, label_smoothing=0.0, len_w=None, len_l=None):
    out = np.zeros(len(lw))
    eps = label_smoothing
    for p in range(len(lw)):
        rho_w = float(lw[p]) - float(rw[p])
        rho_l = float(ll[p]) - float(rl[p])
        z = beta * (rho_w - rho_l)
        if loss_type == "sigmoid":
            out[p] = -(1 - eps) * log_sigmoid(z) - eps * log_sigmoid(-z)
        elif loss_type == "robust":
            out[p] = (-(1 - eps) * log_sigmoid(z) + eps * log_sigmoid(-z)) / (1 - 2 * eps)
        elif loss_type == "hinge":
            out[p] = max(0.0, 1 - z)
        elif loss_type == "ipo":
            avg = rho_w / max(float(len_w[p]), 1.0) - rho_l / max(float(len_l[p]), 1.0)
            out[p] = (avg - 1 / (2 * beta)) ** 2
        else:
            raise ValueError(loss_type)
    return out


def simpo(lw, ll, len_w, len_l, *, beta, gamma):
    out = np.zeros(len(lw))
    for p in range(len(lw)):
        margin = beta * float(lw[p]) / max(float(len_w[p]), 1.0)
        margin -= beta * float(ll[p]) / max(float(len_l[p]), 1.0)
        out[p] = -log_sigmoid(margin - gamma)
    return out


def sequence_logprob(logp, mask):
    out = np.zeros(logp.shape[:-1])
    for seq in _sequences(logp.shape):
        for t in range(logp.shape[-1]):
            if mask[(*seq, t)]:
                out[seq] += float(logp[(*seq, t)])
    return out
