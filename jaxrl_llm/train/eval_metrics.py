"""Sampled-evaluation metrics over ``K`` completions per prompt: pass@k, mean@K, best@K, maj@K,
each with a bootstrap confidence interval over prompts. Pure NumPy.

Inputs are ``[P, K]`` matrices, one row per held-out prompt and one column per sample:
``correct_pk`` (bool, the accuracy term's verdict), ``reward_pk`` (float, the total reward)
and ``answers_pk`` (the parsed answer of each sample, hashable; a missing answer does not vote).

Metrics, each the mean over prompts of a per-prompt value ``v_p``:

- ``pass@k`` (k ≤ K): the unbiased estimator of Chen et al. 2021, *Evaluating Large Language
  Models Trained on Code* (arXiv:2107.03374, §2.1): with ``n`` samples of which ``c`` are
  correct, ``v_p = 1 − C(n−c, k) / C(n, k)``, the probability that at least one of ``k``
  samples drawn without replacement from the ``n`` is correct. Its expectation over the ``n``
  samples equals the true pass@k of ``k`` independent samples. ``pass@1 = c / n``.
- ``mean@K``: the mean reward of the ``K`` samples, ``v_p = (1/K) Σ_j r_pj``.
- ``best@K``: the best reward of the ``K`` samples, ``v_p = max_j r_pj`` (an oracle picking
  the best sample; ``best@K`` of the correctness is ``pass@K`` with ``k = n = K``).
- ``maj@K``: majority vote (self-consistency, Wang et al. 2022, arXiv:2203.11171): the answer
  given by most samples wins, ``v_p`` is the correctness of its first sample (as in verl's
  ``calc_maj_val``). Ties go to the answer whose first sample comes first; samples without
  an answer do not vote; a prompt with no answer at all scores 0.

Confidence intervals (:func:`bootstrap_ci`): the percentile bootstrap over prompts (Efron &
Tibshirani 1993, ch. 13): resample the ``P`` per-prompt values with replacement
``num_resamples`` times (default 1000), take the mean of each resample, and report the
``(1 − confidence)/2`` and ``(1 + confidence)/2`` quantiles (default 95%: 2.5% and 97.5%).
Seeded, so the same inputs give the same interval. verl's ``trainer/ppo/metric_utils.py``
reports mean@N / best@N / maj@N with a bootstrap over subsets of each prompt's N samples; this
module bootstraps over *prompts* instead, which measures how much the score would move on
another draw of the held-out set.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

NUM_RESAMPLES = 1000
CONFIDENCE = 0.95


def pass_at_k(num_samples: Any, num_correct: Any, k: int) -> np.ndarray:
    """The unbiased pass@k estimate ``1 − C(n−c, k) / C(n, k)`` (Chen et al. 2021).

    Computed in the stable product form of the paper's reference code,
    ``1 − Π_{i=n−c+1}^{n} (1 − k/i)`` (1 when ``n − c < k``: every ``k``-subset holds a correct
    sample), which never forms the large binomials.

    Args:
      num_samples: ``n``, samples per prompt (an int or an int array).
      num_correct: ``c``, correct samples per prompt, ``0 ≤ c ≤ n`` (broadcast against ``n``).
      k: ``1 ≤ k ≤ n``.

    Returns:
      ``f64`` array of the broadcast shape of ``n`` and ``c`` (0-d for scalars).
    """
    n, c = np.broadcast_arrays(np.asarray(num_samples), np.asarray(num_correct))
    if not (np.issubdtype(n.dtype, np.integer) and np.issubdtype(c.dtype, np.integer)):
        raise TypeError(f"pass_at_k: n and c must be integers, got {n.dtype} and {c.dtype}")
    k = int(k)
    if n.size and (np.any(c < 0) or np.any(c > n)):
        raise ValueError("pass_at_k: need 0 ≤ num_correct ≤ num_samples")
    if k < 1 or (n.size and np.any(k > n)):
        raise ValueError(f"pass_at_k: need 1 ≤ k ≤ num_samples, got k={k}")
    if n.size == 0:
        return np.zeros(n.shape, np.float64)
    i = np.arange(1, int(n.max()) + 1, dtype=np.float64)  # the factors' denominators
    lo, hi = (n - c)[..., None], n[..., None]
    in_product = (i > lo) & (i <= hi)
    # Where n − c ≥ k every factor has i > k, so it is in (0, 1); elsewhere the result is 1.
    terms = np.where(in_product, 1.0 - k / i, 1.0)
    out = 1.0 - np.prod(terms, axis=-1)
    return np.where(n - c < k, 1.0, out)


def pass_at_k_values(correct_pk: Any, k: int) -> np.ndarray:
    """``f64[P]``: each prompt's pass@k estimate from its row of ``bool[P, K]`` verdicts."""
    correct = _matrix(correct_pk, "correct_pk").astype(bool)
    n = np.full(correct.shape[0], correct.shape[1], np.int64)
    return pass_at_k(n, correct.sum(axis=1).astype(np.int64), k)


def mean_values(reward_pk: Any) -> np.ndarray:
    """``f64[P]``: each prompt's mean over its ``K`` samples (mean@K)."""
    return _matrix(reward_pk, "reward_pk").astype(np.float64).mean(axis=1)


def best_values(reward_pk: Any) -> np.ndarray:
    """``f64[P]``: each prompt's best (largest) value over its ``K`` samples (best@K)."""
    return _matrix(reward_pk, "reward_pk").astype(np.float64).max(axis=1)


