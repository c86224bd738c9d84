"""Update steps: one factory for the on-policy recipes, one for DPO.

:func:`make_update_step` returns ``step(state, batch) -> (state, metrics)``, one jit (with in/out
shardings and the state donated when a mesh is given) that runs PPO-style epochs over
minibatches of a rollout batch:

    for epoch in range(ppo_epochs):            # lax.scan
      for minibatch in minibatches:            # lax.scan; one optimizer update each
        D = aggregation(0, mask_minibatch)[1]  # the global denominator, from the masks alone
        g = Σ_micro ∇θ sum_micro               # lax.scan over micro-batches
        θ ← optimizer(clip(g / max(D, 1)))

Because every loss of the core is a ``(sum, denominator)`` pair whose denominator depends only
on the mask, accumulating the gradients of the sums and dividing once by the minibatch's
denominator is *exactly* the gradient of the whole-minibatch loss: micro-batching changes memory,
not results (up to float summation order; tested to 1e-6).

Splitting. A batch of N sequences with M minibatches of K micro-batches of m sequences
(N = M·K·m) is split *strided*: micro-step s = j·K + k (minibatch j) takes rows {i·M·K + s}.
Row ``i·S + s`` sits in the same place of the data-parallel layout for every s, so each
device feeds each micro-batch from its own rows: no data moves between devices. Minibatches are
the same every epoch (no reshuffling).

Old log-probs (π_old of the importance ratio), by the batch's fields:

* ``logp_old_nt`` given: the recomputed log-probs of the policy before the update
  (``old_logprobs.source: recompute``; needed when there are several updates per batch).
* ``logp_old_nt`` and ``logp_sampler_nt`` both None: on-policy, π_old = sg(π_θ) at the time of
  the (single) update. With one epoch and one minibatch this equals the recompute, without the
  extra forward pass.
* ``logp_sampler_nt`` given (``source: sampler``): no recompute; truncated importance sampling
  corrects the sampler/trainer mismatch (Yao et al. 2025, "Your Efficient RL Framework Secretly
  Brings You Off-Policy RL Training"). Per token, with μ the sampler's probability,

      w_t = min(exp(sg(log π_θ(y_t)) − log μ(y_t)), C)       (C = tis_cap; no min when None)
      π_old := sg(π_θ)   (the recipe's ratio is 1 in value)   and   A_t ← w_t·A_t

  so every recipe's policy gradient becomes E_μ[min(π_θ/μ, C)·A·∇log π_θ], the truncated-IS
  estimator. There is no trust region: PPO's clip is inactive, so use ``recompute`` for
  several epochs or minibatches. The KL and entropy terms are not reweighted.

Metrics (f32 scalars, means over the epoch × minibatch updates): ``actor/loss`` (the total),
``actor/pg_loss``, ``actor/kl_loss`` (the recipe's KL term), ``actor/entropy`` (token mean),
``actor/kl_ref`` (token mean of k3(π_θ ‖ π_ref) when reference log-probs are given),
``actor/clip_fraction`` and friends (:func:`~jaxrl_llm.core.policy_losses.ratio_metrics`),
``actor/grad_norm`` (before clipping), ``actor/lr``, ``update/nonfinite`` (updates skipped for a
non-finite gradient: the parameters and optimizer state are kept), and for PPO
``critic/loss``, ``critic/value_mean``, ``critic/clip_fraction``, ``critic/grad_norm``,
``critic/lr``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_llm import objective
from jaxrl_llm.core import aggregation as agg
from jaxrl_llm.core import kl as _kl
from jaxrl_llm.core import policy_losses as pl
from jaxrl_llm.core import preference as pref
from jaxrl_llm.models import sharding as shd
from jaxrl_llm.models.logprobs import completion_logprobs
from jaxrl_llm.recipe import Recipe
from jaxrl_llm.train.state import Schedule, TrainState

_sg = jax.lax.stop_gradient
Pair = tuple[jax.Array, jax.Array]


class UpdateBatch(NamedTuple):
    """N sequences (prompt + completion) of a rollout, flattened from ``[B, G]``.

    Attributes:
      tokens_nl: ``int32[N, P + T]`` left-padded prompt (P slots) then the completion (T slots).
      input_mask_nl: ``bool[N, P + T]`` real tokens (attention; positions count them).
      mask_nt: ``bool[N, T]`` completion tokens that carry loss (False on padding and on rows
        that selection dropped).
      adv_nt: ``f32[N, T]`` advantages.
      logp_old_nt: ``f32[N, T]`` recomputed π_old, or None (see the module docstring).
      logp_sampler_nt: ``f32[N, T]`` the sampler's log-probs for truncated IS, or None.
      logp_ref_nt: ``f32[N, T]`` reference log-probs (KL in the loss, metrics), or None.
      value_old_nt: ``f32[N, T]`` critic values at rollout time (PPO), or None.
      return_nt: ``f32[N, T]`` the critic's regression targets (PPO), or None.
    """

    tokens_nl: jax.Array
    input_mask_nl: jax.Array
    mask_nt: jax.Array
    adv_nt: jax.Array
    logp_old_nt: jax.Array | None = None
    logp_sampler_nt: jax.Array | None = None
    logp_ref_nt: jax.Array | None = None
    value_old_nt: jax.Array | None = None
    return_nt: jax.Array | None = None


class DPOBatch(NamedTuple):
    """N preference pairs; chosen and rejected share the prompt slots P and answer slots T.

    Attributes:
      chosen_tokens_nl, rejected_tokens_nl: ``int32[N, P + T]`` prompt then answer.
      chosen_input_mask_nl, rejected_input_mask_nl: ``bool[N, P + T]`` real tokens.
      chosen_mask_nt, rejected_mask_nt: ``bool[N, T]`` answer tokens.
      ref_chosen_n, ref_rejected_n: ``f32[N]`` reference sequence log-probs (None for SimPO).
    """

    chosen_tokens_nl: jax.Array
    chosen_input_mask_nl: jax.Array
    chosen_mask_nt: jax.Array
    rejected_tokens_nl: jax.Array
    rejected_input_mask_nl: jax.Array
    rejected_mask_nt: jax.Array
    ref_chosen_n: jax.Array | None = None
    ref_rejected_n: jax.Array | None = None


# ---------------------------------------------------------------------------------------------
# The shared engine: epochs × minibatches × micro-batches with exact accumulation.


class _Trainee(NamedTuple):
    """One model updated by the step.

    ``sums(params, micro) -> (loss_sum, {metric: (sum, den)})``; ``denominator(minibatch)`` is
    the loss denominator of a whole minibatch (from masks only).
    """

    name: str
    tx: optax.GradientTransformation
    sums: Callable[[Any, Any], tuple[jax.Array, dict[str, Pair]]]
    denominator: Callable[[Any], jax.Array]
    schedule: Schedule | None
    param_sharding: Any = None  # lays out the gradient accumulators like the parameters


def _pair(x: jax.Array, mask: jax.Array) -> Pair:
    """Token-mean pair of ``x`` over ``mask``."""
    total = jnp.sum(jnp.where(mask, jnp.asarray(x, jnp.float32), 0.0))
    return total, jnp.sum(mask, dtype=jnp.int32).astype(jnp.float32)


def _add(a: Any, b: Any) -> Any:
    return jax.tree.map(jnp.add, a, b)


def _split(x: jax.Array, num_minibatches: int, num_micro: int) -> jax.Array:
    """``[N, ...] -> [M, K, m, ...]``, strided (see the module docstring)."""
    steps = num_minibatches * num_micro
    m = x.shape[0] // steps
    x = x.reshape(m, steps, *x.shape[1:]).swapaxes(0, 1)
    return x.reshape(num_minibatches, num_micro, m, *x.shape[2:])


def _accumulate(trainee: _Trainee, params: Any, mb: Any, constrain: Callable) -> tuple:
    """Σ over the K micro-batches of ``mb`` of (∇ loss_sum, metric pairs)."""
    grad_fn = jax.grad(trainee.sums, has_aux=True)
    num_micro = jax.tree.leaves(mb)[0].shape[0]
    if num_micro == 1:
        return grad_fn(params, constrain(jax.tree.map(lambda x: x[0], mb)))

    def body(carry, micro):
        grads, aux = grad_fn(params, constrain(micro))
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        return _add(carry, (grads, aux)), None

    first = jax.tree.map(lambda x: x[0], mb)
    shapes = jax.eval_shape(grad_fn, params, first)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes)
    if trainee.param_sharding is not None:
        zeros = (jax.lax.with_sharding_constraint(zeros[0], trainee.param_sharding), zeros[1])
    total, _ = jax.lax.scan(body, zeros, mb)
    return total


def _apply(tx, params, opt_state, grads, denominator, loss_sum=None):
    """θ ← tx(g / max(D, 1)); a non-finite gradient (or loss) skips the update (state kept).

    The skip is a ``lax.cond`` inside the jitted step on the finiteness of the global gradient
    norm (one NaN/inf anywhere makes it non-finite) and of the loss, so a bad batch can never
    write NaN into the parameters or the optimizer moments; the loop counts or stops on it
    (``train.on_nonfinite``).
    """
    scale = 1.0 / jnp.maximum(denominator, 1.0)
    grads = jax.tree.map(lambda g, p: (g * scale).astype(p.dtype), grads, params)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(grad_norm)
    if loss_sum is not None:
        finite = finite & jnp.isfinite(loss_sum)

    def update(operands):
        params, opt_state = operands
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params, opt_state = jax.lax.cond(finite, update, lambda ops: ops, (params, opt_state))
    return params, opt_state, grad_norm, finite


def _finalize(pairs: dict[str, Pair]) -> dict[str, jax.Array]:
    return {k: agg.finalize(*v) for k, v in pairs.items()}


def _optimize(
    trainees: tuple[_Trainee, ...],
    params: tuple,
    opt_states: tuple,
    batch: Any,
    *,
    ppo_epochs: int,
    num_minibatches: int,
    micro_batch_size: int | None,
    constrain: Callable,
) -> tuple[tuple, tuple, dict[str, jax.Array]]:
    n = jax.tree.leaves(batch)[0].shape[0]
    if n % num_minibatches:
        raise ValueError(f"a batch of {n} rows does not split into {num_minibatches} minibatches")
    minibatch = n // num_minibatches
    micro = micro_batch_size or minibatch
    if minibatch % micro:
        raise ValueError(
            f"a minibatch of {minibatch} rows does not split into micro-batches of {micro}"
        )
    num_micro = minibatch // micro
    mbs = jax.tree.map(lambda x: _split(x, num_minibatches, num_micro), batch)

    def minibatch_step(carry, mb):
        params, opt_states = carry
        new_params, new_opts, metrics = [], [], {}
        for trainee, p, o in zip(trainees, params, opt_states, strict=True):
            grads, aux = _accumulate(trainee, p, mb, constrain)
            loss_sum = aux.get(f"{trainee.name}/loss", (None,))[0]
            p, o, grad_norm, finite = _apply(
                trainee.tx, p, o, grads, trainee.denominator(mb), loss_sum
            )
            metrics.update(_finalize(aux))
            metrics[f"{trainee.name}/grad_norm"] = grad_norm
            metrics[f"{trainee.name}/nonfinite"] = 1.0 - finite.astype(jnp.float32)
            new_params.append(p)
            new_opts.append(o)
        return (tuple(new_params), tuple(new_opts)), metrics

    def epoch(carry, _):
        if num_minibatches == 1:  # no loop: a smaller program to compile
            carry, metrics = minibatch_step(carry, jax.tree.map(lambda x: x[0], mbs))
            return carry, jax.tree.map(lambda m: m[None], metrics)
        return jax.lax.scan(minibatch_step, carry, mbs)

    if ppo_epochs == 1:
        (params, opt_states), metrics = epoch((params, opt_states), None)
        metrics = jax.tree.map(lambda m: m[None], metrics)
    else:
        (params, opt_states), metrics = jax.lax.scan(
            epoch, (params, opt_states), None, length=ppo_epochs
        )
    out = {k: jnp.mean(v) for k, v in metrics.items() if not k.endswith("/nonfinite")}
    out["update/nonfinite"] = sum(
        jnp.sum(v) for k, v in metrics.items() if k.endswith("/nonfinite")
    )
    return params, opt_states, out


def _constrainer(mesh, rules) -> Callable:
    if mesh is None:
        return lambda tree: tree
    axes = dict(rules).get("batch")

    def constrain(tree):
        def one(x):
            spec = PartitionSpec(axes, *([None] * (x.ndim - 1)))
            return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

        return jax.tree.map(one, tree)

    return constrain


def _jit_step(step_fn, *, mesh, state_sharding, rules) -> Callable:
    """jit with in/out shardings and the state donated (mesh given), else a plain donating jit."""
    if mesh is None:
        jitted = jax.jit(step_fn, donate_argnums=0)
        return jitted

    rep = NamedSharding(mesh, PartitionSpec())
    batch_axes = dict(rules).get("batch")
    cache: dict = {}

    def call(state, batch):
        batch_sharding = jax.tree.map(
            lambda x: NamedSharding(mesh, PartitionSpec(batch_axes, *([None] * (x.ndim - 1)))),
            batch,
        )
        treedef = jax.tree.structure(batch)
        if treedef not in cache:
            cache[treedef] = jax.jit(
                step_fn,
                in_shardings=(state_sharding, batch_sharding),
                out_shardings=(state_sharding, rep),
                donate_argnums=0,
            )
        # Committed arrays laid out otherwise (e.g. replicated log-probs) are moved first: jit
        # refuses a mismatch. Both are no-ops for arrays already in place.
        state = jax.device_put(state, state_sharding)
        batch = jax.device_put(batch, batch_sharding)
        with jax.set_mesh(mesh):
            return cache[treedef](state, batch)

    return call


# ---------------------------------------------------------------------------------------------
# On-policy recipes.


def _loss_kwargs(recipe: Recipe) -> dict[str, Any]:
    """The clip settings of the recipe's policy loss, for ``ratio_metrics``."""
    keywords = dict(getattr(recipe.policy_loss, "keywords", {}) or {})
    hp = recipe.hparams
    out = {
        "clip_low": float(keywords.get("clip_low", hp.get("clip_low", 0.2))),
        "clip_high": float(keywords.get("clip_high", hp.get("clip_high", 0.2))),
    }
    if keywords.get("dual_clip") is not None:
        out["dual_clip"] = float(keywords["dual_clip"])
    if keywords.get("log_ratio_clamp") is not None:
        out["log_ratio_clamp"] = float(keywords["log_ratio_clamp"])
    return out


