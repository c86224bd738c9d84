"""Evaluation on the held-out split: accuracy / mean reward of one completion per prompt
(greedy by default) or, with ``num_samples`` K > 1, of K sampled completions per prompt with
pass@k, mean@K, best@K and maj@K (:mod:`~jaxrl_llm.train.eval_metrics`); and DPO's preference
accuracy on held-out pairs."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import distributed as dist
from jaxrl_llm import rewards as R
from jaxrl_llm.data import sequential_batches
from jaxrl_llm.models import sharding as shd
from jaxrl_llm.rewards import answers as A
from jaxrl_llm.rewards.combine import numeric_values
from jaxrl_llm.train import eval_metrics as EM
from jaxrl_llm.train.collect import (
    dpo_batch,
    gather_reward_output,
    sample_completions,
    score_completions,
)
from jaxrl_llm.train.completions import eval_records
from jaxrl_llm.train.setup import PAD_MULTIPLE, Models, Setup

# ---------------------------------------------------------------------------------------------
# Evaluation.


def _eval_batch_size(n: int, models: Models | None = None, num_samples: int = 1) -> int:
    """At most 64 prompts (64 // K with K samples each); with several processes a multiple of
    the data-parallel size, so each process samples its own block of every batch."""
    bs = max(1, min(n, 64 // max(1, num_samples)))
    if models is not None and dist.is_multiprocess():
        dp = shd.data_parallel_size(models.mesh)
        bs = -(-bs // dp) * dp
    return bs


def answer_extractor(reward: R.WeightedSum | None) -> Callable[[str], Any]:
    """``text -> answer`` (hashable, ``None`` when there is none) for maj@K's vote: the answer
    the reward's accuracy term parses (the last number for ``integer_answer``, the number after
    ``####`` for ``gsm8k_answer``, the last ``\\boxed{}``'s contents for ``boxed_answer``, with
    spaces, ``$`` and ``\\left``/``\\right`` dropped and a plain number or ``a/b`` as its
    exact value); for any other accuracy term the whitespace-normalised text. Votes group
    answers by this key, an approximation of the reward's own equivalence for LaTeX answers."""
    term = None
    if reward is not None and reward.accuracy is not None:
        term = next(t.fn for t in reward.terms if t.name == reward.accuracy)
    if isinstance(term, A.IntegerAnswer):
        return A.last_number
    if isinstance(term, A.Gsm8kAnswer):

        def gsm8k(text: str) -> Fraction | None:
            number = A.gsm8k_answer(text)
            return A.last_number(text) if number is None and not term.strict else number

        return gsm8k
    if isinstance(term, A.BoxedAnswer):

        def boxed(text: str) -> Any:
            found = A.extract_boxed(text)
            if found is None:
                return None
            norm = "".join(found.split()).replace("$", "")
            norm = norm.replace("\\left", "").replace("\\right", "").rstrip(".")
            try:  # "0.5" and "1/2" are one answer
                return Fraction(norm)
            except (ValueError, ZeroDivisionError):
                return norm or None

        return boxed
    return lambda text: " ".join(text.split()) or None


def _answer_ids(texts: list[list[str]], extract: Callable[[str], Any]) -> np.ndarray:
    """``int32[B, K]``: per prompt, the samples' answers numbered in order of first appearance
    (equal answers, equal ids), ``-1`` for none; integers, so processes can gather them."""
    out = np.full((len(texts), len(texts[0]) if texts else 0), -1, np.int32)
    for b, group in enumerate(texts):
        seen: dict[Any, int] = {}
        for j, text in enumerate(group):
            answer = extract(text)
            if answer is not None:
                out[b, j] = seen.setdefault(answer, len(seen))
    return out


