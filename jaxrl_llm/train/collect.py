"""From prompts to update batches: generation, rewards, selection, forward passes, advantages.

:func:`collect` generates G samples per prompt, scores them on the host and applies the recipe's
selection: PODS keeps ``pods_num_keep`` of the G samples of each prompt (gathered, so the update
sees ``[B, m]``); DAPO's dynamic sampling drops prompts whose G rewards are all equal and
refills them from the next prompts of the stream (at most ``train.max_refill_batches`` extra
batches of B prompts; groups still missing stay in the batch as non-members with zero loss, so
shapes are static). :func:`build_update_batch` runs the forward passes the recipe needs (π_old
only for several updates per batch or a KL folded into the reward, π_ref when β > 0, critic
values for PPO), the advantage chain with its carried state, and the critic's targets.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import chain as ch
from jaxrl_llm import distributed as dist
from jaxrl_llm import objective
from jaxrl_llm import rewards as R
from jaxrl_llm.config import TrainConfig
from jaxrl_llm.core import kl as _kl
from jaxrl_llm.data import BatchIterator
from jaxrl_llm.recipe import Recipe, kl_reward_stages, reward_stages
from jaxrl_llm.train import state as st
from jaxrl_llm.train import update as up
from jaxrl_llm.train.run import Run

# ---------------------------------------------------------------------------------------------
# Generation and rewards (host side).


@dataclasses.dataclass
class Groups:
    """B prompts × G completions on the host."""

    prompt_ids: np.ndarray  # int32[B, P]
    prompt_mask: np.ndarray  # bool[B, P]
    tokens: np.ndarray  # int32[B, G, T]
    mask: np.ndarray  # bool[B, G, T]
    logp: np.ndarray  # f32[B, G, T] sampler log-probs
    truncated: np.ndarray  # bool[B, G]
    reward: np.ndarray  # f32[B, G]
    member: np.ndarray  # bool[B, G]

    def take(self, rows: list[int], member: np.ndarray | None = None) -> Groups:
        out = Groups(**{f.name: getattr(self, f.name)[rows] for f in dataclasses.fields(self)})
        if member is not None:
            out.member = member
        return out


def _left_pad(ids: np.ndarray, mask: np.ndarray, width: int, pad: int):
    extra = width - ids.shape[1]
    if extra <= 0:
        return ids, mask
    return (
        np.pad(ids, ((0, 0), (extra, 0)), constant_values=pad),
        np.pad(mask, ((0, 0), (extra, 0))),
    )


def _concat(parts: list[Groups], pad: int) -> Groups:
    width = max(p.prompt_ids.shape[1] for p in parts)
    padded = [_left_pad(p.prompt_ids, p.prompt_mask, width, pad) for p in parts]
    out = {
        f.name: np.concatenate([getattr(p, f.name) for p in parts])
        for f in dataclasses.fields(Groups)
    }
    out["prompt_ids"] = np.concatenate([p[0] for p in padded])
    out["prompt_mask"] = np.concatenate([p[1] for p in padded])
    return Groups(**out)


def sample_completions(
    run: Run,
    params,
    prompt_ids,
    prompt_mask,
    key,
    *,
    num_samples,
    greedy=False,
    max_new_tokens=None,
):
    from jaxrl_llm import rollout

    r = run.config.rollout
    # generate() runs on the parameters' mesh by itself (batch over the data axes).
    out = rollout.generate(
        (run.setup.graphdef, params),
        prompt_ids,
        prompt_mask,
        rng=key,
        max_new_tokens=max_new_tokens or r.max_new_tokens,
        num_samples=num_samples,
        temperature=0.0 if greedy else r.temperature,
        top_k=0 if greedy else r.top_k,
        top_p=1.0 if greedy else r.top_p,
        stop_token_ids=run.stop_ids,
        cache_dtype=None if r.cache_dtype == "auto" else jnp.dtype(r.cache_dtype),
    )
    return jax.tree.map(np.asarray, jax.device_get(out))


def score_completions(run: Run, prompts, fields, tokens, mask):
    from jaxrl_llm import rollout

    texts = rollout.decode_completions(run.tokenizer, tokens, mask)
    num_tokens = mask.sum(-1)
    reward_bg, out = R.score_groups(run.reward, prompts, texts, fields, num_tokens_bg=num_tokens)
    return reward_bg.astype(np.float32), out, texts


def _gather_reward_output(out: R.RewardOutput) -> R.RewardOutput:
    """Every process's scores, in process order (error counts summed)."""
    if not dist.is_multiprocess():
        return out
    names = sorted(out.num_errors)
    total, components, correct, errors = dist.gather(
        (
            out.total_n,
            out.components,
            out.correct_n,
            np.asarray([[out.num_errors[k] for k in names]], np.int64),
        )
    )
    counts = errors.sum(axis=0)
    return R.RewardOutput(
        total_n=total,
        components=components,
        num_errors={k: int(c) for k, c in zip(names, counts, strict=True)},
        correct_n=correct,
    )


