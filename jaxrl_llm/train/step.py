"""One RL step on device: ``make_rl_step(...) -> step(state, groups) -> (state, metrics)``.

The host generates, scores and selects (:mod:`jaxrl_llm.train.collect`); everything after that
is one jitted program on the run's mesh, with the groups kept as ``[B, G, T]``::

    tokens_nl = [prompt_b ⧺ completion_bg]                       (a reshape, inside the jit)
    π_old     = forward(params)        when a recompute is needed (several updates per batch, or a
                                       chain that reads the rollout policy's log-probs)
    π_ref     = forward(ref_params)    when the recipe requires reference log-probs
    V         = critic(critic_params)  when the recipe has a critic
    A, s'     = recipe.advantage on the Rollout (its state s carried in TrainState.kl_state)
    R         = recipe's value targets (same chain state)
    θ, opt    = epochs × minibatches × micro-batches of exact (sum, denominator) accumulation

so one step costs one host → device transfer (the groups) and one device → host transfer (the
metrics). The only inputs besides the state and the groups are the frozen reference
parameters, passed as an argument (never baked into the program as constants).

Old log-probs (π_old of the importance ratio), by :class:`~jaxrl_llm.train.setup.OldLogprobs`:
``recompute`` runs the forward pass only when it changes the numbers (with one update per batch
on-policy π_old = sg(π_θ) is exact and saves the pass); ``sampler`` takes the rollout engine's
log-probs and corrects the mismatch with truncated importance sampling
(:func:`~jaxrl_llm.core.policy_losses.truncated_importance_weight`, see
:mod:`jaxrl_llm.train.update`).

Packing (``update.packing``, :mod:`jaxrl_llm.train.packing`). The host computes a packing plan
from the sequence lengths (first-fit decreasing per minibatch into rows of a bucketed width;
token-budget micro-batches of ``update.micro_batch_tokens``) and sends three ``int32[N]``
placements and an ``int32[M]`` micro-batch count with the groups; inside the jit the ``[N, P + T]``
rows are scattered into the packed ``[M·K, rows, W]`` layout, π_old, π_ref and V run on the
used micro-batches only (:func:`~jaxrl_llm.train.forward.packed_logprobs_nt`), their outputs are
gathered back to ``[B, G, T]`` for the chain, and the update runs on the packed micro-batches
(:func:`~jaxrl_llm.train.update.packed_batch`). One program per plan shape (the buckets keep
those few); the number of micro-batches per minibatch is traced. ``perf/pack_rows_tokens`` is
the token slots of the used packed micro-batches (rows·W each), ``perf/packed_tokens`` the
tokens they hold (a shared prompt once per unit), ``perf/padded_tokens`` the slots of the
unpacked rows (N·(P + T)), next to ``perf/tokens`` (the real ones, each prompt G times).

Metrics of the step, besides the update's (``actor/*``, ``critic/*``, ``update/nonfinite``):
``advantages/{mean,std,min,max}`` over valid tokens (0 when none), ``kl/rollout`` (the mean
sequence k1 KL of the rollout policy to the reference, when the chain reads it), ``kl/beta``
(the chain's KL coefficient after this step's controller update, as before the redesign; verl
logs the β the step used) and ``perf/tokens`` (real prompt + completion tokens).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import chain as ch
from jaxrl_llm import distributed as dist
from jaxrl_llm import recipe as rc
from jaxrl_llm.core import kl as _kl
from jaxrl_llm.models import sharding as shd
from jaxrl_llm.recipe import Recipe
from jaxrl_llm.train import forward, hostmem
from jaxrl_llm.train import models as tm
from jaxrl_llm.train import packing as pk
from jaxrl_llm.train import state as st
from jaxrl_llm.train import update as up
from jaxrl_llm.train.setup import Models, OldLogprobs, UpdateShape

Metrics = dict[str, jax.Array]


_DROPOUT_SALT = 0x4C6F5241  # folds the step key into the LoRA dropout's own stream


class Frozen(NamedTuple):
    """The frozen bases of LoRA models (None without LoRA): arguments of the jitted step, not
    part of the (donated) state; the policy is ``combine(policy, state.params)``."""

    policy: dict | None = None
    critic: dict | None = None


class Groups(NamedTuple):
    """B prompts × G completions, as the step takes them.

    Attributes:
      prompt_ids_bp: ``int32[B, P]`` left-padded prompts.
      prompt_mask_bp: ``bool[B, P]`` real prompt tokens.
      tokens_bgt: ``int32[B, G, T]`` completions.
      mask_bgt: ``bool[B, G, T]`` real completion tokens.
      logp_sampler_bgt: ``f32[B, G, T]`` the sampler's log-probs of the completion tokens.
      reward_bg: ``f32[B, G]`` sequence rewards.
      member_bg: ``bool[B, G]`` completions that reach the update (selection).
      baseline_b: ``f32[B]`` a given per-prompt baseline (ReMax: the reward of one greedy
        completion of the prompt), or None.
      reward_bgk: ``f32[B, G, K]`` the K reward terms apart, unweighted (GDPO), or None.
      logp_full_bgt: ``f32[B, G, T]`` the sampler's full-vocabulary log-probs at temperature 1
        (``rollout.full_logprobs``; ``Generation.full_logprobs``), or None. Carried, not yet
        read by the step.
      details_bg: ``str[B, G]`` host only: each completion's reward terms and the columns the
        rewards reported, as JSON (:func:`~jaxrl_llm.train.collect.details_json`), for the
        completions log; None when the run logs no completions. The step drops it
        (:meth:`for_update`).
    """

    prompt_ids_bp: jax.Array
    prompt_mask_bp: jax.Array
    tokens_bgt: jax.Array
    mask_bgt: jax.Array
    logp_sampler_bgt: jax.Array
    reward_bg: jax.Array
    member_bg: jax.Array
    baseline_b: jax.Array | None = None
    reward_bgk: jax.Array | None = None
    logp_full_bgt: jax.Array | None = None
    details_bg: np.ndarray | None = None

    def for_update(self) -> Groups:
        """The groups as the device step takes them: without the host-only ``details_bg``."""
        return self if self.details_bg is None else self._replace(details_bg=None)


def _spans_processes(x: Any) -> bool:
    return isinstance(x, jax.Array) and not x.is_fully_addressable


def _row_sums(x: Any, what: str) -> np.ndarray:
    """``x.sum(-1)`` on the host, for the packing plan's lengths. A (possibly multi-process)
    global array split along axis 0 only: each process sums the rows its own devices hold, and
    only those sums go to every process, over the coordination service
    (:func:`~jaxrl_llm.distributed.host_allgather`): no device program, so nothing waits for
    the previous step still running on the same devices (the async loop)."""
    if not _spans_processes(x):
        return np.asarray(x).sum(-1)
    starts, sums = [], []
    for shard in x.addressable_shards:
        rows, *rest = shard.index
        if any(s.indices(n) != (0, n, 1) for s, n in zip(rest, x.shape[1:], strict=True)):
            raise ValueError(
                f"packing plan: {what} {x.shape} is split along an axis other than the batch "
                f"({x.sharding}); expected whole rows on each device"
            )
        start = rows.start or 0
        if start not in starts:  # a replica of rows already counted
            starts.append(start)
            sums.append(np.asarray(shard.data).sum(-1))
    n = sums[0].shape[0]
    starts_p, sums_p = dist.host_allgather(
        (np.asarray(starts, np.int64), np.stack(sums)), what=f"packing plan: {what}", tiled=True
    )
    out = np.zeros((x.shape[:-1]), sums_p.dtype)
    for start, block in zip(starts_p.tolist(), sums_p, strict=True):
        out[start : start + n] = block
    return out


def needs_old_logprob_pass(recipe: Recipe, update: UpdateShape, old: OldLogprobs) -> bool:
    """Whether π_old is recomputed by a forward pass before the update."""
    if old.source != "recompute":
        return False
    return update.updates_per_step > 1 or rc.BEHAVIOUR_LOGPROBS in recipe.requires


def _sequences(groups: Groups) -> tuple[jax.Array, jax.Array]:
    """``[B, P] ⧺ [B, G, T] -> [N, P + T]`` token ids and attention mask, N = B·G."""
    b, g, t = groups.tokens_bgt.shape
    p = groups.prompt_ids_bp.shape[1]

    def rows(prompt_bp: jax.Array, completion_bgt: jax.Array) -> jax.Array:
        prompt_bgp = jnp.broadcast_to(prompt_bp[:, None, :], (b, g, p))
        return jnp.concatenate([prompt_bgp, completion_bgt], axis=-1).reshape(b * g, p + t)

    return rows(groups.prompt_ids_bp, groups.tokens_bgt), rows(
        groups.prompt_mask_bp, groups.mask_bgt
    )


def _masked_stats(x_bgt: jax.Array, mask_bgt: jax.Array, prefix: str) -> Metrics:
    """Mean, std (ddof 0), min and max of ``x`` over ``mask`` (all 0 when the mask is empty)."""
    count = jnp.sum(mask_bgt, dtype=jnp.int32).astype(jnp.float32)
    some = count > 0
    mean = jnp.sum(jnp.where(mask_bgt, x_bgt, 0.0)) / jnp.maximum(count, 1.0)
    var = jnp.sum(jnp.where(mask_bgt, jnp.square(x_bgt - mean), 0.0)) / jnp.maximum(count, 1.0)
    low = jnp.min(jnp.where(mask_bgt, x_bgt, jnp.inf))
    high = jnp.max(jnp.where(mask_bgt, x_bgt, -jnp.inf))
    zero = jnp.zeros((), jnp.float32)
    return {
        f"{prefix}/mean": mean,
        f"{prefix}/std": jnp.sqrt(var),
        f"{prefix}/min": jnp.where(some, low, zero),
        f"{prefix}/max": jnp.where(some, high, zero),
    }


def make_rl_step(
    recipe: Recipe,
    models: Models,
    update: UpdateShape,
    *,
    temperature: float = 1.0,
    old_logprobs: OldLogprobs | None = None,
    chunk_size: int | None = 256,
) -> Callable[[st.TrainState, Groups], tuple[st.TrainState, dict[str, float]]]:
    """The run's RL step ``step(state, groups) -> (state, metrics)`` as one jit on its mesh.

    See the module docstring for what runs inside. The state is donated; the metrics come back
    as Python floats in one transfer (the step's only device → host copy); ``groups`` may be host
    arrays (put on the mesh with their leading axis B over the batch axes when it divides) or
    global arrays of a multi-process run.

    Args:
      recipe: the online recipe.
      models: the run's models (graph definitions, optimizers, mesh, reference parameters).
      update: epochs × minibatches × micro-batches of the update (micro-batches also bound the
        forward passes' memory).
      temperature: the sampling temperature (log-probs are of the tempered policy).
      old_logprobs: where π_old comes from (see the module docstring; default: recompute).
      chunk_size: time chunk of the log-prob computations (bounds ``[rows, chunk, V]``).
    """
    old_logprobs = old_logprobs or OldLogprobs()
    recompute = needs_old_logprob_pass(recipe, update, old_logprobs)
    use_sampler = old_logprobs.source == "sampler"
    reads_old = rc.BEHAVIOUR_LOGPROBS in recipe.requires
    # A rollout correction weighs μ (the sampler) against π_old: bypass when π_old is not
    # recomputed, decoupled (π_prox = the recomputed π_old) when it is.
    reads_sampler = rc.SAMPLER_LOGPROBS in recipe.requires
    with_critic = recipe.critic is not None
    packing = update.packing
    micro = None if packing else update.micro_batch_size
    mesh, sharding = models.mesh, models.state_sharding
    dp = shd.data_parallel_size(mesh)
    make_update = functools.partial(
        up.make_update_step,
        recipe,
        models.graphdef,
        models.tx,
        schedule=models.schedule,
        critic_graphdef=models.critic_graphdef,
        critic_tx=models.critic_tx,
        critic_schedule=models.critic_schedule,
        ppo_epochs=update.epochs,
        num_minibatches=update.num_minibatches,
        micro_batch_size=micro,
        temperature=temperature,
        tis_cap=old_logprobs.tis_cap,
        chunk_size=chunk_size,
        mesh=mesh,
        state_sharding=sharding,
        rules=models.rules,
        jit=False,
        packed=packing,
    )
    lora = models.frozen is not None or models.critic_frozen is not None
    lora_dropout = models.lora is not None and models.lora.dropout > 0
    update_fn = None if lora else make_update()

    def constrain(x: jax.Array) -> jax.Array:
        return jax.lax.with_sharding_constraint(x, models.batch_sharding(x.ndim))

    def logprobs(
        graphdef: Any, params: Any, tokens_nl: jax.Array, mask_nl: jax.Array, t: int
    ) -> jax.Array:
        return forward.completion_logprobs_nt(
            graphdef,
            params,
            tokens_nl,
            mask_nl,
            completion_len=t,
            temperature=temperature,
            chunk_size=chunk_size,
            micro_batch_size=micro,
        )

    def rows_constraint(x: jax.Array) -> jax.Array:  # a packed micro-batch's rows over dp
        return constrain(x) if x.shape[0] % dp == 0 else x

    def step(
        state: st.TrainState,
        groups: Groups,
        ref_params: Any,
        frozen: Frozen,
        plan: pk.PlanArrays | None,
        shape: pk.PackShape | None,
    ):
        full = lambda p: p if frozen.policy is None else tm.combine(frozen.policy, p)
        full_critic = lambda p: p if frozen.critic is None else tm.combine(frozen.critic, p)
        b, g, t = groups.tokens_bgt.shape
        n = b * g
        tokens_nl, input_mask_nl = _sequences(groups)
        if n % dp == 0:
            tokens_nl, input_mask_nl = constrain(tokens_nl), constrain(input_mask_nl)
        bgt = lambda x_nt: None if x_nt is None else x_nt.reshape(b, g, t)
        logp_old = logp_ref = values = None
        if packing:
            packed = pk.pack_rows(tokens_nl, input_mask_nl, plan, shape, t)
            index = pk.unpack_index(input_mask_nl, plan, t)
            kw = dict(temperature=temperature, chunk_size=chunk_size, constrain=rows_constraint)
            logprobs_of = lambda params, graphdef=models.graphdef: forward.packed_logprobs_nt(
                graphdef, params, packed, plan, shape, index, **kw
            )
            values_of = lambda params: forward.packed_values_nt(
                models.critic_graphdef,
                params,
                packed,
                plan,
                shape,
                index,
                constrain=rows_constraint,
            )
        else:
            logprobs_of = lambda params, graphdef=models.graphdef: logprobs(
                graphdef, params, tokens_nl, input_mask_nl, t
            )
            values_of = lambda params: forward.completion_values_nt(
                models.critic_graphdef,
                params,
                tokens_nl,
                input_mask_nl,
                completion_len=t,
                micro_batch_size=micro,
            )
        if recompute:
            logp_old = bgt(logprobs_of(full(state.params)))
        if ref_params is not None:  # under LoRA: the frozen base, without the adapters
            logp_ref = bgt(logprobs_of(ref_params, models.ref_graphdef))
        if with_critic:
            values = bgt(values_of(full_critic(state.critic_params)))
        sampler_bgt = groups.logp_sampler_bgt.astype(jnp.float32)
        chain_old = (
            logp_old
            if logp_old is not None
            else (sampler_bgt if use_sampler or reads_old else None)
        )
        rollout = ch.Rollout(
            reward_bg=groups.reward_bg.astype(jnp.float32),
            mask_bgt=groups.mask_bgt,
            mask_bg=groups.member_bg,
            logp_old_bgt=chain_old,
            logp_ref_bgt=logp_ref,
            value_bgt=values,
            baseline_b=None if groups.baseline_b is None else groups.baseline_b.astype(jnp.float32),
            reward_bgk=None if groups.reward_bgk is None else groups.reward_bgk.astype(jnp.float32),
        )
        adv_bgt, kl_state = ch.apply(recipe.advantage, rollout, state.kl_state)
        returns = rc.value_targets(recipe, rollout, state.kl_state) if with_critic else None
        mask_bgt = ch.token_mask(rollout)
        metrics = _masked_stats(adv_bgt, mask_bgt, "advantages")
        if reads_old and logp_ref is not None and chain_old is not None:
            kl_bgt = _kl.kl_k1(chain_old, logp_ref)
            metrics["kl/rollout"] = _kl.mean_sequence_kl(kl_bgt, mask_bgt)
        beta = st.kl_beta(kl_state)
        if beta is not None:
            metrics["kl/beta"] = beta
        nt = lambda x_bgt: None if x_bgt is None else x_bgt.reshape(n, t)
        dropout_key_n = row_n = None
        if lora_dropout:  # one key per step for the adapters' dropout (update/UpdateBatch)
            step_key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
            key_data = jax.random.key_data(jax.random.fold_in(step_key, _DROPOUT_SALT))
            dropout_key_n = jnp.broadcast_to(key_data, (n, *key_data.shape))
            row_n = jnp.arange(n, dtype=jnp.int32)
        batch = up.UpdateBatch(
            tokens_nl=tokens_nl,
            input_mask_nl=input_mask_nl,
            mask_nt=nt(mask_bgt),
            adv_nt=nt(adv_bgt),
            logp_old_nt=nt(logp_old),
            logp_sampler_nt=nt(sampler_bgt) if use_sampler or reads_sampler else None,
            logp_ref_nt=nt(logp_ref),
            value_old_nt=nt(values),
            return_nt=nt(returns),
            dropout_key_n=dropout_key_n,
            row_n=row_n,
        )
        if packing:
            batch = up.packed_batch(batch, plan, shape)
            used = jnp.sum(jnp.asarray(plan.count_m, jnp.int32)) * shape.rows * shape.width
            metrics["perf/pack_rows_tokens"] = used.astype(jnp.float32)
            placed = jnp.sum(packed.segment_ids != 0, dtype=jnp.int32)  # shared prompts once
            metrics["perf/packed_tokens"] = placed.astype(jnp.float32)
            metrics["perf/padded_tokens"] = jnp.asarray(tokens_nl.size, jnp.float32)
        run_update = update_fn
        if run_update is None:  # the frozen bases are this trace's arguments
            run_update = make_update(frozen=frozen.policy, critic_frozen=frozen.critic)
        state, update_metrics = run_update(state._replace(kl_state=kl_state), batch)
        metrics.update(update_metrics)
        metrics["perf/tokens"] = jnp.sum(input_mask_nl, dtype=jnp.int32).astype(jnp.float32)
        # One vector, so the metrics come back in one transfer; the names are fixed at trace.
        names = sorted(metrics)
        traced_names.append(names)
        return state, jnp.stack([jnp.asarray(metrics[k], jnp.float32) for k in names])

    rep = st.replicated(mesh)
    compiler_options = hostmem.update_compiler_options(mesh)  # XLA:CPU: the smaller peak
    ref_params = models.ref_params
    ref_sharding = None
    if ref_params is not None:
        ref_sharding = models.frozen_sharding if models.frozen is not None else sharding.params
    frozen = Frozen(models.frozen, models.critic_frozen)
    frozen_sharding = Frozen(models.frozen_sharding, models.critic_frozen_sharding)
    cache: dict[Any, tuple[Callable, list[str]]] = {}
    traced_names: list[list[str]] = []
    widest_targets: dict[pk.PackShape, int] = {}

    def groups_sharding(groups: Groups) -> Groups:
        b = groups.tokens_bgt.shape[0]
        if b % shd.data_parallel_size(mesh):
            return jax.tree.map(lambda _: rep, groups)
        return jax.tree.map(lambda x: models.batch_sharding(x.ndim), groups)

    def plan_of(groups: Groups) -> tuple[pk.PlanArrays | None, pk.PackShape | None]:
        if not packing:
            return None, None
        b, g, t = groups.mask_bgt.shape
        prompt_len = _row_sums(groups.prompt_mask_bp, "prompt mask")
        completion_n = _row_sums(groups.mask_bgt, "completion mask").reshape(b * g)
        lengths = np.repeat(prompt_len, g) + completion_n
        shared = {}
        if update.shared_prompts:  # a sample's branch keeps the prompt's last token
            shared = dict(
                group_n=np.repeat(np.arange(b), g),
                shared_n=np.repeat(np.maximum(prompt_len - 1, 0), g),
                attn_per_width=update.attn_per_width,
            )
        plan = pk.make_plan(
            lengths,
            target_n=completion_n,
            max_len=groups.prompt_mask_bp.shape[1] + t,
            num_minibatches=update.num_minibatches,
            micro_batch_tokens=update.micro_batch_tokens,
            row_multiple=dp,
            width_multiple=update.width_multiple,
            **shared,
        )
        # C (the LM head's columns per row) never shrinks for a shape: a wider C is always
        # valid, so a later batch with fewer completion tokens per row reuses the program.
        shape = plan.shape
        rest = dataclasses.replace(shape, targets=None)
        targets = max(shape.targets, widest_targets.get(rest, 0))
        widest_targets[rest] = targets
        return plan.device_arrays(), dataclasses.replace(shape, targets=targets)

    def jit_for(shape: pk.PackShape | None, g_sharding: Groups) -> Callable:
        """The donating jit of the step for one packed shape (None: unpacked) and batch
        layout; on CPU with the memory-optimised schedule (:mod:`~jaxrl_llm.train.hostmem`)."""
        return jax.jit(
            functools.partial(step, shape=shape),
            in_shardings=(sharding, g_sharding, ref_sharding, frozen_sharding, rep),
            out_shardings=(sharding, rep),
            donate_argnums=0,
            compiler_options=compiler_options,
        )

    def dispatch(
        state: st.TrainState, groups: Groups
    ) -> tuple[st.TrainState, Callable[[], dict[str, float]]]:
        """The step without waiting for it: the new state (its arrays still being computed,
        JAX's asynchronous dispatch) and a function that waits for the metrics. The async
        loop samples the next batch in between (:mod:`jaxrl_llm.train.asynchronous`)."""
        groups = groups.for_update()
        g_sharding = groups_sharding(groups)
        plan, shape = plan_of(groups)
        key = jax.tree.structure(groups), tuple(g_sharding), shape
        if key not in cache:
            cache[key] = (jit_for(shape, g_sharding), [])
        jitted, names = cache[key]
        state = dist.put(state, sharding)
        groups = dist.put(groups, g_sharding)
        with jax.set_mesh(mesh):
            state, packed = jitted(state, groups, ref_params, frozen, plan)
        if not names:  # traced by the call above
            names.extend(traced_names.pop())

        def metrics() -> dict[str, float]:
            values = np.asarray(jax.device_get(dist.wait(packed))).tolist()
            return dict(zip(names, values, strict=True))

        return state, metrics

    def call(state: st.TrainState, groups: Groups) -> tuple[st.TrainState, dict[str, float]]:
        state, metrics = dispatch(state, groups)
        return state, metrics()

    def lower(
        state: st.TrainState, groups: Groups, *, platforms: tuple[str, ...] | None = None
    ) -> jax.stages.Lowered:
        """The step's program lowered for ``state``/``groups`` without running it (leaves may
        be sharded ``jax.ShapeDtypeStruct``s; with packing the masks must be host arrays, the
        plan reads them): :mod:`jaxrl_llm.train.plan` compiles it for a target's devices.
        ``platforms``: lower for these instead of the devices' own (``("cuda",)`` on a machine
        without a GPU: the GPU program's StableHLO, which this machine cannot compile)."""
        groups = groups.for_update()
        plan, shape = plan_of(groups)
        jitted = jit_for(shape, groups_sharding(groups))
        with jax.set_mesh(mesh):
            traced = jitted.trace(state, groups, ref_params, frozen, plan)
            lowered = traced.lower(lowering_platforms=platforms)
        traced_names.pop()  # the metric names of this trace; call() pops only its own
        return lowered

    call.lower = lower
    call.dispatch = dispatch
    return call


__all__ = ["Groups", "make_rl_step", "needs_old_logprob_pass"]