def _completion_start(batch: Any, mask_nt: jax.Array) -> int:
    return batch.shape[1] - mask_nt.shape[1]


def policy_sums_fn(
    recipe: Recipe,
    graphdef: nnx.GraphDef,
    *,
    temperature: float = 1.0,
    tis_cap: float | None = None,
    entropy_metrics: bool = True,
    chunk_size: int | None = 256,
) -> Callable[[Any, UpdateBatch], tuple[jax.Array, dict[str, Pair]]]:
    """``(params, micro_batch) -> (Σ loss, metric pairs)`` of the recipe's policy objective."""
    with_entropy = entropy_metrics or recipe.entropy_coef > 0
    ratio_kwargs = _loss_kwargs(recipe)

    def sums(params, mb: UpdateBatch):
        model = nnx.merge(graphdef, params)
        mask = mb.mask_nt
        out = completion_logprobs(
            model,
            mb.tokens_nl,
            mb.input_mask_nl,
            start=_completion_start(mb.tokens_nl, mask),
            temperature=temperature,
            chunk_size=chunk_size,
            with_entropy=with_entropy,
        )
        logp, entropy = out if with_entropy else (out, None)
        adv = mb.adv_nt
        aux: dict[str, Pair] = {}
        if mb.logp_old_nt is not None:
            logp_old = mb.logp_old_nt
        else:
            logp_old = _sg(logp)
            if mb.logp_sampler_nt is not None:
                log_w = jnp.where(mask, _sg(logp) - jnp.where(mask, mb.logp_sampler_nt, 0.0), 0.0)
                w = jnp.exp(log_w)
                if tis_cap is not None:
                    aux["tis/capped_fraction"] = _pair(w > tis_cap, mask)
                    w = jnp.minimum(w, tis_cap)
                aux["tis/weight_mean"] = _pair(w, mask)
                adv = jnp.where(mask, adv * w, 0.0)
        terms = objective.policy_objective(
            recipe,
            logp,
            adv,
            mask,
            logp_old_bgt=logp_old,
            logp_ref_bgt=mb.logp_ref_nt,
            entropy_bgt=entropy if recipe.entropy_coef > 0 else None,
        )
        aux["actor/loss"] = terms.total
        aux["actor/pg_loss"] = terms.policy
        if recipe.kl_loss is not None:
            aux["actor/kl_loss"] = terms.kl
        if entropy is not None:
            aux["actor/entropy"] = _pair(_sg(entropy), mask)
        if mb.logp_ref_nt is not None:
            kl = _kl.kl_k3(_sg(logp), jnp.where(mask, mb.logp_ref_nt, 0.0))
            aux["actor/kl_ref"] = _pair(kl, mask)
        for key, value in pl.ratio_metrics(logp, logp_old, adv, mask, **ratio_kwargs).items():
            aux[f"actor/{key}"] = value
        return terms.total[0], aux

    return sums