def _generate_round(run: Run, params, batch, key) -> tuple[Groups, R.RewardOutput, dict]:
    """Samples and scores one global batch of prompts; every process returns all its groups.

    In a multi-process run each process generates for and scores only its own rows of the
    batch (:func:`~jaxrl_llm.distributed.process_rows`), then the groups are gathered so that
    selection and metrics see the global batch in the order of a single-process run.
    """
    r = run.config.rollout
    rows = run.process_prompt_rows(len(batch.prompts))
    t0 = time.perf_counter()
    out = sample_completions(
        run,
        params,
        batch.prompt_ids_bt[rows],
        batch.prompt_mask_bt[rows],
        key,
        num_samples=r.num_samples,
    )
    t1 = time.perf_counter()
    reward_bg, reward_out, _ = score_completions(
        run,
        batch.prompts[rows],
        {k: v[rows] for k, v in batch.fields.items()},
        out.tokens,
        out.mask,
    )
    t2 = time.perf_counter()
    local = dict(
        tokens=out.tokens.astype(np.int32),
        mask=out.mask.astype(bool),
        logp=out.logprobs.astype(np.float32),
        truncated=out.truncated.astype(bool),
        reward=reward_bg,
    )
    local, reward_out = dist.gather(local), _gather_reward_output(reward_out)
    groups = Groups(
        prompt_ids=np.asarray(batch.prompt_ids_bt, np.int32),
        prompt_mask=np.asarray(batch.prompt_mask_bt, bool),
        **local,
        member=np.ones(local["reward"].shape, bool),
    )
    return groups, reward_out, {"time/rollout": t1 - t0, "time/reward": t2 - t1}


def _select(recipe: Recipe, groups: Groups) -> np.ndarray:
    rollout = ch.Rollout(reward_bg=jnp.asarray(groups.reward), mask_bgt=jnp.asarray(groups.mask))
    return np.asarray(objective.select(recipe, rollout).mask_bg)


def collect(run: Run, params, it: BatchIterator, key) -> tuple[Groups, dict[str, float]]:
    """Generates, scores and selects this step's groups (see the module docstring)."""
    recipe = run.recipe
    b = run.config.rollout.prompts_per_step
    dynamic = recipe.selection.dynamic_sampling
    kept: list[Groups] = []
    dropped: list[Groups] = []
    metrics: dict[str, float] = {}
    times = {"time/rollout": 0.0, "time/reward": 0.0}
    rounds = 0
    while True:
        groups, reward_out, t = _generate_round(
            run, params, it.next_batch(), jax.random.fold_in(key, rounds)
        )
        for k, v in t.items():
            times[k] += v
        if rounds == 0:
            metrics.update(reward_out.metrics())
            metrics["groups/zero_std_fraction"] = float(
                np.mean(np.all(groups.reward == groups.reward[:, :1], axis=1))
            )
            metrics["response_length/mean"] = float(groups.mask.sum(-1).mean())
            metrics["response_length/max"] = float(groups.mask.sum(-1).max())
            metrics["response_length/truncated_fraction"] = float(groups.truncated.mean())
            metrics["perf/generated_tokens"] = float(groups.mask.sum())
        member = _select(recipe, groups)
        if recipe.selection.pods_num_keep is not None:
            m = recipe.selection.pods_num_keep
            order = np.argsort(~member, axis=1, kind="stable")[:, :m]
            take = lambda x, order=order: np.take_along_axis(
                x, order.reshape(order.shape + (1,) * (x.ndim - 2)), axis=1
            )
            groups = dataclasses.replace(
                groups,
                tokens=take(groups.tokens),
                mask=take(groups.mask),
                logp=take(groups.logp),
                truncated=take(groups.truncated),
                reward=take(groups.reward),
                member=take(member),
            )
            member = groups.member
        groups.member = member
        if not dynamic:
            kept = [groups]
            break
        keep_b = member.any(axis=1)
        kept += [groups.take([i]) for i in np.flatnonzero(keep_b)]
        dropped += [groups.take([i]) for i in np.flatnonzero(~keep_b)]
        if len(kept) >= b or rounds >= run.config.train.max_refill_batches:
            break
        rounds += 1
    if dynamic:
        metrics["selection/refill_batches"] = float(rounds)
        metrics["selection/kept_groups_fraction"] = min(len(kept), b) / b
        filler = [dataclasses.replace(g, member=np.zeros_like(g.member)) for g in dropped]
        parts = (kept + filler)[:b]
        final = _concat(parts, pad=run.data.train.pad_id)
    else:
        final = _concat(kept, pad=run.data.train.pad_id)
    metrics.update(times)
    return final, metrics


