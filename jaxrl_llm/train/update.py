"""Update steps: one factory for the on-policy recipes, one for DPO.

:func:`make_update_step` returns ``step(state, batch) -> (state, metrics)``, one jit (with in/out
shardings and the state donated when a mesh is given) that runs PPO-style epochs over
minibatches of a rollout batch, with exact micro-batch gradient accumulation: the engine of
:mod:`jaxrl_llm.train.accumulate` (its docstring has the loop, why accumulating the gradients of
``(sum, denominator)`` losses is exact, the strided split and the non-finite skip). Here the
policy is one :class:`~jaxrl_llm.train.accumulate.Trainee` ("actor": the recipe's objective,
denominator ``recipe.objective.aggregate(0, mask)[1]`` of the minibatch), the PPO critic another
("critic": the token-mean value loss), DPO's policy a third (the mean over pairs).

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
* The objective's ``rollout_correction`` (:class:`~jaxrl_llm.recipe.RolloutCorrection`,
  :mod:`jaxrl_llm.core.rollout_correction`) replaces that TIS: with ``logp_sampler_nt`` alone
  (verl's *bypass* mode) the weights are those of sg(π_θ)/μ — TIS, MIS / icepop, rejection,
  token or sequence level — and A ← w·A (``bypass: ppo_clip``: π_old := μ in the recipe's own
  ratio, the keep-mask only); with ``logp_old_nt`` too (the *decoupled* three-policy objective,
  Hilton et al. 2021, AReaL) the recipe's clip is relative to π_old = π_prox and the weights
  are those of π_prox/μ. Metrics ``rollout_corr/{is_weight_mean, is_weight_max,
  masked_fraction, ratio_mean}`` (the max is the mean of the micro-batch maxima).

Packed updates (``packed=True``; see :mod:`jaxrl_llm.train.packing`). The batch is an
:class:`~jaxrl_llm.train.accumulate.Ragged` built by :func:`packed_batch`: per minibatch the
``[n, T]`` fields of :class:`UpdateBatch` (masks, advantages, old/reference log-probs, values)
plus where each sequence's tokens sit in the packed rows (:class:`PackedShared`), and per
micro-batch slot its ``[rows, W]`` packed tokens, segment ids and positions
(:class:`PackedMicro`). A micro-batch runs the model on its packed rows only, reads the per-token
log-probs (values) back to the minibatch's ``[n, T]`` layout (sequences of other micro-batches
are masked out), and hands them to the *same* loss code as the unpacked path. Because every
loss is a ``(sum, denominator)`` pair with a mask-only denominator, summing the micro-batches'
sums over any partition of the minibatch's sequences gives exactly its loss, for every
aggregation mode: packed equals unpacked up to float summation order. The elementwise loss on
``[n, T]`` per micro-batch costs ``O(K·n·T)``, negligible next to the model.

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

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxrl_llm import recipe as rc
from jaxrl_llm.core import kl as _kl
from jaxrl_llm.core import policy_losses as pl
from jaxrl_llm.core import preference as pref
from jaxrl_llm.core import rollout_correction as rcorr
from jaxrl_llm.models import lora
from jaxrl_llm.models import sharding as shd
from jaxrl_llm.models.logprobs import completion_logprobs, hidden_logprobs
from jaxrl_llm.recipe import PreferenceRecipe, Recipe
from jaxrl_llm.train import accumulate as acc
from jaxrl_llm.train import packing as pk
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
      dropout_key_n: ``uint32[N, 2]`` key data of LoRA adapter dropout (the same step key in
        every row), or None: no dropout. Token j of sequence ``row_n`` draws its masks from
        ``fold_in(fold_in(key, row_n), j)`` (j = its real-token position), so micro-batching
        and packing do not change them.
      row_n: ``int32[N]`` each sequence's index in the step's batch (with ``dropout_key_n``).
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
    dropout_key_n: jax.Array | None = None
    row_n: jax.Array | None = None


def token_keys(key_data: jax.Array, ids_bt: jax.Array, positions_bt: jax.Array) -> jax.Array:
    """Typed PRNG keys ``[B, T]``: ``fold_in(fold_in(key, ids_bt), positions_bt)`` per token
    (the LoRA dropout keys of :class:`UpdateBatch`)."""
    base = jax.random.wrap_key_data(key_data)
    fold = lambda i, p: jax.random.fold_in(jax.random.fold_in(base, i), p)
    return jax.vmap(jax.vmap(fold))(ids_bt, positions_bt)


def _unpacked_keys(mb: UpdateBatch) -> jax.Array | None:
    if mb.dropout_key_n is None:
        return None
    counts = jnp.cumsum(mb.input_mask_nl.astype(jnp.int32), axis=1)
    positions = jnp.maximum(counts - 1, 0)  # the model's own position ids
    ids = jnp.broadcast_to(mb.row_n[:, None], positions.shape)
    return token_keys(mb.dropout_key_n[0], ids, positions)


def _packed_keys(fields: UpdateBatch, micro: PackedMicro) -> jax.Array | None:
    if fields.dropout_key_n is None:
        return None  # segment id = row_n + 1 (train.packing.pack_rows), 0 on padding
    if micro.prefix_ids_rw is not None:  # a shared prefix token belongs to several sequences
        raise ValueError("LoRA dropout cannot run on shared prompts (train.shared_prompts)")
    return token_keys(fields.dropout_key_n[0], micro.segment_ids_rw - 1, micro.positions_rw)


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


class PackedShared(NamedTuple):
    """One minibatch of a packed update, as every micro-batch sees it (``n`` sequences).

    Attributes:
      fields: the minibatch's :class:`UpdateBatch` with ``tokens_nl`` / ``input_mask_nl`` None.
      slot_n: ``int32[n]`` the micro-batch slot (within the minibatch) of each sequence.
      row_n: ``int32[n]`` its row in that micro-batch.
      col_nt: ``int32[n, T]`` the packed column of each completion token.
      valid_nt: ``bool[n, T]`` real completion tokens.
    """

    fields: UpdateBatch
    slot_n: jax.Array
    row_n: jax.Array
    col_nt: jax.Array
    valid_nt: jax.Array


class PackedMicro(NamedTuple):
    """One micro-batch slot of a packed update: ``int32[rows, W]`` packed rows and its index
    (``prefix_ids_rw``: shared prompts only; ``targets_rc``: each row's completion columns,
    ``int32[rows, C]``, −1 padded, when the plan set ``PackShape.targets``;
    :class:`~jaxrl_llm.train.packing.Packed`)."""

    tokens_rw: jax.Array
    segment_ids_rw: jax.Array
    positions_rw: jax.Array
    slot: jax.Array
    prefix_ids_rw: jax.Array | None = None
    targets_rc: jax.Array | None = None

    @classmethod
    def of(cls, packed: pk.Packed, slot: jax.Array, take: Callable) -> PackedMicro:
        """Slot ``slot`` of ``packed``, each array through ``take`` (e.g. a dynamic index)."""
        tokens, segments, positions, prefix, targets = (
            None if x is None else take(x) for x in packed
        )
        return cls(tokens, segments, positions, slot, prefix, targets)


def packed_batch(batch: UpdateBatch, plan: pk.PlanArrays, shape: pk.PackShape) -> acc.Ragged:
    """The :class:`~jaxrl_llm.train.accumulate.Ragged` packed update batch of ``batch``
    (traceable): minibatch j holds sequences ``{i·M + j}``, as the unpacked split."""
    m, k = shape.num_minibatches, shape.slots
    t = batch.mask_nt.shape[1]
    packed = pk.pack_rows(batch.tokens_nl, batch.input_mask_nl, plan, shape, t)
    micro, row, col, valid = pk.unpack_index(batch.input_mask_nl, plan, t)
    by_mb = lambda x: None if x is None else acc.strided_split(x, m, 1)[:, 0]
    fields = batch._replace(tokens_nl=None, input_mask_nl=None)
    shared = PackedShared(
        fields=jax.tree.map(by_mb, fields),
        slot_n=by_mb(jnp.asarray(plan.micro_n) % k),
        row_n=by_mb(jnp.asarray(plan.row_n)),
        col_nt=by_mb(col),
        valid_nt=by_mb(valid),
    )
    del micro, row
    rw = lambda x: x.reshape(m, k, *x.shape[1:])
    slots = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32)[None], (m, k))
    micro_batches = PackedMicro.of(packed, slots, rw)
    return acc.Ragged(shared, micro_batches, jnp.asarray(plan.count_m, jnp.int32))


def packed_hidden(
    decoder: nnx.Module, micro: PackedMicro, lora_keys_bt: jax.Array | None = None
) -> jax.Array:
    """``[rows, W, D]`` hidden states of packed rows (segments attend only within themselves,
    positions restart in each); ``lora_keys_bt``: LoRA dropout keys of the packed tokens."""
    h, _ = decoder(
        micro.tokens_rw,
        micro.segment_ids_rw != 0,
        positions_bt=micro.positions_rw,
        segment_ids_bt=micro.segment_ids_rw,
        lora_keys_bt=lora_keys_bt,
        prefix_ids_bt=micro.prefix_ids_rw,
    )
    return h


def packed_target_logprobs(
    lm: nnx.Module, h_rwd: jax.Array, micro: PackedMicro, **kwargs: Any
) -> tuple[jax.Array, ...]:
    """:func:`~jaxrl_llm.models.logprobs.hidden_logprobs` of the packed rows' tokens, each
    output ``f32[rows, W]`` at its token's (target) column, 0 in column 0.

    With ``micro.targets_rc`` the LM head runs only on the states before each row's C
    completion columns (gathered), and the outputs go back to those columns (0 on the other
    columns: prompt tokens, padding), as the unpacked path, which starts at the completion;
    without it, on every column. ``kwargs`` go to ``hidden_logprobs`` (a tuple of one
    output unless ``with_entropy``)."""

    def outputs(h: jax.Array, y: jax.Array) -> tuple[jax.Array, ...]:
        out = hidden_logprobs(lm, h, y, **kwargs)
        return out if isinstance(out, tuple) else (out,)

    if micro.targets_rc is None:
        out = outputs(h_rwd[:, :-1], micro.tokens_rw[:, 1:])
        return tuple(map(pk.predictions_to_targets, out))
    rows, w = micro.tokens_rw.shape
    col_rc = jnp.maximum(micro.targets_rc, 1)  # padding reads column 1: computed, dropped
    h_rcd = jnp.take_along_axis(h_rwd, (col_rc - 1)[:, :, None], axis=1)
    out = outputs(h_rcd, jnp.take_along_axis(micro.tokens_rw, col_rc, axis=1))
    back = jnp.where(micro.targets_rc >= 0, micro.targets_rc, w)
    row_r1 = jnp.arange(rows)[:, None]
    scatter = lambda y_rc: jnp.zeros((rows, w), y_rc.dtype).at[row_r1, back].set(y_rc, mode="drop")
    return tuple(map(scatter, out))


def _unpack_micro(
    shared: PackedShared, micro: PackedMicro, y_rw: jax.Array, fill: jax.Array | float = 0.0
) -> jax.Array:
    """``[n, T]``: the micro-batch's target-column output ``y_rw`` at its sequences' completion
    tokens, ``fill`` elsewhere (padding and the sequences of other micro-batches)."""
    here = shared.valid_nt & (shared.slot_n == micro.slot)[:, None]
    return jnp.where(here, y_rw[shared.row_n[:, None], shared.col_nt], fill)


# ---------------------------------------------------------------------------------------------
# The engine (jaxrl_llm.train.accumulate) on a TrainState.

_pair = acc.token_pair  # the token-mean pair of the loss functions below


def _state_io(with_critic: bool) -> tuple[Callable, Callable]:
    """``read`` / ``write`` of :func:`~jaxrl_llm.train.accumulate.make_step` on a TrainState:
    the step and the policy's (and the critic's) parameters and optimizer states."""

    def read(state: TrainState):
        if with_critic:
            params = (state.params, state.critic_params)
            return state.step, params, (state.opt_state, state.critic_opt_state)
        return state.step, (state.params,), (state.opt_state,)

    def write(
        state: TrainState,
        step: jax.Array,
        params: tuple[dict, ...],
        opts: tuple[optax.OptState, ...],
    ) -> TrainState:
        new = state._replace(step=step, params=params[0], opt_state=opts[0])
        if with_critic:
            new = new._replace(critic_params=params[1], critic_opt_state=opts[1])
        return new

    return read, write


def _model_of(graphdef: nnx.GraphDef, frozen: dict | None) -> Callable[[dict], nnx.Module]:
    """``params -> module``; with LoRA's ``frozen`` base, the module of ``frozen ∪ params``."""
    if frozen is None:
        return lambda params: nnx.merge(graphdef, params)
    return lambda params: nnx.merge(graphdef, lora.combine(frozen, params))


