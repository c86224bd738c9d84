"""Slow, obvious reference implementations that the fast code is checked against.

Plain numpy (mostly float64) and Python loops over prompts, answers, tokens or pairs, written to
be read against the formulas in the docstrings, never to be fast. Sections: masked statistics,
log-probs, KL and returns; baselines, normalisation and selection; policy losses, aggregation
and preference losses; whole recipes; and the per-group loops the advantage benchmark times.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from jaxrl_llm.numerics import Numerics

if TYPE_CHECKING:
    import jax

    from jaxrl_llm import Rollout

    Array = np.ndarray | jax.Array  # the references read either as numpy, element by element

# ==============================================================================================
# Slow, obvious reference implementations for masked stats, log-probs, KL and returns.
#
#
# Plain numpy in float64 and Python loops, written to be read against the formulas (and, for
# returns and GAE, line by line against verl's loops), not to be fast.
# ----------------------------------------------------------------------------------------------
# masked.py
# ----------------------------------------------------------------------------------------------


def _selected(x: Array, mask: Array) -> list[float]:
    x, mask = np.asarray(x, np.float64), np.asarray(mask, bool)
    return [float(v) for v, m in zip(x.ravel(), mask.ravel(), strict=True) if m]


def ref_masked_sum(x: Array, mask: Array) -> float:
    return sum(_selected(x, mask))


def ref_masked_mean(x: Array, mask: Array) -> float:
    values = _selected(x, mask)
    return sum(values) / len(values) if values else 0.0


def ref_masked_var(x: Array, mask: Array, ddof: int = 0) -> float:
    values = _selected(x, mask)
    n = len(values)
    if n <= ddof:
        return 0.0
    mean = sum(values) / n
    return sum((v - mean) ** 2 for v in values) / (n - ddof)


def ref_masked_stat_last_axis(
    stat: Callable[..., float], x: Array, mask: Array, **kwargs: int
) -> np.ndarray:
    """Applies a whole-array reference statistic to every row along the last axis."""
    x, mask = np.asarray(x, np.float64), np.asarray(mask, bool)
    out = np.zeros(x.shape[:-1])
    for idx in np.ndindex(*x.shape[:-1]):
        out[idx] = stat(x[idx], mask[idx], **kwargs)
    return out


def ref_masked_whiten(
    x: Array,
    mask: Array,
    *,
    shift_mean: bool = True,
    ddof: int = 0,
    eps: float = 1e-8,
    eps_as_floor: bool = False,
) -> np.ndarray:
    x, mask = np.asarray(x, np.float64), np.asarray(mask, bool)
    mean = ref_masked_mean(x, mask)
    var = ref_masked_var(x, mask, ddof)
    denom = math.sqrt(max(var, eps) if eps_as_floor else var + eps)
    out = np.zeros(x.shape)
    for idx in np.ndindex(*x.shape):
        if mask[idx]:
            out[idx] = (x[idx] - mean) / denom + (0.0 if shift_mean else mean)
    return out


def ref_last_valid_index(mask: Array) -> np.ndarray:
    mask = np.asarray(mask, bool)
    out = np.zeros(mask.shape[:-1], np.int64)
    for idx in np.ndindex(*mask.shape[:-1]):
        for t in range(mask.shape[-1]):
            if mask[idx][t]:
                out[idx] = t
    return out


def ref_first_valid_index(mask: Array) -> np.ndarray:
    mask = np.asarray(mask, bool)
    out = np.zeros(mask.shape[:-1], np.int64)
    for idx in np.ndindex(*mask.shape[:-1]):
        for t in reversed(range(mask.shape[-1])):
            if mask[idx][t]:
                out[idx] = t
    return out


def ref_place_on_last_token(value: Array, mask: Array) -> np.ndarray:
    value, mask = np.asarray(value, np.float64), np.asarray(mask, bool)
    out = np.zeros(mask.shape)
    for idx in np.ndindex(*mask.shape[:-1]):
        valid = [t for t in range(mask.shape[-1]) if mask[idx][t]]
        if valid:
            out[idx][valid[-1]] = value[idx]
    return out


def ref_value_at_first_token(x: Array, mask: Array) -> np.ndarray:
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


def ref_token_logprobs_and_entropy(
    logits: Array, tokens: Array, temperature: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
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


def ref_kl(
    name: str,
    logp: Array,
    logp_ref: Array,
    log_ratio_clamp: float | None = None,
    value_clamp: float | None = None,
) -> np.ndarray:
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


def ref_adaptive_kl_beta(
    beta: float, observed_kl: float, n_steps: int, *, target: float, horizon: float
) -> float:
    error = min(max(observed_kl / target - 1.0, -0.2), 0.2)
    return beta * (1.0 + error * n_steps / horizon)


def ref_mean_sequence_kl(kl: Array, mask: Array) -> float:
    kl, mask = np.asarray(kl, np.float64), np.asarray(mask, bool)
    per_sequence = []
    for idx in np.ndindex(*kl.shape[:-1]):
        if mask[idx].any():
            per_sequence.append(ref_masked_mean(kl[idx], mask[idx]))
    return sum(per_sequence) / len(per_sequence) if per_sequence else 0.0


# ----------------------------------------------------------------------------------------------
# returns.py — verl's loops (compute_gae_advantage_return, reinforce_plus_plus after #7300)
# ----------------------------------------------------------------------------------------------


def ref_discounted_returns(reward: Array, mask: Array, gamma: float) -> np.ndarray:
    reward, mask = np.asarray(reward, np.float64), np.asarray(mask, bool)
    out = np.zeros(reward.shape)
    for idx in np.ndindex(*reward.shape[:-1]):
        running = 0.0
        for t in reversed(range(reward.shape[-1])):
            if mask[idx][t]:
                running = reward[idx][t] + gamma * running
                out[idx][t] = running
    return out


def ref_gae(
    reward: Array, value: Array, mask: Array, gamma: float, lam: float
) -> tuple[np.ndarray, np.ndarray]:
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


# ==============================================================================================
# Slow, obvious references for baselines, normalization and selection (numpy float64 loops).
#
#
# Each function walks prompts one by one, collects the members of the group in a Python list and
# applies the textbook formula; nothing is vectorised. Non-member outputs are 0.
def _members(values_g: Array, mask_g: Array) -> list[float]:
    return [float(values_g[g]) for g in range(len(mask_g)) if mask_g[g]]


def ref_group_count(mask_bg: Array) -> np.ndarray:
    return np.array([sum(bool(x) for x in row) for row in mask_bg], np.float64)


def _per_group_baseline(
    score_bg: Array,
    mask_bg: Array,
    singleton_baseline: float | None,
    rule: Callable[[int, list[int], list[float], int], float],
) -> np.ndarray:
    """rule(members, g_index_among_members) -> baseline for groups with >= 2 members."""
    score_bg = np.asarray(score_bg, np.float64)
    out = np.zeros(score_bg.shape)
    for b in range(score_bg.shape[0]):
        slots = [g for g in range(score_bg.shape[1]) if mask_bg[b, g]]
        scores = [float(score_bg[b, g]) for g in slots]
        for i, g in enumerate(slots):
            if len(slots) == 1:
                out[b, g] = scores[0] if singleton_baseline is None else singleton_baseline
            else:
                out[b, g] = rule(b, slots, scores, i)
    return out


def ref_group_mean_baseline(
    score_bg: Array, mask_bg: Array, singleton_baseline: float | None = None
) -> np.ndarray:
    return _per_group_baseline(
        score_bg, mask_bg, singleton_baseline, lambda b, slots, s, i: sum(s) / len(s)
    )


def ref_leave_one_out_baseline(
    score_bg: Array, mask_bg: Array, singleton_baseline: float | None = None
) -> np.ndarray:
    def rule(b: int, slots: list[int], s: list[float], i: int) -> float:
        others = [s[j] for j in range(len(s)) if j != i]
        return sum(others) / len(others)

    return _per_group_baseline(score_bg, mask_bg, singleton_baseline, rule)


def ref_length_weighted_baseline(
    score_bg: Array, length_bg: Array, mask_bg: Array, singleton_baseline: float | None = None
) -> np.ndarray:
    def rule(b: int, slots: list[int], s: list[float], i: int) -> float:
        lengths = [float(length_bg[b, g]) for g in slots]
        if sum(lengths) == 0:
            return sum(s) / len(s)
        return sum(length * x for length, x in zip(lengths, s, strict=True)) / sum(lengths)

    return _per_group_baseline(score_bg, mask_bg, singleton_baseline, rule)


def ref_group_std(score_bg: Array, mask_bg: Array, ddof: int = 0) -> np.ndarray:
    out = np.zeros(score_bg.shape[0])
    for b in range(score_bg.shape[0]):
        s = _members(np.asarray(score_bg[b], np.float64), mask_bg[b])
        if len(s) > ddof:
            mean = sum(s) / len(s)
            out[b] = np.sqrt(sum((x - mean) ** 2 for x in s) / (len(s) - ddof))
    return out


def _scale(x: Array, mask_bg: Array, denom_b: Sequence[float] | np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    out = np.zeros(x.shape)
    for b in range(x.shape[0]):
        for g in range(x.shape[1]):
            if mask_bg[b, g]:
                d = denom_b[b] if denom_b[b] > 0 else 1.0
                out[b, g] = x[b, g] / d
    return out


def ref_scale_by_group_std(
    x: Array,
    score_bg: Array,
    mask_bg: Array,
    ddof: int = 0,
    eps: float = 1e-6,
    singleton_std: float = 1.0,
) -> np.ndarray:
    std = ref_group_std(score_bg, mask_bg, ddof)
    counts = ref_group_count(mask_bg)
    denom = [(singleton_std if counts[b] == 1 else std[b]) + eps for b in range(len(std))]
    return _scale(x, mask_bg, denom)


def ref_scale_by_batch_std(
    x: Array, score_bg: Array, mask_bg: Array, ddof: int = 0, eps: float = 1e-6
) -> np.ndarray:
    s = [float(score_bg[b, g]) for b, g in zip(*np.nonzero(mask_bg), strict=True)]
    std = 0.0
    if len(s) > ddof:
        mean = sum(s) / len(s)
        std = np.sqrt(sum((v - mean) ** 2 for v in s) / (len(s) - ddof))
    return _scale(x, mask_bg, [std + eps] * score_bg.shape[0])


def ref_whiten(
    x: Array,
    mask: Array,
    ddof: int = 0,
    eps: float = 1e-8,
    eps_as_floor: bool = False,
    shift_mean: bool = True,
) -> np.ndarray:
    x = np.asarray(x, np.float64)
    flat_x, flat_m = x.reshape(-1), np.asarray(mask).reshape(-1)
    vals = [float(flat_x[i]) for i in range(flat_x.size) if flat_m[i]]
    out = np.zeros(flat_x.shape)
    if not vals:
        return out.reshape(x.shape)
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - ddof) if len(vals) > ddof else 0.0
    scale = 1.0 / np.sqrt(max(var, eps) if eps_as_floor else var + eps)
    for i in range(flat_x.size):
        if flat_m[i]:
            out[i] = (flat_x[i] - mean) * scale + (0.0 if shift_mean else mean)
    return out.reshape(x.shape)


def population_variance(values: Sequence[float]) -> float:
    mean = sum(values) / len(values)
    return sum((v - mean) ** 2 for v in values) / len(values)


def ref_pods_best_variance(reward_bg: Array, mask_bg: Array, num_keep: int) -> np.ndarray:
    """Brute force over every subset of size min(num_keep, n): the maximal kept variance."""
    out = np.zeros(reward_bg.shape[0])
    for b in range(reward_bg.shape[0]):
        r = _members(np.asarray(reward_bg[b], np.float64), mask_bg[b])
        m = min(num_keep, len(r))
        if m:
            out[b] = max(population_variance(c) for c in itertools.combinations(r, m))
    return out


def ref_dapo_group_filter(reward_bg: Array, mask_bg: Array) -> np.ndarray:
    keep = []
    for b in range(reward_bg.shape[0]):
        r = _members(np.asarray(reward_bg[b], np.float64), mask_bg[b])
        keep.append(len(r) == 1 or len(set(r)) >= 2)  # not all equal
    return np.array(keep)


def ref_overlong_reward_penalty(
    length: Array,
    max_length: int,
    buffer_length: int,
    penalty_factor: float = 1.0,
    cap: bool = True,
) -> np.ndarray:
    out = np.zeros(np.shape(length))
    for idx in np.ndindex(out.shape):
        exceed = float(length[idx]) - (max_length - buffer_length)
        if exceed > 0:
            if cap:
                exceed = min(exceed, buffer_length)
            out[idx] = -exceed / buffer_length * penalty_factor
    return out


# ==============================================================================================
# Slow, obvious reference implementations for policy losses, aggregation and preference losses.
#
#
# Pure Python loops over numpy float64 arrays, one token (or one sequence, or one pair) at a
# time, written straight from the formulas in the docstrings of ``jaxrl_llm.core.policy_losses``,
# ``aggregation`` and ``preference``. No vectorisation tricks: these are what the fast code is
# checked against. Masked positions are never read.
def _sequences(shape: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """Every index of the leading (sequence) axes of a ``[..., T]`` array."""
    return np.ndindex(*shape[:-1])


def _clip(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def log_sigmoid(z: float) -> float:
    z = float(z)
    if z >= 0:
        return -math.log1p(math.exp(-z))
    return z - math.log1p(math.exp(z))


# ---------------------------------------------------------------------------------------------
# Policy losses. Each returns (loss, dloss/dlogp) as float64 arrays of the input shape.


def reinforce(logp: Array, adv: Array, mask: Array) -> tuple[np.ndarray, np.ndarray]:
    loss = np.zeros(logp.shape)
    grad = np.zeros(logp.shape)
    for idx in np.ndindex(*logp.shape):
        if mask[idx]:
            loss[idx] = -float(adv[idx]) * float(logp[idx])
            grad[idx] = -float(adv[idx])
    return loss, grad


def ppo(
    logp: Array,
    logp_old: Array,
    adv: Array,
    mask: Array,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
    log_ratio_clamp: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
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


def gspo(
    logp: Array,
    logp_old: Array,
    adv: Array,
    mask: Array,
    *,
    clip_low: float,
    clip_high: float,
    log_ratio_clamp: float | None = 10.0,
) -> tuple[np.ndarray, np.ndarray]:
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


def cispo(
    logp: Array, logp_old: Array, adv: Array, mask: Array, *, clip_low: float, clip_high: float
) -> tuple[np.ndarray, np.ndarray]:
    loss = np.zeros(logp.shape)
    grad = np.zeros(logp.shape)
    for idx in np.ndindex(*logp.shape):
        if mask[idx]:
            r = math.exp(float(logp[idx]) - float(logp_old[idx]))
            w = _clip(r, 1 - clip_low, 1 + clip_high)
            loss[idx] = -w * float(adv[idx]) * float(logp[idx])
            grad[idx] = -w * float(adv[idx])
    return loss, grad


def value_loss(
    value: Array, value_old: Array, ret: Array, mask: Array, *, clip_eps: float | None = None
) -> np.ndarray:
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


def ratio_metrics(
    logp: Array,
    logp_old: Array,
    adv: Array,
    mask: Array,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> dict[str, tuple[float, float]]:
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


def aggregate(
    loss: Array, mask: Array, mode: str, *, norm: float | None = None
) -> tuple[float, float]:
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


def finalize(total: float, denominator: float) -> float:
    return total / denominator if denominator > 0 else total


# ---------------------------------------------------------------------------------------------
# Preference losses, one pair at a time.


def dpo_family(
    loss_type: str,
    lw: Array,
    ll: Array,
    rw: Array,
    rl: Array,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    len_w: Array | None = None,
    len_l: Array | None = None,
) -> np.ndarray:
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


def simpo(
    lw: Array, ll: Array, len_w: Array, len_l: Array, *, beta: float, gamma: float
) -> np.ndarray:
    out = np.zeros(len(lw))
    for p in range(len(lw)):
        margin = beta * float(lw[p]) / max(float(len_w[p]), 1.0)
        margin -= beta * float(ll[p]) / max(float(len_l[p]), 1.0)
        out[p] = -log_sigmoid(margin - gamma)
    return out


def sequence_logprob(logp: Array, mask: Array) -> np.ndarray:
    out = np.zeros(logp.shape[:-1])
    for seq in _sequences(logp.shape):
        for t in range(logp.shape[-1]):
            if mask[(*seq, t)]:
                out[seq] += float(logp[(*seq, t)])
    return out


# ==============================================================================================
# Slow, obvious references for whole recipes: loops over prompts, answers and tokens, float64.
#
#
# Each follows the recipe's documented composition literally (see jaxrl_llm/algorithms.py), with
# the numerics of a preset, so the fast chain can be checked number by number.
def _valid(mask_t: Array) -> list[int]:
    return [t for t in range(len(mask_t)) if mask_t[t]]


def _kl(estimator: str, lp: float, lr: float, n: Numerics) -> float:
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


def _std(values: Sequence[float], ddof: int) -> float | None:
    k = len(values)
    if k <= ddof:
        return None
    mu = sum(values) / k
    return math.sqrt(sum((v - mu) ** 2 for v in values) / (k - ddof))


def reference_advantages(
    name: str, rollout: Rollout, n: Numerics, **hp: float | str | bool
) -> np.ndarray:
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


# ==============================================================================================
# Loop references for the advantage benchmark (``scripts/bench_advantages.py``).
#
#
# Plain numpy, written the way the peers' reference code is: group estimators (GRPO, Dr. GRPO,
# RLOO, REINFORCE++-baseline) loop over the prompts' groups in Python; reward-to-go and GAE loop
# over time steps from the end, each step vectorised over the batch (verl's
# ``compute_gae_advantage_return`` / ``compute_reinforce_plus_plus_outcome_advantage`` loops).
# Everything that is not the estimator's own loop (placing the score on the last token, k1 KL in
# the reward, batch whitening) is vectorised numpy, as it is in verl.
#
# Each function follows one recipe of ``jaxrl_llm.algorithms`` with its default hyperparameters
# and the default numerics (group std ddof 0 with +1e-6 on the std; whitening ddof 0,
# ``rsqrt(var + 1e-8)``), so the benchmark can check that the jitted function it times computes
# the same advantages. Inputs are ``[B, G, T]`` numpy arrays; the arithmetic runs in the inputs'
# dtype (float32 in the benchmark, like the peers' torch code). Outputs are 0 on padding.
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


def kl_k1_in_reward(
    r_bgt: np.ndarray,
    logp_old_bgt: np.ndarray,
    logp_ref_bgt: np.ndarray,
    mask_bgt: np.ndarray,
    beta: float,
) -> np.ndarray:
    """``r_t − β·(logp_old − logp_ref)`` on valid tokens."""
    return r_bgt - beta * np.where(mask_bgt, logp_old_bgt - logp_ref_bgt, 0)


def outcome_scores(r_bgt: np.ndarray, mask_bgt: np.ndarray) -> np.ndarray:
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


def reward_to_go_loop(r_bgt: np.ndarray, mask_bgt: np.ndarray, gamma: float) -> np.ndarray:
    """``G_t = r_t + γ·G_{t+1}`` on valid tokens, carried unchanged through masked ones;
    a loop over t from the end, vectorised over every sequence of the batch."""
    running = np.zeros(r_bgt.shape[:-1], r_bgt.dtype)
    out = np.zeros_like(r_bgt)
    for t in reversed(range(r_bgt.shape[-1])):
        m = mask_bgt[..., t]
        running = np.where(m, r_bgt[..., t] + gamma * running, running)
        out[..., t] = running
    return np.where(mask_bgt, out, 0)


def gae_loop(
    r_bgt: np.ndarray, value_bgt: np.ndarray, mask_bgt: np.ndarray, gamma: float, lam: float
) -> np.ndarray:
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


def whiten(x_bgt: np.ndarray, mask_bgt: np.ndarray) -> np.ndarray:
    """``(x − μ)·rsqrt(σ² + 1e-8)`` over every valid token (ddof 0)."""
    values = x_bgt[mask_bgt]
    mean = values.mean() if values.size else 0.0
    var = np.mean((values - mean) ** 2) if values.size else 0.0
    return np.where(mask_bgt, (x_bgt - mean) / np.sqrt(var + WHITEN_EPS), 0)


def _broadcast(adv_bg: np.ndarray, mask_bgt: np.ndarray) -> np.ndarray:
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
    # the 2025–26 loss family changes the loss, not the advantage (issue 17)
    "cispo": "GRPO",
    "sapo": "GRPO",
    "gmpo": "GRPO",
    "clip_cov": "GRPO",
    "kl_cov": "GRPO",
    "dppo": "GRPO",
    "luspo": "GRPO",
    "vespo": "GRPO",
    "dro": "Dr. GRPO",
}
# Recipes whose default advantage is another recipe's (GPG, OPO, ReMax have their own
# estimators, checked against verl's functions in tests/core/test_loss_family.py).
SAME_ADVANTAGE_AS = {n: "grpo" for n, e in ESTIMATOR.items() if e == "GRPO"} | {"dro": "dr_grpo"}


def recipe_advantages(
    name: str, data: dict[str, np.ndarray], *, beta: float, gamma: float = 1.0, lam: float = 0.95
) -> np.ndarray:
    """Advantages of recipe ``name`` (default numerics) on ``data``: a dict of ``reward_bg``,
    ``mask_bgt`` and, as needed, ``logp_old_bgt``, ``logp_ref_bgt``, ``value_bgt``.
    ``beta`` is the recipe's KL coefficient (used only by KL-in-reward recipes)."""
    name = SAME_ADVANTAGE_AS.get(name, name)
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