# ---------------------------------------------------------------------------------------------
# From groups to an update batch.


@functools.partial(jax.jit, static_argnums=0)
def _advantages(recipe: Recipe, rollout: ch.Rollout, kl_state):
    return ch.apply(recipe.advantage, rollout, kl_state)


@functools.cache
def _returns_chain(recipe: Recipe) -> ch.AdvantageTransform:
    """The PPO critic's targets: the recipe's reward shaping and KL, then GAE, unwhitened."""
    n = recipe.numerics
    hp = recipe.hparams
    controller = None
    if recipe.beta > 0:
        controller = _kl.fixed_kl_controller(recipe.beta)
    stages = (
        *reward_stages(n),
        *kl_reward_stages(recipe.beta, recipe.kl_estimator, n, controller),
        ch.gae(hp.get("gamma", 1.0), hp.get("lam", 0.95)),
    )
    return ch.chain(*stages)


@functools.partial(jax.jit, static_argnums=0)
def _value_targets(recipe: Recipe, rollout: ch.Rollout, kl_state):
    transform = _returns_chain(recipe)
    beta = st.kl_beta(kl_state)
    state = transform.init(rollout)
    if beta is not None:
        state = jax.tree.map(
            lambda s: _kl.KLControllerState(beta) if isinstance(s, _kl.KLControllerState) else s,
            state,
            is_leaf=lambda s: isinstance(s, _kl.KLControllerState),
        )
    adv, _ = ch.apply(transform, rollout, state)
    mask = ch.token_mask(rollout)
    return jnp.where(mask, adv + rollout.value_bgt, 0.0)


def _global_batch(run: Run, batch):
    """Several processes: the batch's host arrays become global arrays, each process giving
    its own rows (``make_array_from_process_local_data``); one process: unchanged."""
    if not dist.is_multiprocess():
        return batch
    return jax.tree.map(lambda x: x if isinstance(x, jax.Array) else run.to_batch_device(x), batch)


def needs_old_logprob_pass(config: TrainConfig, recipe: Recipe) -> bool:
    """Whether π_old is recomputed by a forward pass before the update."""
    if config.old_logprobs.source != "recompute":
        return False
    several = st.updates_per_step(config) > 1
    return several or (recipe.kl_in_reward and recipe.beta > 0)