def evaluate_prompts(
    setup: Setup,
    params: dict,
    *,
    mode: str | None = None,
    max_new_tokens: int | None = None,
    step: int = 0,
    num_samples: int | None = None,
    samples: list[dict] | None = None,
    show: int | None = None,
) -> dict[str, float]:
    """Accuracy and mean reward of one completion per held-out prompt (greedy or sampled).

    ``samples``: a list that receives, as ``completions.jsonl`` records with ``"eval": true``
    (:mod:`~jaxrl_llm.train.completions`), the first ``show`` held-out prompts of this process
    (default ``setup.loop.log_completions``, at most one batch) with their completions.

    With ``num_samples`` K > 1 (default ``setup.evaluation.num_samples``) each prompt gets K
    completions sampled with the rollout's temperature / top-k / top-p, and the metrics of
    :func:`~jaxrl_llm.train.eval_metrics.sampled_metrics` are added: ``eval/mean@K``,
    ``eval/best@K`` (rewards), ``eval/pass@k`` for k = 1, 2, 4, ... ≤ K and K, ``eval/maj@K``
    (with an accuracy term), each with ``_ci_low`` / ``_ci_high`` (95% bootstrap over
    prompts), and ``eval/num_samples``. ``eval/accuracy`` and ``eval/reward_mean`` are then
    the means over all K samples (``eval/accuracy`` = ``eval/pass@1``). DPO evaluates one
    greedy completion.

    What the rewards report (:class:`~jaxrl_llm.rewards.Scores`) is evaluated too:
    ``eval/reward/<term>/<column>/mean`` over the samples for each column of numbers, and
    ``eval/reward/<term>/<metric>`` (the mean over the batches) for each scalar. When the
    prompts have the column ``setup.evaluation.group_by`` (``train.eval_group_by``, verl's
    ``data_source`` by default), every metric but the scalars is also given per value of it,
    as ``eval/<value>/...`` (verl's per-data-source validation metrics).
    """
    ds = setup.data.eval_prompts
    if ds is None or len(ds) == 0:
        return {}
    plan = setup.evaluation
    n_samples = 1 if setup.offline else int(num_samples or plan.num_samples)
    if n_samples < 1:
        raise ValueError(f"num_samples must be ≥ 1, got {n_samples}")
    if n_samples > 1 and mode == "greedy":
        raise ValueError(f"{n_samples} samples per prompt need sampled decoding, not greedy")
    mode = "greedy" if setup.offline else ("sampled" if n_samples > 1 else (mode or plan.mode))
    sampler = plan.sampler
    if max_new_tokens:
        sampler = dataclasses.replace(sampler, max_new_tokens=max_new_tokens)
    if mode == "greedy":
        sampler = sampler.greedy()
    else:
        sampler = dataclasses.replace(sampler, num_samples=n_samples)
    models = setup.models
    bs = _eval_batch_size(len(ds), models, n_samples)
    key = jax.random.fold_in(jax.random.key(plan.seed), step)
    extract = answer_extractor(setup.reward) if n_samples > 1 else None
    correct, rewards, lengths, answers = [], [], [], []
    group_by = plan.group_by if plan.group_by in ds.fields else None
    groups: list[Any] = []
    reported = _Reported()
    for i, batch in enumerate(sequential_batches(ds, bs, pad_multiple=PAD_MULTIPLE)):
        k = len(batch.prompts)
        ids, mask = batch.prompt_ids_bt, batch.prompt_mask_bt
        if k < bs:  # keep one shape: repeat the last prompt, ignore the copies
            ids = np.concatenate([ids, np.repeat(ids[-1:], bs - k, 0)])
            mask = np.concatenate([mask, np.repeat(mask[-1:], bs - k, 0)])
        rows = models.process_rows(bs)
        out = sample_completions(
            models, params, sampler, ids[rows], mask[rows], jax.random.fold_in(key, i)
        )
        # One process scores the k real prompts. Several score all their rows (the copies
        # too), so that every process gathers the same shape; the first k rows are kept.
        mine = slice(rows.start, rows.stop if dist.is_multiprocess() else k)
        num = mine.stop - mine.start
        prompts = batch.prompts + batch.prompts[-1:] * (bs - k)
        fields = {f: list(v) + list(v[-1:]) * (bs - k) for f, v in batch.fields.items()}
        tokens, tmask = out.tokens[:num], out.mask[:num]
        reward_bg, reward_out, texts = score_completions(
            setup.tokenizer,
            setup.reward,
            prompts[mine],
            {f: v[mine] for f, v in fields.items()},
            tokens,
            tmask,
            trainer_state=R.TrainerState(global_step=step, max_steps=setup.loop.max_steps),
        )
        correct_bg = reward_out.correct_n
        if correct_bg is not None:
            correct_bg = np.asarray(correct_bg).reshape(reward_bg.shape)
        if samples is not None and i == 0:
            shown = min(setup.loop.log_completions if show is None else show, num)
            samples.extend(
                eval_records(
                    setup.tokenizer,
                    ids[rows][:shown],
                    mask[rows][:shown],
                    texts[:shown],
                    reward_bg[:shown],
                    tmask[:shown].sum(-1),
                    np.asarray(out.truncated)[:shown],
                    step,
                    details=reward_out.sample_details()[: shown * reward_bg.shape[1]],
                )
            )
        # [rows, K] per process (K = 1: the single sample's column, as before).
        scores = dist.host_allgather(
            {
                "reward": reward_bg,
                "length": tmask.sum(-1),
                "correct": correct_bg,
                "answer": None if extract is None else _answer_ids(texts, extract),
            },
            what="evaluation scores",
            tiled=True,
        )
        reported.add(gather_reward_output(reward_out), k * n_samples)
        if group_by is not None:
            groups.extend(batch.fields[group_by][:k])
        rewards.append(np.asarray(scores["reward"])[:k])
        lengths.append(np.asarray(scores["length"])[:k])
        if scores["correct"] is not None:
            correct.append(np.asarray(scores["correct"])[:k])
        if scores["answer"] is not None:
            answers.append(np.asarray(scores["answer"])[:k])
    reward_pk = np.concatenate(rewards)
    correct_pk = np.concatenate(correct) if correct else None
    length_pk = np.concatenate(lengths)
    answer_pk = np.concatenate(answers) if answers and correct_pk is not None else None

    def summary(rows: np.ndarray | slice, prefix: str) -> dict[str, float]:
        take = lambda x: None if x is None else x[rows]
        out = {
            f"{prefix}reward_mean": float(reward_pk[rows].mean()),
            f"{prefix}response_length": float(length_pk[rows].mean()),
            f"{prefix}num_prompts": float(len(reward_pk[rows])),
        }
        if correct_pk is not None:
            out[f"{prefix}accuracy"] = float(correct_pk[rows].mean())
        if n_samples > 1:
            out[f"{prefix}num_samples"] = float(n_samples)
            out.update(
                EM.sampled_metrics(
                    reward_pk[rows],
                    take(correct_pk),
                    take(answer_pk),
                    prefix=prefix,
                    invalid=-1,
                    seed=plan.seed,
                )
            )
        out.update(reported.column_means(rows, n_samples, prefix=f"{prefix}reward/"))
        return out

    result = summary(slice(None), "eval/")
    result.update(reported.scalar_means(prefix="eval/reward/"))
    if group_by is not None:
        for value in dict.fromkeys(map(str, groups)):  # in order of first appearance
            rows = np.flatnonzero(np.asarray([str(x) == value for x in groups]))
            result.update(summary(rows, f"eval/{value}/"))
    return result


