"""Slow, obvious references for baselines, normalization and selection (numpy float64 loops).

Each function walks prompts one by one, collects the members of the group in a Python list and
applies the textbook formula; nothing is vectorised. Non-member outputs are 0.
"""

from __future__ import annotations

import itertools

import numpy as np


def _members(values_g, mask_g):
    return [float(values_g[g]) for g in range(len(mask_g)) if mask_g[g]]


def ref_group_count(mask_bg):
    return np.array([sum(bool(x) for x in row) for row in mask_bg], np.float64)


def _per_group_baseline(score_bg, mask_bg, singleton_baseline, rule):
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


def ref_group_mean_baseline(score_bg, mask_bg, singleton_baseline=None):
    return _per_group_baseline(
        score_bg, mask_bg, singleton_baseline, lambda b, slots, s, i: sum(s) / len(s)
    )


def ref_leave_one_out_baseline(score_bg, mask_bg, singleton_baseline=None):
    def rule(b, slots, s, i):
        others = [s[j] for j in range(len(s)) if j != i]
        return sum(others) / len(others)

    return _per_group_baseline(score_bg, mask_bg, singleton_baseline, rule)


def ref_length_weighted_baseline(score_bg, length_bg, mask_bg, singleton_baseline=None):
    def rule(b, slots, s, i):
        lengths = [float(length_bg[b, g]) for g in slots]
        if sum(lengths) == 0:
            return sum(s) / len(s)
        return sum(length * x for length, x in zip(lengths, s, strict=True)) / sum(lengths)

    return _per_group_baseline(score_bg, mask_bg, singleton_baseline, rule)


def ref_group_std(score_bg, mask_bg, ddof=0):
    out = np.zeros(score_bg.shape[0])
    for b in range(score_bg.shape[0]):
        s = _members(np.asarray(score_bg[b], np.float64), mask_bg[b])
        if len(s) > ddof:
            mean = sum(s) / len(s)
            out[b] = np.sqrt(sum((x - mean) ** 2 for x in s) / (len(s) - ddof))
    return out


def _scale(x, mask_bg, denom_b):
    x = np.asarray(x, np.float64)
    out = np.zeros(x.shape)
    for b in range(x.shape[0]):
        for g in range(x.shape[1]):
            if mask_bg[b, g]:
                d = denom_b[b] if denom_b[b] > 0 else 1.0
                out[b, g] = x[b, g] / d
    return out


def ref_scale_by_group_std(x, score_bg, mask_bg, ddof=0, eps=1e-6, singleton_std=1.0):
    std = ref_group_std(score_bg, mask_bg, ddof)
    counts = ref_group_count(mask_bg)
    denom = [(singleton_std if counts[b] == 1 else std[b]) + eps for b in range(len(std))]
    return _scale(x, mask_bg, denom)


def ref_scale_by_batch_std(x, score_bg, mask_bg, ddof=0, eps=1e-6):
    s = [float(score_bg[b, g]) for b, g in zip(*np.nonzero(mask_bg), strict=True)]
    std = 0.0
    if len(s) > ddof:
        mean = sum(s) / len(s)
        std = np.sqrt(sum((v - mean) ** 2 for v in s) / (len(s) - ddof))
    return _scale(x, mask_bg, [std + eps] * score_bg.shape[0])


def ref_whiten(x, mask, ddof=0, eps=1e-8, eps_as_floor=False, shift_mean=True):
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


def population_variance(values):
    mean = sum(values) / len(values)
    return sum((v - mean) ** 2 for v in values) / len(values)


def ref_pods_best_variance(reward_bg, mask_bg, num_keep):
    """Brute force over every subset of size min(num_keep, n): the maximal kept variance."""
    out = np.zeros(reward_bg.shape[0])
    for b in range(reward_bg.shape[0]):
        r = _members(np.asarray(reward_bg[b], np.float64), mask_bg[b])
        m = min(num_keep, len(r))
        if m:
            out[b] = max(population_variance(c) for c in itertools.combinations(r, m))
    return out


def ref_dapo_group_filter(reward_bg, mask_bg):
    keep = []
    for b in range(reward_bg.shape[0]):
        r = _members(np.asarray(reward_bg[b], np.float64), mask_bg[b])
        keep.append(len(r) == 1 or len(set(r)) >= 2)  # not all equal
    return np.array(keep)


def ref_overlong_reward_penalty(length, max_length, buffer_length, penalty_factor=1.0, cap=True):
    out = np.zeros(np.shape(length))
    for idx in np.ndindex(out.shape):
        exceed = float(length[idx]) - (max_length - buffer_length)
        if exceed > 0:
            if cap:
                exceed = min(exceed, buffer_length)
            out[idx] = -exceed / buffer_length * penalty_factor
    return out