def majority_vote(answers: Sequence[Hashable], *, invalid: Hashable = None) -> int | None:
    """The index of the first sample of the most common answer; ``None`` when every answer is
    ``invalid`` (no parsable answer). Ties go to the answer that appears first."""
    counts: dict[Hashable, int] = {}
    first: dict[Hashable, int] = {}
    for j, a in enumerate(answers):
        if _is_invalid(a, invalid):
            continue
        counts[a] = counts.get(a, 0) + 1
        first.setdefault(a, j)
    if not counts:
        return None
    # max over (count, −first index): the most votes, then the earliest answer.
    best = max(counts, key=lambda a: (counts[a], -first[a]))
    return first[best]


def majority_values(answers_pk: Any, correct_pk: Any, *, invalid: Hashable = None) -> np.ndarray:
    """``f64[P]``: 1 where the majority answer's (first) sample is correct, else 0 (maj@K).

    Args:
      answers_pk: ``[P, K]`` parsed answers (any hashable values; ``invalid`` ones do not vote).
      correct_pk: ``bool[P, K]`` verdicts.
      invalid: the value meaning "no answer" (default ``None``; e.g. ``-1`` for integer ids).
    """
    correct = _matrix(correct_pk, "correct_pk").astype(bool)
    answers = np.asarray(answers_pk, dtype=object)
    if answers.shape != correct.shape:
        raise ValueError(f"answers_pk {answers.shape} and correct_pk {correct.shape} differ")
    out = np.zeros(correct.shape[0], np.float64)
    for p in range(correct.shape[0]):
        j = majority_vote(list(answers[p]), invalid=invalid)
        out[p] = 0.0 if j is None else float(correct[p, j])
    return out


def bootstrap_ci(
    values_p: Any,
    *,
    num_resamples: int = NUM_RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile-bootstrap interval ``(low, high)`` of the mean of per-prompt ``values_p``.

    Draws ``num_resamples`` samples of the ``P`` prompts with replacement (``numpy`` PCG64 from
    ``seed``), takes each one's mean, and returns the ``(1 ∓ confidence)/2`` quantiles of those
    means. With one prompt (or equal values) the interval is the point. ``(nan, nan)`` for none.
    """
    values = np.asarray(values_p, np.float64).reshape(-1)
    if not 0 < confidence < 1:
        raise ValueError(f"bootstrap_ci: confidence must be in (0, 1), got {confidence}")
    if num_resamples < 1:
        raise ValueError(f"bootstrap_ci: num_resamples must be ≥ 1, got {num_resamples}")
    if values.size == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, values.size, size=(num_resamples, values.size))
    means = values[idx].mean(axis=1)
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    return float(low), float(high)


def pass_ks(num_samples: int) -> list[int]:
    """The ``k`` of the reported pass@k: 1, 2, 4, ... (powers of two) up to ``K``, and ``K``."""
    ks, k = [], 1
    while k <= num_samples:
        ks.append(k)
        k *= 2
    if num_samples >= 1 and ks[-1] != num_samples:
        ks.append(num_samples)
    return ks


def sampled_metrics(
    reward_pk: Any,
    correct_pk: Any | None = None,
    answers_pk: Any | None = None,
    *,
    prefix: str = "eval/",
    invalid: Hashable = None,
    num_resamples: int = NUM_RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = 0,
) -> dict[str, float]:
    """The metrics of ``K`` samples per prompt, each with ``_ci_low`` / ``_ci_high``.

    Keys (``K`` the number of columns, ``k`` in :func:`pass_ks`): ``{prefix}mean@K`` and
    ``{prefix}best@K`` of the rewards; with ``correct_pk``, ``{prefix}pass@k`` for every ``k``;
    with ``correct_pk`` and ``answers_pk``, ``{prefix}maj@K``. Every metric ``m`` comes with
    ``m_ci_low`` and ``m_ci_high`` (:func:`bootstrap_ci`, the same ``seed`` for each).
    """
    reward = _matrix(reward_pk, "reward_pk")
    k_all = reward.shape[1]
    per_prompt: dict[str, np.ndarray] = {
        f"mean@{k_all}": mean_values(reward),
        f"best@{k_all}": best_values(reward),
    }
    if correct_pk is not None:
        correct = _matrix(correct_pk, "correct_pk")
        if correct.shape != reward.shape:
            raise ValueError(f"correct_pk {correct.shape} and reward_pk {reward.shape} differ")
        for k in pass_ks(k_all):
            per_prompt[f"pass@{k}"] = pass_at_k_values(correct, k)
        if answers_pk is not None:
            per_prompt[f"maj@{k_all}"] = majority_values(answers_pk, correct, invalid=invalid)
    out: dict[str, float] = {}
    for name, values in per_prompt.items():
        low, high = bootstrap_ci(
            values, num_resamples=num_resamples, confidence=confidence, seed=seed
        )
        key = prefix + name
        out[key] = float(values.mean()) if values.size else float("nan")
        out[key + "_ci_low"] = low
        out[key + "_ci_high"] = high
    return out


def _is_invalid(a: Any, invalid: Any) -> bool:
    if invalid is None:
        return a is None
    return a is None or a == invalid


def _matrix(x: Any, name: str) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim != 2 or a.shape[1] < 1:
        raise ValueError(f"{name} must be [num_prompts, K] with K ≥ 1, got shape {a.shape}")
    return a


__all__ = [
    "CONFIDENCE",
    "NUM_RESAMPLES",
    "best_values",
    "bootstrap_ci",
    "majority_values",
    "majority_vote",
    "mean_values",
    "pass_at_k",
    "pass_at_k_values",
    "pass_ks",
    "sampled_metrics",
]