def _param_sharding(state_sharding: TrainState | None, field: str) -> Any:
    return None if state_sharding is None else getattr(state_sharding, field)


# ---------------------------------------------------------------------------------------------
# On-policy recipes.


def _zeros(mask: jax.Array) -> jax.Array:
    return jnp.zeros(mask.shape, jnp.float32)


def _mask(mb: Any) -> jax.Array:
    """The loss mask of a minibatch as a denominator sees it (``[K, m, T]`` stacked, or the
    packed ``(shared, micro)`` pair's ``[n, T]``)."""
    return mb.mask_nt if isinstance(mb, UpdateBatch) else mb[0].fields.mask_nt


def _completion_start(batch: Any, mask_nt: jax.Array) -> int:
    return batch.shape[1] - mask_nt.shape[1]


def _policy_terms(
    obj: rc.Objective,
    mb: UpdateBatch,
    logp: jax.Array,
    entropy: jax.Array | None,
    mask: jax.Array,
    tis_cap: float | None,
    scales: rc.TermScales | None = None,
) -> tuple[jax.Array, dict[str, Pair]]:
    """``(Σ loss, metric pairs)`` of the objective on ``[n, T]`` log-probs over ``mask``.

    With the objective's :class:`~jaxrl_llm.recipe.RolloutCorrection` (see the module
    docstring): bypass (no recompute) weights ``sg(π_θ)/μ``, decoupled (``logp_old_nt``
    recomputed = π_prox) weights ``π_prox/μ``; ``A ← w·A`` (or the objective's own
    ``weighted_loss(..., w)``), and the ``rollout_corr/*`` metrics.
    """
    adv = mb.adv_nt
    aux: dict[str, Pair] = {}
    weight = None  # the correction's weights, for an objective that applies them itself
    correction = obj.rollout_correction
    if correction is not None:
        if mb.logp_sampler_nt is None:
            raise ValueError(
                "the objective's rollout_correction needs the sampler's log-probs in the batch "
                "(UpdateBatch.logp_sampler_nt; old_logprobs.source: sampler)"
            )
        decoupled = mb.logp_old_nt is not None
        if decoupled and correction.bypass == "ppo_clip":
            raise ValueError(
                "rollout_correction.bypass='ppo_clip' takes μ as π_old; with a recomputed "
                "π_old (logp_old_nt) the correction is decoupled: use bypass='reinforce'"
            )
        logp_old = mb.logp_old_nt if decoupled else _sg(logp)
        c = correction.weights(logp_old, mb.logp_sampler_nt, mask)
        w = c.weight_bgt
        if correction.bypass == "ppo_clip":  # μ in the recipe's ratio; the keep-mask only
            logp_old, w = mb.logp_sampler_nt, c.keep_bgt.astype(jnp.float32)
        for key, value in rcorr.correction_metrics(c, mask).items():
            aux[f"rollout_corr/{key}"] = value
        if obj.weighted_loss is None:
            adv = jnp.where(mask, adv * w, 0.0)
        else:
            weight = w
    elif mb.logp_old_nt is not None:
        logp_old = mb.logp_old_nt
    else:
        logp_old = _sg(logp)
        if mb.logp_sampler_nt is not None:
            tis = pl.truncated_importance_weight
            w = tis(logp, mb.logp_sampler_nt, mask, cap=tis_cap)
            if tis_cap is not None:
                raw = tis(logp, mb.logp_sampler_nt, mask)
                aux["tis/capped_fraction"] = _pair(raw > tis_cap, mask)
            aux["tis/weight_mean"] = _pair(w, mask)
            adv = jnp.where(mask, adv * w, 0.0)
    terms = rc.policy_objective(
        obj,
        logp,
        adv,
        mask,
        logp_old_bgt=logp_old,
        logp_ref_bgt=mb.logp_ref_nt,
        entropy_bgt=entropy if obj.needs_entropy else None,
        scales=scales if scales is not None else rc.TermScales(),
        correction_weight_bgt=weight,
    )
    aux["actor/loss"] = terms.total
    aux["actor/pg_loss"] = terms.policy
    if obj.kl is not None:
        aux["actor/kl_loss"] = terms.kl
    if entropy is not None:
        aux["actor/entropy"] = _pair(_sg(entropy), mask)
    if mb.logp_ref_nt is not None:
        kl = _kl.kl_k3(_sg(logp), jnp.where(mask, mb.logp_ref_nt, 0.0))
        aux["actor/kl_ref"] = _pair(kl, mask)
    for key, value in obj.ratio_metrics(logp, logp_old, adv, mask).items():
        aux[f"actor/{key}"] = value
    return terms.total[0], aux