def critic_sums_fn(
    recipe: Recipe, critic_graphdef: nnx.GraphDef
) -> Callable[[Any, UpdateBatch], tuple[jax.Array, dict[str, Pair]]]:
    """``(critic_params, micro_batch) -> (Σ value loss, metric pairs)``; token-mean loss."""

    def sums(params, mb: UpdateBatch):
        critic = nnx.merge(critic_graphdef, params)
        start = _completion_start(mb.tokens_nl, mb.mask_nt)
        value = critic(mb.tokens_nl, mb.input_mask_nl)[:, start - 1 : -1]
        mask = mb.mask_nt
        loss = pl.value_loss(value, mb.value_old_nt, mb.return_nt, mask, clip_eps=recipe.value_clip)
        total = jnp.sum(jnp.where(mask, loss, 0.0))
        aux = {
            "critic/loss": (total, _pair(loss, mask)[1]),
            "critic/value_mean": _pair(value, mask),
        }
        if recipe.value_clip is not None:
            moved = jnp.abs(value - mb.value_old_nt) > recipe.value_clip
            aux["critic/clip_fraction"] = _pair(moved, mask)
        return total, aux

    return sums


def make_update_step(
    recipe: Recipe,
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    *,
    schedule: Schedule | None = None,
    critic_graphdef: nnx.GraphDef | None = None,
    critic_tx: optax.GradientTransformation | None = None,
    critic_schedule: Schedule | None = None,
    ppo_epochs: int = 1,
    num_minibatches: int = 1,
    micro_batch_size: int | None = None,
    temperature: float = 1.0,
    tis_cap: float | None = None,
    entropy_metrics: bool = True,
    chunk_size: int | None = 256,
    mesh: jax.sharding.Mesh | None = None,
    state_sharding: TrainState | None = None,
    rules: shd.Rules = shd.DEFAULT_RULES,
) -> Callable[[TrainState, UpdateBatch], tuple[TrainState, dict[str, jax.Array]]]:
    """The jitted update ``step(state, batch) -> (state, metrics)`` of an on-policy recipe.

    See the module docstring for the loop, the exact accumulation, old log-probs and metrics.

    Args:
      recipe: the algorithm (its loss, aggregation, KL term, entropy coefficient, value clip).
      graphdef: the policy's ``nnx.split`` graph definition (params travel in the state).
      tx: the policy's optimizer (clipping included, see ``state.make_optimizer``).
      schedule: ``step -> lr`` for the ``actor/lr`` metric.
      critic_graphdef, critic_tx, critic_schedule: the critic (required when the recipe has one).
      ppo_epochs, num_minibatches, micro_batch_size: the shape of the update (``micro_batch_size``
        None: whole minibatches).
      temperature: the sampling temperature; log-probs are those of the tempered policy.
      tis_cap: the cap C of truncated importance sampling (batches with ``logp_sampler_nt``).
      entropy_metrics: compute the policy entropy for metrics even when it is not in the loss.
      chunk_size: time chunk of the log-prob computation (bounds the ``[B, chunk, V]`` logits).
      mesh, state_sharding, rules: jit with these in/out shardings (the batch split over the
        rules' batch axes) under ``jax.set_mesh(mesh)``. Without a mesh: a plain jit.
    """
    if recipe.policy_loss is None:
        raise ValueError(f"make_update_step: {recipe.name} is offline; use make_dpo_step")
    if recipe.needs_critic and (critic_graphdef is None or critic_tx is None):
        raise ValueError(
            f"make_update_step: {recipe.name} trains a critic; pass critic_graphdef and critic_tx"
        )
    if mesh is not None and state_sharding is None:
        raise ValueError("make_update_step: a mesh needs the state_sharding")
    policy = _Trainee(
        "actor",
        tx,
        policy_sums_fn(
            recipe,
            graphdef,
            temperature=temperature,
            tis_cap=tis_cap,
            entropy_metrics=entropy_metrics,
            chunk_size=chunk_size,
        ),
        lambda mb: recipe.aggregation(jnp.zeros(mb.mask_nt.shape, jnp.float32), mb.mask_nt)[1],
        schedule,
        None if state_sharding is None else state_sharding.params,
    )
    trainees = [policy]
    if recipe.needs_critic:
        trainees.append(
            _Trainee(
                "critic",
                critic_tx,
                critic_sums_fn(recipe, critic_graphdef),
                lambda mb: jnp.sum(mb.mask_nt, dtype=jnp.int32).astype(jnp.float32),
                critic_schedule,
                None if state_sharding is None else state_sharding.critic_params,
            )
        )
    constrain = _constrainer(mesh, rules)

    def step(state: TrainState, batch: UpdateBatch):
        if recipe.needs_critic and (batch.value_old_nt is None or batch.return_nt is None):
            raise ValueError(f"{recipe.name}: the batch needs value_old_nt and return_nt")
        params = (state.params, state.critic_params)[: len(trainees)]
        opts = (state.opt_state, state.critic_opt_state)[: len(trainees)]
        params, opts, metrics = _optimize(
            tuple(trainees),
            params,
            opts,
            batch,
            ppo_epochs=ppo_epochs,
            num_minibatches=num_minibatches,
            micro_batch_size=micro_batch_size,
            constrain=constrain,
        )
        for t in trainees:
            if t.schedule is not None:
                metrics[f"{t.name}/lr"] = t.schedule(state.step)
        new = state._replace(step=state.step + 1, params=params[0], opt_state=opts[0])
        if recipe.needs_critic:
            new = new._replace(critic_params=params[1], critic_opt_state=opts[1])
        return new, metrics

    return _jit_step(step, mesh=mesh, state_sharding=state_sharding, rules=rules)


