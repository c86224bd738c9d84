"""Evaluation on the held-out split: accuracy / mean reward of one completion per prompt
(greedy by default), and DPO's preference accuracy on held-out pairs."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import distributed as dist
from jaxrl_llm.data import sequential_batches
from jaxrl_llm.models import sharding as shd
from jaxrl_llm.train.collect import dpo_batch, sample_completions, score_completions
from jaxrl_llm.train.setup import PAD_MULTIPLE, Models, Setup

# ---------------------------------------------------------------------------------------------
# Evaluation.


def _eval_batch_size(n: int, models: Models | None = None) -> int:
    """At most 64 prompts; with several processes a multiple of the data-parallel size, so
    each process samples its own block of every batch."""
    bs = max(1, min(n, 64))
    if models is not None and dist.is_multiprocess():
        dp = shd.data_parallel_size(models.mesh)
        bs = -(-bs // dp) * dp
    return bs


def evaluate_prompts(
    setup: Setup,
    params: dict,
    *,
    mode: str | None = None,
    max_new_tokens: int | None = None,
    step: int = 0,
) -> dict[str, float]:
    """Accuracy and mean reward of one completion per held-out prompt (greedy or sampled)."""
    ds = setup.data.eval_prompts
    if ds is None or len(ds) == 0:
        return {}
    plan = setup.evaluation
    mode = "greedy" if setup.offline else (mode or plan.mode)
    sampler = plan.sampler
    if max_new_tokens:
        sampler = dataclasses.replace(sampler, max_new_tokens=max_new_tokens)
    if mode == "greedy":
        sampler = sampler.greedy()
    models = setup.models
    bs = _eval_batch_size(len(ds), models)
    key = jax.random.fold_in(jax.random.key(plan.seed), step)
    correct, rewards, lengths = [], [], []
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
        reward_bg, reward_out, _ = score_completions(
            setup.tokenizer,
            setup.reward,
            prompts[mine],
            {f: v[mine] for f, v in fields.items()},
            tokens,
            tmask,
        )
        scores = dist.gather(
            {
                "reward": reward_bg[:, 0],
                "length": tmask.sum(-1)[:, 0],
                "correct": None if reward_out.correct_n is None else reward_out.correct_n,
            }
        )
        rewards.append(np.asarray(scores["reward"])[:k])
        lengths.append(np.asarray(scores["length"])[:k])
        if scores["correct"] is not None:
            correct.append(np.asarray(scores["correct"])[:k])
    out = {
        "eval/reward_mean": float(np.concatenate(rewards).mean()),
        "eval/response_length": float(np.concatenate(lengths).mean()),
        "eval/num_prompts": float(len(ds)),
    }
    if correct:
        out["eval/accuracy"] = float(np.concatenate(correct).mean())
    return out


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
                    params,
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
) -> dict[str, float]:
    """The held-out metrics at ``step``: prompts (every run with held-out prompts) and, for
    DPO, preference pairs (``logprob``: the run's jitted log-prob function)."""
    t0 = time.perf_counter()
    out = evaluate_prompts(setup, params, mode=mode, max_new_tokens=max_new_tokens, step=step)
    if setup.offline and logprob is not None:
        out.update(evaluate_pairs(setup, params, logprob))
    if out:
        out["eval/time"] = time.perf_counter() - t0
    return out


__all__ = [
    "evaluate_pairs",
    "evaluate_prompts",
    "run_evaluation",
]
