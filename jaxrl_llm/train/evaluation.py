"""Evaluation on the held-out split: accuracy / mean reward of one completion per prompt
(greedy by default), and DPO's preference accuracy on held-out pairs."""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import distributed as dist
from jaxrl_llm.data import sequential_batches
from jaxrl_llm.models import sharding as shd
from jaxrl_llm.train import data as run_data
from jaxrl_llm.train.batches import dpo_batch, sample_completions, score_completions
from jaxrl_llm.train.run import PAD_MULTIPLE, Run

# ---------------------------------------------------------------------------------------------
# Evaluation.


def _eval_batch_size(n: int, run: Run | None = None) -> int:
    """At most 64 prompts; with several processes a multiple of the data-parallel size, so
    each process samples its own block of every batch."""
    bs = max(1, min(n, 64))
    if run is not None and dist.is_multiprocess():
        dp = shd.data_parallel_size(run.mesh)
        bs = -(-bs // dp) * dp
    return bs


def evaluate_prompts(
    run: Run, params, *, mode: str | None = None, max_new_tokens: int | None = None, step: int = 0
) -> dict[str, float]:
    """Accuracy and mean reward of one completion per held-out prompt (greedy or sampled)."""
    ds = run.data.eval_prompts
    if ds is None or len(ds) == 0:
        return {}
    c = run.config
    mode = mode or c.train.eval_mode
    reward = run.reward or run_data.build_run_reward(c)
    if c.rollout is None:  # dpo: greedy answers of the pairs' length
        max_new = max_new_tokens or c.train.eval_max_new_tokens or c.preference.max_response_length
        run = dataclasses.replace(
            run,
            config=dataclasses.replace(
                c, rollout=dataclasses.replace(_default_rollout(), max_new_tokens=max_new)
            ),
        )
        mode = "greedy"
    max_new = max_new_tokens or c.train.eval_max_new_tokens or run.config.rollout.max_new_tokens
    bs = _eval_batch_size(len(ds), run)
    key = jax.random.fold_in(jax.random.key(c.train.seed + 1), step)
    correct, rewards, lengths = [], [], []
    for i, batch in enumerate(sequential_batches(ds, bs, pad_multiple=PAD_MULTIPLE)):
        k = len(batch.prompts)
        ids, mask = batch.prompt_ids_bt, batch.prompt_mask_bt
        if k < bs:  # keep one shape: repeat the last prompt, ignore the copies
            ids = np.concatenate([ids, np.repeat(ids[-1:], bs - k, 0)])
            mask = np.concatenate([mask, np.repeat(mask[-1:], bs - k, 0)])
        rows = run.process_prompt_rows(bs)
        out = sample_completions(
            run,
            params,
            ids[rows],
            mask[rows],
            jax.random.fold_in(key, i),
            num_samples=1,
            greedy=mode == "greedy",
            max_new_tokens=max_new,
        )
        # One process scores the k real prompts. Several score all their rows (the copies
        # too), so that every process gathers the same shape; the first k rows are kept.
        mine = slice(rows.start, rows.stop if dist.is_multiprocess() else k)
        num = mine.stop - mine.start
        prompts = batch.prompts + batch.prompts[-1:] * (bs - k)
        fields = {f: list(v) + list(v[-1:]) * (bs - k) for f, v in batch.fields.items()}
        tokens, tmask = out.tokens[:num], out.mask[:num]
        reward_bg, reward_out, _ = score_completions(
            dataclasses.replace(run, reward=reward),
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


def _default_rollout():
    from jaxrl_llm.config import RolloutConfig

    return RolloutConfig(prompts_per_step=1, num_samples=1)


def evaluate_pairs(run: Run, params) -> dict[str, float]:
    """DPO: the fraction of held-out pairs whose chosen answer the policy prefers (implicit
    reward margin > 0 against the reference; average log-prob for reference-free SimPO)."""
    ds = run.data.eval_pairs
    if ds is None or len(ds) == 0:
        return {}
    beta = float(run.recipe.hparams["beta"])
    wins, margins = [], []
    for pairs in sequential_batches(ds, _eval_batch_size(len(ds)), pad_multiple=PAD_MULTIPLE):
        batch, _ = dpo_batch(run, pairs)
        seq = {}
        with jax.set_mesh(run.mesh):
            for side in ("chosen", "rejected"):
                mask = getattr(batch, f"{side}_mask_nt")
                logp = run.logprob(
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
    run: Run, params, *, step: int, mode: str | None = None, max_new_tokens: int | None = None
) -> dict[str, float]:
    t0 = time.perf_counter()
    out = evaluate_prompts(run, params, mode=mode, max_new_tokens=max_new_tokens, step=step)
    if run.config.is_offline:
        out.update(evaluate_pairs(run, params))
    if out:
        out["eval/time"] = time.perf_counter() - t0
    return out


__all__ = [
    "evaluate_pairs",
    "evaluate_prompts",
    "run_evaluation",
]