# ---------------------------------------------------------------------------------------------
# DPO.


def dpo_sums_fn(
    recipe: Recipe, graphdef: nnx.GraphDef, *, chunk_size: int | None = 256
) -> Callable[[Any, DPOBatch], tuple[jax.Array, dict[str, Pair]]]:
    """``(params, micro_batch) -> (Σ pair losses, metric pairs)``; one forward on chosen and
    rejected stacked."""
    beta = float(recipe.hparams["beta"])

    def sums(params, mb: DPOBatch):
        model = nnx.merge(graphdef, params)
        n = mb.chosen_tokens_nl.shape[0]
        tokens = jnp.concatenate([mb.chosen_tokens_nl, mb.rejected_tokens_nl])
        input_mask = jnp.concatenate([mb.chosen_input_mask_nl, mb.rejected_input_mask_nl])
        mask = jnp.concatenate([mb.chosen_mask_nt, mb.rejected_mask_nt])
        logp = completion_logprobs(
            model,
            tokens,
            input_mask,
            start=_completion_start(tokens, mask),
            chunk_size=chunk_size,
        )
        seq = pref.sequence_logprob(logp, mask)
        length = pref.sequence_length(mask)
        batch = objective.PreferenceBatch(
            logp_chosen_p=seq[:n],
            logp_rejected_p=seq[n:],
            len_chosen_p=length[:n],
            len_rejected_p=length[n:],
            ref_chosen_p=mb.ref_chosen_n,
            ref_rejected_p=mb.ref_rejected_n,
        )
        loss = recipe.preference_loss(batch)
        count = jnp.asarray(n, jnp.float32)
        total = jnp.sum(loss)
        aux = {
            "actor/loss": (total, count),
            "dpo/logp_chosen": (jnp.sum(_sg(seq[:n])), count),
            "dpo/logp_rejected": (jnp.sum(_sg(seq[n:])), count),
        }
        if mb.ref_chosen_n is not None:
            r_w, r_l = pref.preference_rewards(
                seq[:n], seq[n:], mb.ref_chosen_n, mb.ref_rejected_n, beta=beta
            )
            aux["dpo/reward_accuracy"] = (jnp.sum((r_w > r_l).astype(jnp.float32)), count)
            aux["dpo/reward_margin"] = (jnp.sum(r_w - r_l), count)
            aux["dpo/reward_chosen"] = (jnp.sum(r_w), count)
            aux["dpo/reward_rejected"] = (jnp.sum(r_l), count)
        return total, aux

    return sums