class _Reported:
    """What the rewards reported over an evaluation's batches: each term's columns, one value
    per sample in prompt-major order (``None`` where a batch's rewards reported none), and its
    scalars, one per batch."""

    def __init__(self):
        self.columns: dict[tuple[str, str], list[Any]] = {}
        self.scalars: dict[tuple[str, str], list[float]] = {}
        self.size = 0

    def add(self, out: R.RewardOutput, n: int) -> None:
        """The first ``n`` samples of a batch's (gathered) reward output."""
        for name, columns in out.extras.items():
            for column, values in columns.items():
                have = self.columns.setdefault((name, column), [None] * self.size)
                have.extend(list(values)[:n])
        self.size += n
        for values in self.columns.values():
            values.extend([None] * (self.size - len(values)))
        for name, scalars in out.reported.items():
            for metric, value in scalars.items():
                self.scalars.setdefault((name, metric), []).append(float(value))

    def column_means(self, rows: np.ndarray | slice, k: int, *, prefix: str) -> dict[str, float]:
        """``{prefix}<term>/<column>/mean`` of the columns of numbers over the samples of the
        prompts ``rows`` (``k`` samples each)."""
        out = {}
        for (name, column), values in self.columns.items():
            per_prompt = np.asarray(values, dtype=object).reshape(-1, k)[rows].reshape(-1)
            numbers = numeric_values(per_prompt.tolist())
            if numbers:
                out[f"{prefix}{name}/{column}/mean"] = float(np.mean(numbers))
        return out

    def scalar_means(self, *, prefix: str) -> dict[str, float]:
        """``{prefix}<term>/<metric>``: each scalar's mean over the batches."""
        return {f"{prefix}{n}/{m}": float(np.mean(v)) for (n, m), v in self.scalars.items()}