def policy_sums_fn(
    recipe: Recipe,
    graphdef: nnx.GraphDef,
    *,
    temperature: float = 1.0,
    tis_cap: float | None = None,
    entropy_metrics: bool = True,
    chunk_size: int | None = 256,
    packed: bool = False,
    frozen: dict | None = None,
) -> Callable[[Any, Any], tuple[jax.Array, dict[str, Pair]]]:
    """``(params, micro_batch) -> (Σ loss, metric pairs)`` of the recipe's policy objective
    (``packed``: the micro-batch is ``(PackedShared, PackedMicro)``; ``frozen``: LoRA's frozen
    base, joined with ``params``, the adapters, which alone are differentiated)."""
    obj = recipe.objective
    with_entropy = entropy_metrics or obj.needs_entropy
    model_of = _model_of(graphdef, frozen)

    def sums(
        params: dict, mb: UpdateBatch, scales: rc.TermScales | None = None
    ) -> tuple[jax.Array, dict[str, Pair]]:
        model = model_of(params)
        mask = mb.mask_nt
        out = completion_logprobs(
            model,
            mb.tokens_nl,
            mb.input_mask_nl,
            start=_completion_start(mb.tokens_nl, mask),
            temperature=temperature,
            chunk_size=chunk_size,
            with_entropy=with_entropy,
            lora_keys_bt=_unpacked_keys(mb),
        )
        logp, entropy = out if with_entropy else (out, None)
        return _policy_terms(obj, mb, logp, entropy, mask, tis_cap, scales)

    def packed_sums(
        params: dict, mb: tuple[PackedShared, PackedMicro], scales: rc.TermScales | None = None
    ) -> tuple[jax.Array, dict[str, Pair]]:
        shared, micro = mb
        model = model_of(params)
        h_rwd = packed_hidden(model.model, micro, _packed_keys(shared.fields, micro))
        outs = packed_target_logprobs(
            model,
            h_rwd,
            micro,
            temperature=temperature,
            chunk_size=chunk_size,
            with_entropy=with_entropy,
        )
        fields = shared.fields
        # Tokens outside this micro-batch read π_old (ratio 1, finite): masked, they add 0.
        fill = 0.0 if fields.logp_old_nt is None else fields.logp_old_nt
        logp = _unpack_micro(shared, micro, outs[0], fill)
        entropy = None
        if with_entropy:
            entropy = _unpack_micro(shared, micro, outs[1])
        mask = fields.mask_nt & (shared.slot_n == micro.slot)[:, None]
        return _policy_terms(obj, fields, logp, entropy, mask, tis_cap, scales)

    return packed_sums if packed else sums