def make_dpo_step(
    recipe: Recipe,
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    *,
    schedule: Schedule | None = None,
    ppo_epochs: int = 1,
    num_minibatches: int = 1,
    micro_batch_size: int | None = None,
    chunk_size: int | None = 256,
    mesh: jax.sharding.Mesh | None = None,
    state_sharding: TrainState | None = None,
    rules: shd.Rules = shd.DEFAULT_RULES,
) -> Callable[[TrainState, DPOBatch], tuple[TrainState, dict[str, jax.Array]]]:
    """The jitted DPO-family update ``step(state, batch) -> (state, metrics)``.

    The loss of a minibatch is the mean over its pairs of ``recipe.preference_loss`` on the
    sequence log-probs Σ_t log π(y_t | x, y_<t) of the answers; gradients are accumulated over
    micro-batches of pairs exactly as in :func:`make_update_step` (denominator: the number of
    pairs). Metrics: ``actor/loss``, ``dpo/logp_chosen``, ``dpo/logp_rejected`` and, with a
    reference, ``dpo/reward_accuracy``, ``dpo/reward_margin``, ``dpo/reward_chosen``,
    ``dpo/reward_rejected`` (the implicit rewards β·log π/π_ref), ``actor/grad_norm``,
    ``actor/lr``, ``update/nonfinite``.
    """
    if recipe.preference_loss is None:
        raise ValueError(f"make_dpo_step: {recipe.name} is not a preference recipe")
    trainee = _Trainee(
        "actor",
        tx,
        dpo_sums_fn(recipe, graphdef, chunk_size=chunk_size),
        lambda mb: jnp.asarray(
            mb.chosen_mask_nt.shape[0] * mb.chosen_mask_nt.shape[1], jnp.float32
        ),
        schedule,
        None if state_sharding is None else state_sharding.params,
    )
    constrain = _constrainer(mesh, rules)

    def step(state: TrainState, batch: DPOBatch):
        (params,), (opt,), metrics = _optimize(
            (trainee,),
            (state.params,),
            (state.opt_state,),
            batch,
            ppo_epochs=ppo_epochs,
            num_minibatches=num_minibatches,
            micro_batch_size=micro_batch_size,
            constrain=constrain,
        )
        if schedule is not None:
            metrics["actor/lr"] = schedule(state.step)
        return state._replace(step=state.step + 1, params=params, opt_state=opt), metrics

    return _jit_step(step, mesh=mesh, state_sharding=state_sharding, rules=rules)


__all__ = [
    "DPOBatch",
    "UpdateBatch",
    "critic_sums_fn",
    "dpo_sums_fn",
    "make_dpo_step",
    "make_update_step",
    "policy_sums_fn",
]