def evaluate_pairs(
    setup: Setup, params: dict, logprob: Callable[..., jax.Array]
) -> dict[str, float]:
    """DPO: the fraction of held-out pairs whose chosen answer the policy prefers (implicit
    reward margin > 0 against the reference; average log-prob for reference-free SimPO)."""
    ds = setup.data.eval_pairs
    if ds is None or len(ds) == 0:
        return {}
    beta = setup.recipe.beta
    models = setup.models
    wins, margins = [], []
    for pairs in sequential_batches(ds, _eval_batch_size(len(ds)), pad_multiple=PAD_MULTIPLE):
        batch, _ = dpo_batch(models, pairs, logprob)
        seq = {}
        with jax.set_mesh(models.mesh):
            for side in ("chosen", "rejected"):
                mask = getattr(batch, f"{side}_mask_nt")
                logp = logprob(
                    models.full_params(params),
                    getattr(batch, f"{side}_tokens_nl"),
                    getattr(batch, f"{side}_input_mask_nl"),
                    completion_len=mask.shape[1],
                )
                total = dist.to_host(jnp.sum(jnp.where(mask, logp, 0.0), axis=-1))
                ref = getattr(batch, f"ref_{side}_n")
                if ref is None:
                    seq[side] = total / np.maximum(dist.to_host(mask).sum(-1), 1)
                else:
                    seq[side] = beta * (total - dist.to_host(ref))
        margin = seq["chosen"] - seq["rejected"]
        wins.append(margin > 0)
        margins.append(margin)
    return {
        "eval/preference_accuracy": float(np.concatenate(wins).mean()),
        "eval/reward_margin": float(np.concatenate(margins).mean()),
    }


def run_evaluation(
    setup: Setup,
    params: dict,
    *,
    step: int,
    logprob: Callable[..., jax.Array] | None = None,
    mode: str | None = None,
    max_new_tokens: int | None = None,
    num_samples: int | None = None,
    samples: list[dict] | None = None,
    show: int | None = None,
) -> dict[str, float]:
    """The held-out metrics at ``step``: prompts (every run with held-out prompts; K =
    ``num_samples`` samples each, default the plan's) and, for DPO, preference pairs
    (``logprob``: the run's jitted log-prob function). ``samples``, ``show``: see
    :func:`evaluate_prompts`."""
    t0 = time.perf_counter()
    out = evaluate_prompts(
        setup,
        params,
        mode=mode,
        max_new_tokens=max_new_tokens,
        step=step,
        num_samples=num_samples,
        samples=samples,
        show=show,
    )
    if setup.offline and logprob is not None:
        out.update(evaluate_pairs(setup, params, logprob))
    if out:
        out["eval/time"] = time.perf_counter() - t0
    return out


__all__ = [
    "answer_extractor",
    "evaluate_pairs",
    "evaluate_prompts",
    "run_evaluation",
]