def packed_values(critic: nnx.Module, micro: PackedMicro) -> jax.Array:
    """``f32[rows, W]``: V at the state before each packed token (its target column)."""
    h_rwd = packed_hidden(critic.model, micro)
    w_d1 = critic.score.kernel[...].astype(h_rwd.dtype)
    v_rw = jnp.dot(h_rwd, w_d1[:, 0], preferred_element_type=jnp.float32)
    return pk.shift_to_targets(v_rw)


def critic_sums_fn(
    recipe: Recipe,
    critic_graphdef: nnx.GraphDef,
    *,
    packed: bool = False,
    frozen: dict | None = None,
) -> Callable[[Any, Any], tuple[jax.Array, dict[str, Pair]]]:
    """``(critic_params, micro_batch) -> (Σ value loss, metric pairs)``; aggregated with the
    critic's ``aggregate`` (token-mean by default)
    (``packed``: the micro-batch is ``(PackedShared, PackedMicro)``; ``frozen``: a LoRA
    critic's frozen trunk)."""
    model_of = _model_of(critic_graphdef, frozen)

    def sums(params: dict, mb: Any) -> tuple[jax.Array, dict[str, Pair]]:
        critic = model_of(params)
        if packed:
            shared, micro = mb
            mb = shared.fields
            value = _unpack_micro(shared, micro, packed_values(critic, micro), mb.value_old_nt)
            mask = mb.mask_nt & (shared.slot_n == micro.slot)[:, None]
        else:
            start = _completion_start(mb.tokens_nl, mb.mask_nt)
            value = critic(mb.tokens_nl, mb.input_mask_nl)[:, start - 1 : -1]
            mask = mb.mask_nt
        clip = recipe.critic.value_clip
        loss = pl.value_loss(value, mb.value_old_nt, mb.return_nt, mask, clip_eps=clip)
        total, denominator = recipe.critic.aggregate(jnp.where(mask, loss, 0.0), mask)
        aux = {
            "critic/loss": (total, denominator),
            "critic/value_mean": _pair(value, mask),
        }
        if clip is not None:
            moved = jnp.abs(value - mb.value_old_nt) > clip
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
    jit: bool = True,
    packed: bool = False,
    frozen: dict | None = None,
    critic_frozen: dict | None = None,
) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]:
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
      jit: False returns the traceable step (the RL step jits it with its forward passes).
      packed: the batch is a packed :func:`packed_batch` (``ppo_epochs`` still applies; the
        minibatches and micro-batches are the plan's, ``num_minibatches`` and
        ``micro_batch_size`` are ignored).
      frozen, critic_frozen: LoRA (:mod:`jaxrl_llm.models.lora`): the frozen base of the
        policy (critic); the state's ``params`` (``critic_params``) are then the adapters
        only, the models are ``combine(frozen, params)``, and gradients and optimizer states
        exist for the adapters alone. The jitted step takes the bases as arguments (not
        constants of the program, not donated); with ``jit=False`` they are closed over, so
        pass the caller's traced values.
    """
    if isinstance(recipe, PreferenceRecipe):
        raise ValueError(f"make_update_step: {recipe.name} is offline; use make_dpo_step")
    if recipe.critic is not None and (critic_graphdef is None or critic_tx is None):
        raise ValueError(
            f"make_update_step: {recipe.name} trains a critic; pass critic_graphdef and critic_tx"
        )
    if mesh is not None and state_sharding is None:
        raise ValueError("make_update_step: a mesh needs the state_sharding")

    def trainees(frozen: dict | None, critic_frozen: dict | None) -> list[acc.Trainee]:
        out = [
            acc.Trainee(
                "actor",
                tx,
                policy_sums_fn(
                    recipe,
                    graphdef,
                    temperature=temperature,
                    tis_cap=tis_cap,
                    entropy_metrics=entropy_metrics,
                    chunk_size=chunk_size,
                    packed=packed,
                    frozen=frozen,
                ),
                lambda mb: recipe.objective.aggregate(_zeros(_mask(mb)), _mask(mb))[1],
                param_sharding=_param_sharding(state_sharding, "params"),
                schedule=schedule,
                # token-mean KL / entropy under another loss mode: D_loss / N_tok per minibatch
                context=(
                    (lambda mb: rc.term_scales(recipe.objective, _mask(mb)))
                    if recipe.objective.mixed_aggregation
                    else None
                ),
            )
        ]
        if recipe.critic is not None:
            out.append(
                acc.Trainee(
                    "critic",
                    critic_tx,
                    critic_sums_fn(recipe, critic_graphdef, packed=packed, frozen=critic_frozen),
                    lambda mb: recipe.critic.aggregate(_zeros(_mask(mb)), _mask(mb))[1],
                    param_sharding=_param_sharding(state_sharding, "critic_params"),
                    schedule=critic_schedule,
                )
            )
        return out

    def check(batch: Any) -> None:
        if packed != isinstance(batch, acc.Ragged):
            raise ValueError(
                f"make_update_step(packed={packed}) got a {type(batch).__name__} batch; a packed "
                "update takes update.packed_batch(...), an unpacked one an UpdateBatch"
            )
        if packed:
            batch = batch.shared.fields
        if recipe.critic is not None and (batch.value_old_nt is None or batch.return_nt is None):
            raise ValueError(f"{recipe.name}: the batch needs value_old_nt and return_nt")

    read, write = _state_io(recipe.critic is not None)
    make = functools.partial(
        acc.make_step,
        read=read,
        write=write,
        epochs=ppo_epochs,
        num_minibatches=num_minibatches,
        micro_batch_size=micro_batch_size,
        mesh=mesh,
        state_sharding=state_sharding,
        batch_axes=dict(rules).get("batch"),
        check=check,
    )
    return _with_frozen(
        make,
        trainees,
        frozen,
        critic_frozen,
        jit=jit,
        mesh=mesh,
        state_sharding=state_sharding,
        rules=rules,
    )


def _with_frozen(
    make: Callable[..., Callable],
    trainees: Callable[[dict | None, dict | None], Sequence[acc.Trainee]],
    frozen: dict | None,
    critic_frozen: dict | None,
    *,
    jit: bool,
    mesh: jax.sharding.Mesh | None,
    state_sharding: Any,
    rules: shd.Rules,
) -> Callable:
    """The step of ``make(trainees(frozen, critic_frozen), jit=...)``; with frozen LoRA bases
    and ``jit``, jitted with the bases as (non-donated) arguments rather than constants."""
    if (frozen is None and critic_frozen is None) or not jit:
        return make(trainees(frozen, critic_frozen), jit=jit)

    def step(state: TrainState, batch: Any, bases: tuple) -> tuple[TrainState, dict]:
        return make(trainees(*bases), jit=False)(state, batch)

    return acc.jit_step(
        step,
        mesh=mesh,
        state_sharding=state_sharding,
        batch_axes=dict(rules).get("batch"),
        consts=((frozen, critic_frozen),),
    )


# ---------------------------------------------------------------------------------------------
# DPO.


def dpo_sums_fn(
    recipe: PreferenceRecipe,
    graphdef: nnx.GraphDef,
    *,
    chunk_size: int | None = 256,
    frozen: dict | None = None,
) -> Callable[[Any, DPOBatch], tuple[jax.Array, dict[str, Pair]]]:
    """``(params, micro_batch) -> (Σ pair losses, metric pairs)``; one forward on chosen and
    rejected stacked (``frozen``: LoRA's frozen base)."""
    beta = recipe.beta
    weighted = rc.SEQUENCE_WEIGHTS in recipe.requires
    model_of = _model_of(graphdef, frozen)

    def sums(params: dict, mb: DPOBatch) -> tuple[jax.Array, dict[str, Pair]]:
        model = model_of(params)
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
            with_log_sum_sq=weighted,
        )
        weight = None
        if weighted:  # WPO: the answers' weights from the policy's own token distribution
            logp, log_sum_sq = logp
            weight = pref.wpo_weights(logp, log_sum_sq, mask)
        seq = pref.sequence_logprob(logp, mask)
        length = pref.sequence_length(mask)
        batch = rc.PairLogprobs(
            logp_chosen_p=seq[:n],
            logp_rejected_p=seq[n:],
            len_chosen_p=length[:n],
            len_rejected_p=length[n:],
            ref_chosen_p=mb.ref_chosen_n,
            ref_rejected_p=mb.ref_rejected_n,
            weight_chosen_p=None if weight is None else weight[:n],
            weight_rejected_p=None if weight is None else weight[n:],
        )
        loss = recipe.loss(batch)
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
    recipe: PreferenceRecipe,
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
    frozen: dict | None = None,
) -> Callable[[TrainState, DPOBatch], tuple[TrainState, dict[str, jax.Array]]]:
    """The jitted DPO-family update ``step(state, batch) -> (state, metrics)`` (``frozen``:
    LoRA's frozen base, as in :func:`make_update_step`).

    The loss of a minibatch is the mean over its pairs of ``recipe.loss`` on the
    sequence log-probs Σ_t log π(y_t | x, y_<t) of the answers; gradients are accumulated over
    micro-batches of pairs exactly as in :func:`make_update_step` (denominator: the number of
    pairs). Metrics: ``actor/loss``, ``dpo/logp_chosen``, ``dpo/logp_rejected`` and, with a
    reference, ``dpo/reward_accuracy``, ``dpo/reward_margin``, ``dpo/reward_chosen``,
    ``dpo/reward_rejected`` (the implicit rewards β·log π/π_ref), ``actor/grad_norm``,
    ``actor/lr``, ``update/nonfinite``.
    """
    if not isinstance(recipe, PreferenceRecipe):
        raise ValueError(f"make_dpo_step: {recipe.name} is not a preference recipe")

    def trainees(frozen: dict | None, _: None) -> tuple[acc.Trainee]:
        return (
            acc.Trainee(
                "actor",
                tx,
                dpo_sums_fn(recipe, graphdef, chunk_size=chunk_size, frozen=frozen),
                # the number of pairs: the minibatch's masks are stacked [K, m, T]
                lambda mb: jnp.asarray(
                    mb.chosen_mask_nt.shape[0] * mb.chosen_mask_nt.shape[1], jnp.float32
                ),
                param_sharding=_param_sharding(state_sharding, "params"),
                schedule=schedule,
            ),
        )

    read, write = _state_io(with_critic=False)
    make = functools.partial(
        acc.make_step,
        read=read,
        write=write,
        epochs=ppo_epochs,
        num_minibatches=num_minibatches,
        micro_batch_size=micro_batch_size,
        mesh=mesh,
        state_sharding=state_sharding,
        batch_axes=dict(rules).get("batch"),
    )
    return _with_frozen(
        make,
        trainees,
        frozen,
        None,
        jit=True,
        mesh=mesh,
        state_sharding=state_sharding,
        rules=rules,
    )


__all__ = [
    "DPOBatch",
    "PackedMicro",
    "PackedShared",
    "UpdateBatch",
    "critic_sums_fn",
    "dpo_sums_fn",
    "make_dpo_step",
    "make_update_step",
    "packed_batch",
    "packed_hidden",
    "packed_target_logprobs",
    "packed_values",
    "policy_sums_fn",
]