def build_update_batch(run: Run, state: st.TrainState, groups: Groups):
    """``(UpdateBatch, new kl_state, metrics)`` for the selected groups."""
    config, recipe, setup = run.config, run.recipe, run.setup
    b, g, t = groups.tokens.shape
    n = b * g
    prompt_ids = np.repeat(groups.prompt_ids, g, axis=0)
    prompt_mask = np.repeat(groups.prompt_mask, g, axis=0)
    tokens_nl = np.concatenate([prompt_ids, groups.tokens.reshape(n, t)], axis=1)
    input_mask_nl = np.concatenate([prompt_mask, groups.mask.reshape(n, t)], axis=1)
    tokens_d, mask_d = run.to_batch_device(tokens_nl), run.to_batch_device(input_mask_nl)
    metrics: dict[str, float] = {}
    t0 = time.perf_counter()
    shape = lambda x: None if x is None else x.reshape(b, g, t)
    # Several processes: host arrays enter the chain as global arrays built from each
    # process's rows, like the token batch; one process keeps its plain device arrays.
    put = run.to_batch_device if dist.is_multiprocess() else jnp.asarray
    logp_old = logp_ref = values = None
    with jax.set_mesh(run.mesh):
        if needs_old_logprob_pass(config, recipe):
            logp_old = run.logprob(state.params, tokens_d, mask_d, completion_len=t)
        if setup.ref_params is not None:
            logp_ref = run.logprob(setup.ref_params, tokens_d, mask_d, completion_len=t)
        if run.values is not None:
            values = run.values(state.critic_params, tokens_d, mask_d, completion_len=t)
        sampler = config.old_logprobs.source == "sampler"
        chain_old = (
            logp_old
            if logp_old is not None
            else (put(groups.logp.reshape(n, t)) if sampler or recipe.kl_in_reward else None)
        )
        rollout = ch.Rollout(
            reward_bg=put(groups.reward),
            mask_bgt=put(groups.mask),
            mask_bg=put(groups.member),
            logp_old_bgt=shape(chain_old),
            logp_ref_bgt=shape(logp_ref),
            value_bgt=shape(values),
        )
        adv_bgt, kl_state = _advantages(recipe, rollout, state.kl_state)
        returns = _value_targets(recipe, rollout, state.kl_state) if recipe.needs_critic else None
        token_mask = ch.token_mask(rollout)
        valid = dist.to_host(token_mask)
        adv = dist.to_host(adv_bgt)[valid]
        if adv.size:
            metrics.update(
                {
                    "advantages/mean": float(adv.mean()),
                    "advantages/std": float(adv.std()),
                    "advantages/min": float(adv.min()),
                    "advantages/max": float(adv.max()),
                }
            )
        if recipe.kl_in_reward and logp_ref is not None and chain_old is not None:
            kl_seq = _kl.mean_sequence_kl(_kl.kl_k1(shape(chain_old), shape(logp_ref)), token_mask)
            metrics["kl/rollout"] = float(kl_seq)
        beta = st.kl_beta(kl_state)
        if beta is not None:
            metrics["kl/beta"] = float(beta)
    metrics["time/forward"] = time.perf_counter() - t0
    flat = lambda x: None if x is None else jnp.reshape(x, (n, t))
    batch = up.UpdateBatch(
        tokens_nl=tokens_nl,
        input_mask_nl=input_mask_nl,
        mask_nt=valid.reshape(n, t),
        adv_nt=flat(adv_bgt),
        logp_old_nt=flat(logp_old),
        logp_sampler_nt=put(groups.logp.reshape(n, t)) if sampler else None,
        logp_ref_nt=flat(logp_ref),
        value_old_nt=flat(values),
        return_nt=flat(returns),
    )
    batch = _global_batch(run, batch)
    metrics["perf/tokens"] = float(input_mask_nl.sum())
    return batch, kl_state, metrics


# ---------------------------------------------------------------------------------------------
# DPO batches.


def dpo_batch(run: Run, pairs) -> tuple[up.DPOBatch, dict[str, float]]:
    """A :class:`DPOBatch` (reference log-probs included) from a data PreferenceBatch."""
    p = np.asarray(pairs.prompt_ids_bt, np.int32)
    pm = np.asarray(pairs.prompt_mask_bt, bool)
    fields = {}
    for side in ("chosen", "rejected"):
        ids = np.asarray(getattr(pairs, f"{side}_ids_bt"), np.int32)
        mask = np.asarray(getattr(pairs, f"{side}_mask_bt"), bool)
        fields[f"{side}_tokens_nl"] = np.concatenate([p, ids], axis=1)
        fields[f"{side}_input_mask_nl"] = np.concatenate([pm, mask], axis=1)
        fields[f"{side}_mask_nt"] = mask
    t0 = time.perf_counter()
    if run.setup.ref_params is not None:
        with jax.set_mesh(run.mesh):
            for side in ("chosen", "rejected"):
                logp = run.logprob(
                    run.setup.ref_params,
                    run.to_batch_device(fields[f"{side}_tokens_nl"]),
                    run.to_batch_device(fields[f"{side}_input_mask_nl"]),
                    completion_len=fields[f"{side}_mask_nt"].shape[1],
                )
                fields[f"ref_{side}_n"] = jnp.sum(
                    jnp.where(fields[f"{side}_mask_nt"], logp, 0.0), axis=-1
                )
    metrics = {
        "time/forward": time.perf_counter() - t0,
        "perf/tokens": float(
            fields["chosen_input_mask_nl"].sum() + fields["rejected_input_mask_nl"].sum()
        ),
    }
    return _global_batch(run, up.DPOBatch(**fields)), metrics


__all__ = [
    "Groups",
    "build_update_batch",
    "collect",
    "dpo_batch",
    "needs_old_logprob_pass",
    "sample_completions",
    "score_completions",
]
