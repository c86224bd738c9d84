"""Exact gradient accumulation: epochs × minibatches × micro-batches in one jitted step.

The engine behind the update steps of :mod:`jaxrl_llm.train.update`, knowing nothing about RL:
it trains one or more :class:`Trainee` (a name, an optax optimizer and a ``(sum, denominator)``
loss) on a batch of N rows:

    for epoch in range(epochs):                # lax.scan
      for minibatch in minibatches:            # lax.scan; one optimizer update per trainee each
        D = denominator(minibatch)             # the global denominator, from the masks alone
        g = Σ_micro ∇θ sum_micro               # lax.scan over micro-batches
        θ ← tx(g / max(D, 1))                  # skipped when g or Σ sum is not finite

Exact accumulation. A trainee's loss on a minibatch is ``Σ sum_micro / max(D, 1)``: its ``sums``
gives the *sum* of its per-element losses on one micro-batch, and its ``denominator`` depends
only on the masks of the whole minibatch (a token count, a number of sequences, a constant).
Accumulating the gradients of the sums and dividing once by the minibatch's denominator is then
*exactly* the gradient of the whole-minibatch loss: micro-batching changes memory, not results
(up to float summation order; tested to 1e-6). A loss whose denominator depends on the
parameters, or a per-micro-batch mean, would not have this property.

Splitting. A batch of N rows with M minibatches of K micro-batches of m rows (N = M·K·m,
S = M·K micro-steps) is split *strided*: micro-step s = j·K + k (minibatch j) takes rows
{i·S + s : i < m}. Row ``i·S + s`` sits in the same place of the data-parallel layout for every
s, so each device feeds each micro-batch from its own rows: no data moves between devices.
Minibatches are the same every epoch (no reshuffling).

Ragged micro-batches (packing, token budgets). A batch may instead be a :class:`Ragged`:
already split into M minibatches, each with ``K`` micro-batch slots of which its first
``count[j]`` are used. The micro-batch loop is then a ``lax.fori_loop`` with the traced trip
count ``count[j]`` over the slot buffer, so the number of micro-batches per minibatch can change
from step to step without recompiling, and unused slots are never computed (no autodiff goes
through the loop: each iteration differentiates its own micro-batch and adds the gradient).
``sums`` then receives ``(shared_j, micro_jk)`` and ``denominator`` ``(shared_j, micro_j)``: the
per-minibatch data every micro-batch sees (e.g. the ``[n, T]`` masks and advantages) and the
stacked slots. Exactness is unchanged: the denominator still comes from the whole minibatch.

Fused accumulation. Each micro-batch's gradient is taken inside
:func:`~jaxrl_llm.models.grad_accumulation.accumulating_into` the running sum: a model whose
layer scan is rematerialised (``remat="full"``) adds its layers' gradients into the
accumulator inside its backward pass, so the micro-batch's stacked layer gradient is never a
second gradient-sized buffer beside the sum; the other leaves are added after the gradient.
The sums are the same either way (tested against the plain accumulation). A minibatch of one
micro-batch has no running sum; only the LM head's chunk loop then makes an accumulator of its
own (:func:`~jaxrl_llm.models.grad_accumulation.own_accumulators`), to add each chunk's head
gradient into in blocks.

Non-finite updates. A non-finite gradient (one NaN/inf anywhere makes its global norm
non-finite) or loss sum skips that trainee's update inside the jit (a ``lax.cond``, or a
per-leaf select where XLA:GPU compiles it: :func:`skip_by_select`): its parameters and
optimizer state are kept bit for bit, and ``update/nonfinite`` counts the skipped updates
(over trainees, epochs and minibatches), so a bad batch can never write NaN into the
parameters or the optimizer moments; the training loop counts or stops on it.

Metrics (f32 scalars): every ``(sum, den)`` metric pair a trainee's ``sums`` reports, finalized
as ``sum / max(den, 1)`` per minibatch and averaged over the epoch × minibatch updates;
``{name}/grad_norm`` (of the scaled gradient, before the optimizer's clipping), ``{name}/lr``
from a trainee's schedule (:func:`make_step`), and ``update/nonfinite``.

Sharding. With a mesh, :func:`jit_step` jits with in/out shardings (the batch's leading axis over
the batch mesh axes, the state as given, metrics replicated) and donates the state;
:func:`batch_constrainer` keeps every micro-batch split over the batch axes, and a trainee's
``param_sharding`` lays out its gradient accumulators (the head's own included) like its
parameters.

Use::

    actor = Trainee("actor", optax.adam(1e-3), sums, denominator, schedule=lambda step: 1e-3)
    step = make_step(
        (actor,),
        read=lambda s: (s.step, (s.params,), (s.opt_state,)),
        write=lambda s, step, p, o: s._replace(step=step, params=p[0], opt_state=o[0]),
        num_minibatches=2,
        micro_batch_size=4,
    )
    state, metrics = step(state, batch)  # the state is donated
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm import distributed as dist
from jaxrl_llm.models import attention, grad_accumulation
from jaxrl_llm.train import hostmem

Pair = tuple[jax.Array, jax.Array]
"""A ``(sum, denominator)`` pair; its value is ``sum / max(denominator, 1)``."""
SumsFn = Callable[[Any, Any], tuple[jax.Array, dict[str, Pair]]]
"""``(params, micro_batch) -> (loss_sum, {metric: (sum, den)})``."""
DenominatorFn = Callable[[Any], jax.Array]
"""``minibatch -> f32[]``: the loss denominator of a whole minibatch, from its masks only."""
Schedule = Callable[[jax.Array], jax.Array]
"""``step -> learning rate`` (for the ``{name}/lr`` metric)."""
BatchAxes = str | tuple[str, ...] | None
"""The mesh axes a batch's leading axis is split over (None: replicated)."""

StateT = TypeVar("StateT")
BatchT = TypeVar("BatchT")

NONFINITE = "update/nonfinite"


class Trainee(NamedTuple):
    """One model trained by the step.

    Attributes:
      name: the prefix of its metrics (``{name}/grad_norm``, ``{name}/lr``); unique in a step.
      tx: its optimizer (clipping, if any, included).
      sums: ``(params, micro_batch) -> (loss_sum, {metric: (sum, den)})``; the micro-batch has
        the batch's structure with ``m`` rows. Only ``loss_sum`` is differentiated.
      denominator: ``minibatch -> f32[]``, the loss denominator of a whole minibatch, computed
        from masks (or shapes) only. It sees the minibatch as its micro-batches stacked: every
        leaf ``[K, m, ...]``, so reduce over both leading axes (``jnp.sum(mask)``; a row count
        is ``mask.shape[0] * mask.shape[1]``).
      param_sharding: a pytree of shardings like the parameters; lays out the gradient
        accumulators like the parameters (None: left to the compiler).
      schedule: ``step -> lr``, reported as ``{name}/lr`` by :func:`make_step` (None: no metric).
      context: ``minibatch -> pytree`` computed, like ``denominator``, once per minibatch from
        its masks and passed to every micro-batch as ``sums(params, micro_batch, context)``
        (minibatch-level statistics a loss term needs, e.g. a second denominator); None:
        ``sums(params, micro_batch)``.
    """

    name: str
    tx: optax.GradientTransformation
    sums: SumsFn
    denominator: DenominatorFn
    param_sharding: Any = None
    schedule: Schedule | None = None
    context: Callable[[Any], Any] | None = None


class Ragged(NamedTuple):
    """A batch split by the caller into M minibatches of a variable number of micro-batches.

    Attributes:
      shared: a pytree, every leaf ``[M, ...]``: minibatch j's data, seen by each of its
        micro-batches.
      micro: a pytree, every leaf ``[M, K, ...]``: the K micro-batch slots of each minibatch.
      count: ``int32[M]``, the slots used by each minibatch (``1 ≤ count[j] ≤ K``; traced).
    """

    shared: Any
    micro: Any
    count: jax.Array


def token_pair(x: jax.Array, mask: jax.Array) -> Pair:
    """The token-mean pair of ``x`` over ``mask``: ``(Σ_mask x, Σ mask)`` in float32."""
    total = jnp.sum(jnp.where(mask, jnp.asarray(x, jnp.float32), 0.0))
    return total, jnp.sum(mask, dtype=jnp.int32).astype(jnp.float32)


def finalize(pair: Pair) -> jax.Array:
    """The value of a ``(sum, den)`` pair: ``sum / max(den, 1)`` in float32 (0 for (0, 0))."""
    total, den = pair
    return jnp.asarray(total, jnp.float32) / jnp.maximum(jnp.asarray(den, jnp.float32), 1.0)


def identity(tree: Any) -> Any:
    """The default ``constrain``: no sharding constraint."""
    return tree


# ---------------------------------------------------------------------------------------------
# Splitting.


def split_sizes(
    batch: Any, *, num_minibatches: int = 1, micro_batch_size: int | None = None
) -> tuple[int, int, int]:
    """``(M, K, m)``: minibatches, micro-batches per minibatch, rows per micro-batch.

    Raises:
      ValueError: the batch is empty, its leaves disagree on the number of rows, or the rows do
        not split into ``num_minibatches`` minibatches of micro-batches of ``micro_batch_size``.
    """
    _check_sizes(num_minibatches=num_minibatches, micro_batch_size=micro_batch_size)
    leaves = jax.tree.leaves(batch)
    if not leaves:
        raise ValueError("the batch has no arrays")
    rows = {int(jnp.shape(x)[0]) if jnp.ndim(x) else -1 for x in leaves}
    if -1 in rows:
        raise ValueError("every array of the batch needs a leading (row) axis; got a scalar")
    if len(rows) != 1:
        raise ValueError(f"the batch's arrays disagree on the number of rows: {sorted(rows)}")
    (n,) = rows
    if n == 0:
        raise ValueError("the batch has 0 rows")
    if n % num_minibatches:
        raise ValueError(f"a batch of {n} rows does not split into {num_minibatches} minibatches")
    minibatch = n // num_minibatches
    micro = micro_batch_size or minibatch
    if minibatch % micro:
        raise ValueError(
            f"a minibatch of {minibatch} rows (a batch of {n} in {num_minibatches}) does not "
            f"split into micro-batches of {micro}"
        )
    return num_minibatches, minibatch // micro, micro


def strided_split(x: jax.Array, num_minibatches: int, num_micro: int) -> jax.Array:
    """``[N, ...] -> [M, K, m, ...]``, strided: ``out[j, k, i] = x[i·M·K + j·K + k]``."""
    steps = num_minibatches * num_micro
    m = x.shape[0] // steps
    x = x.reshape(m, steps, *x.shape[1:]).swapaxes(0, 1)
    return x.reshape(num_minibatches, num_micro, m, *x.shape[2:])


# ---------------------------------------------------------------------------------------------
# One update.


def _add(a: Any, b: Any) -> Any:
    return jax.tree.map(jnp.add, a, b)


def _first(tree: Any) -> Any:
    return jax.tree.map(lambda x: x[0], tree)


def _sums(trainee: Trainee, context: Any) -> SumsFn:
    if trainee.context is None:
        return trainee.sums
    return lambda params, micro: trainee.sums(params, micro, context)


def _grad_into(
    sums: Callable[[Any, Any], tuple[jax.Array, dict[str, Pair]]],
    params: Any,
    micro: Any,
    acc: Any,
) -> tuple[tuple[jax.Array, dict[str, Pair]], Any]:
    """``((loss_sum, metric pairs), acc + ∇ loss_sum)`` of one micro-batch, float32.

    Rematerialised layer stacks add their gradients into ``acc`` inside the backward pass
    (:mod:`jaxrl_llm.models.grad_accumulation`), so their micro-batch gradient is never a
    second gradient-sized buffer beside ``acc``; every other leaf is added here.
    """
    added: list[set[int]] = []

    def into(p: Any) -> tuple[jax.Array, dict[str, Pair]]:
        with grad_accumulation.accumulating_into(p, acc) as fused:
            added.append(fused)
            return sums(p, micro)

    out, grads = jax.value_and_grad(into, has_aux=True)(params)
    fused = added[0]
    acc_leaves, treedef = jax.tree.flatten(acc)
    summed = [
        g.astype(jnp.float32) if i in fused else a + g.astype(jnp.float32)
        for i, (a, g) in enumerate(zip(acc_leaves, treedef.flatten_up_to(grads), strict=True))
    ]
    return out, treedef.unflatten(summed)


def _grad_one(
    trainee: Trainee, sums: SumsFn, params: Any, micro: Any
) -> tuple[jax.Array, dict[str, Pair], Any]:
    """(loss_sum, metric pairs, ∇ loss_sum) of a minibatch that is one micro-batch: no running
    sum, so no zero-initialised accumulator (its gradient-sized buffer would be live beside the
    backward's gradients: the whole-batch packed update of SmolLM2-135M held 1.72 GiB of XLA
    temporaries with one, 1.22 without), except the LM head's, which its chunk loop makes for
    itself in the backward pass to add each chunk's gradient into in blocks
    (:func:`~jaxrl_llm.models.grad_accumulation.own_accumulators`)."""

    def own(p: Any) -> tuple[jax.Array, dict[str, Pair]]:
        with grad_accumulation.own_accumulators(p, trainee.param_sharding):
            return sums(p, micro)

    (loss, aux), grads = jax.value_and_grad(own, has_aux=True)(params)
    return loss, aux, grads


def _accumulate(
    trainee: Trainee, params: Any, mb: Any, constrain: Callable[[Any], Any], context: Any = None
) -> tuple[jax.Array, dict[str, Pair], Any]:
    """Σ over the K micro-batches of ``mb`` of (loss_sum, metric pairs, ∇ loss_sum)."""
    sums = _sums(trainee, context)
    grad_fn = jax.value_and_grad(sums, has_aux=True)
    num_micro = jax.tree.leaves(mb)[0].shape[0]
    if num_micro == 1:
        return _grad_one(trainee, sums, params, constrain(_first(mb)))

    def body(
        carry: tuple[jax.Array, dict[str, Pair], Any], micro: Any
    ) -> tuple[tuple[jax.Array, dict[str, Pair], Any], None]:
        loss, aux, acc = carry
        (d_loss, d_aux), acc = _grad_into(sums, params, constrain(micro), acc)
        return (loss + d_loss, _add(aux, d_aux), acc), None

    (loss_shape, aux_shape), grad_shape = jax.eval_shape(grad_fn, params, _first(mb))
    zeros = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), tree)
    grads0 = zeros(grad_shape)
    if trainee.param_sharding is not None:
        grads0 = jax.lax.with_sharding_constraint(grads0, trainee.param_sharding)
    (loss, aux, grads), _ = jax.lax.scan(body, (zeros(loss_shape), zeros(aux_shape), grads0), mb)
    return loss, aux, grads


def _accumulate_ragged(
    trainee: Trainee,
    params: Any,
    mb: Ragged,
    constrain: Callable[[Any], Any],
    context: Any = None,
) -> tuple[jax.Array, dict[str, Pair], Any]:
    """Σ over the first ``mb.count`` micro-batch slots of (loss_sum, metric pairs, ∇ loss_sum):
    a loop with a traced trip count (the slots beyond it are not computed); one slot is one
    gradient, no loop."""
    sums = _sums(trainee, context)
    grad_fn = jax.value_and_grad(sums, has_aux=True)
    micro_at = lambda k: constrain(jax.tree.map(lambda x: x[k], mb.micro))
    if jax.tree.leaves(mb.micro)[0].shape[0] == 1:  # one slot, so count == 1: no loop
        return _grad_one(trainee, sums, params, (mb.shared, micro_at(0)))
    (loss_shape, aux_shape), grad_shape = jax.eval_shape(grad_fn, params, (mb.shared, micro_at(0)))
    zeros = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), tree)
    grads0 = zeros(grad_shape)
    if trainee.param_sharding is not None:
        grads0 = jax.lax.with_sharding_constraint(grads0, trainee.param_sharding)

    def body(k: jax.Array, carry: tuple[jax.Array, dict[str, Pair], Any]) -> tuple:
        loss, aux, acc = carry
        (d_loss, d_aux), acc = _grad_into(sums, params, (mb.shared, micro_at(k)), acc)
        return loss + d_loss, _add(aux, d_aux), acc

    init = (zeros(loss_shape), zeros(aux_shape), grads0)
    return jax.lax.fori_loop(0, jnp.asarray(mb.count, jnp.int32), body, init)


def _apply(
    tx: optax.GradientTransformation,
    params: Any,
    opt_state: Any,
    grads: Any,
    denominator: jax.Array,
    loss_sum: jax.Array,
) -> tuple[Any, Any, jax.Array, jax.Array]:
    """θ ← tx(g / max(D, 1)), skipped (state kept) when the gradient or the loss is not finite.

    The skip takes the form the compiling backend keeps in place (:func:`skip_by_select`);
    either keeps the state bit for bit. XLA:CPU: a ``lax.cond``. A per-leaf
    ``jnp.where(finite, new, old)`` over an unconditional update was measured worse there:
    XLA kept copies of old values beside the new ones, and the update program's temporaries
    grew from 0.85 to 2.15 GB (peak RSS 3.61 -> 4.76 GiB; SmolLM2-135M in the GRPO workload of
    ``scripts/bench_train_step.py``, BENCHMARKS.md), and for a 1B model from 7.09 to 18.42 GiB.
    The cond itself costs nothing measurable there: an unconditional update compiles to the
    same temporaries (806.5 against 806.8 MiB) and peak. XLA:GPU of jaxlib 0.10.2 (what
    Python 3.11 gets) is the mirror image: its cond copies the parameters and both Adam
    moments into the cond's result (a 1B update's temporaries 18.42 GiB, 6.31 GiB as a select
    or with no skip at all; XLA:GPU compiled without a GPU, BENCHMARKS.md "Deviceless XLA:GPU
    compiles"); jaxlib 0.11.2's keeps both in place. XLA:TPU compiles both to the same
    temporaries.
    """
    scale = 1.0 / jnp.maximum(denominator, 1.0)
    grads = jax.tree.map(lambda g, p: (g * scale).astype(p.dtype), grads, params)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(grad_norm) & jnp.isfinite(loss_sum)

    def update(operands: tuple[Any, Any]) -> tuple[Any, Any]:
        params, opt_state = operands
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    old = (params, opt_state)
    if skip_by_select():
        new = jax.tree.map(lambda n, o: jnp.where(finite, n, o), update(old), old)
    else:
        new = jax.lax.cond(finite, update, lambda ops: ops, old)
    return *new, grad_norm, finite


def skip_by_select() -> bool:
    """Whether the non-finite skip traced now is a per-leaf select rather than a ``lax.cond``
    (:func:`_apply`): where XLA:GPU compiles it (the platform traced for,
    :func:`~jaxrl_llm.models.attention.trace_platform`, is a GPU, not emulated on CPU)."""
    return attention.trace_platform() == "gpu" and not attention.emulated()


# ---------------------------------------------------------------------------------------------
# The loop.


def optimize(
    trainees: Sequence[Trainee],
    params: Sequence[Any],
    opt_states: Sequence[Any],
    batch: Any,
    *,
    epochs: int = 1,
    num_minibatches: int = 1,
    micro_batch_size: int | None = None,
    constrain: Callable[[Any], Any] = identity,
) -> tuple[tuple[Any, ...], tuple[Any, ...], dict[str, jax.Array]]:
    """Epochs × minibatches of exact, micro-batched updates of every trainee (traceable).

    Args:
      trainees: the models to train; each minibatch updates each of them once, in order, each
        from its own parameters (they do not see each other's update).
      params, opt_states: one parameter pytree and optimizer state per trainee.
      batch: a pytree of arrays with N rows each (the leading axis), or a :class:`Ragged`
        batch (already split; ``num_minibatches`` and ``micro_batch_size`` are then ignored).
      epochs: passes over the batch (the same minibatches each time).
      num_minibatches: M, optimizer updates per epoch.
      micro_batch_size: m, rows per gradient micro-batch (None: whole minibatches).
      constrain: applied to every micro-batch before ``sums`` (see :func:`batch_constrainer`).

    Returns:
      ``(params, opt_states, metrics)``: tuples like the inputs, and the metrics of the module
      docstring (pair metrics and ``{name}/grad_norm`` averaged over the epochs × M updates,
      ``update/nonfinite`` the number of skipped updates).

    Raises:
      ValueError: bad sizes (see :func:`split_sizes`), repeated trainee names, or ``params`` /
        ``opt_states`` not one per trainee.
    """
    trainees = tuple(trainees)
    params, opt_states = tuple(params), tuple(opt_states)
    _check_trainees(trainees)
    if not len(params) == len(opt_states) == len(trainees):
        raise ValueError(
            f"{len(trainees)} trainees need as many parameter trees and optimizer states; got "
            f"{len(params)} and {len(opt_states)}"
        )
    _check_sizes(epochs=epochs)
    if isinstance(batch, Ragged):
        num_minibatches = _ragged_minibatches(batch)
        mbs, accumulate = batch, _accumulate_ragged
    else:
        _, num_micro, _ = split_sizes(
            batch, num_minibatches=num_minibatches, micro_batch_size=micro_batch_size
        )
        mbs = jax.tree.map(lambda x: strided_split(x, num_minibatches, num_micro), batch)
        accumulate = _accumulate

    def minibatch_step(
        carry: tuple[tuple[Any, ...], tuple[Any, ...]], mb: Any
    ) -> tuple[tuple[tuple[Any, ...], tuple[Any, ...]], dict[str, jax.Array]]:
        params, opt_states = carry
        new_params, new_opts, metrics = [], [], {}
        for trainee, p, o in zip(trainees, params, opt_states, strict=True):
            den_input = (mb.shared, mb.micro) if isinstance(mb, Ragged) else mb
            context = None if trainee.context is None else trainee.context(den_input)
            loss_sum, aux, grads = accumulate(trainee, p, mb, constrain, context)
            p, o, grad_norm, finite = _apply(
                trainee.tx, p, o, grads, trainee.denominator(den_input), loss_sum
            )
            metrics.update({k: finalize(v) for k, v in aux.items()})
            metrics[f"{trainee.name}/grad_norm"] = grad_norm
            metrics[f"{trainee.name}/nonfinite"] = 1.0 - finite.astype(jnp.float32)
            new_params.append(p)
            new_opts.append(o)
        return (tuple(new_params), tuple(new_opts)), metrics

    def epoch(
        carry: tuple[tuple[Any, ...], tuple[Any, ...]], _: None
    ) -> tuple[tuple[tuple[Any, ...], tuple[Any, ...]], dict[str, jax.Array]]:
        if num_minibatches == 1:  # no loop: a smaller program to compile
            carry, metrics = minibatch_step(carry, _first(mbs))
            return carry, jax.tree.map(lambda m: m[None], metrics)
        return jax.lax.scan(minibatch_step, carry, mbs)

    if epochs == 1:
        (params, opt_states), metrics = epoch((params, opt_states), None)
        metrics = jax.tree.map(lambda m: m[None], metrics)
    else:
        (params, opt_states), metrics = jax.lax.scan(
            epoch, (params, opt_states), None, length=epochs
        )
    skipped = [f"{t.name}/nonfinite" for t in trainees]
    out = {k: jnp.mean(v) for k, v in metrics.items() if k not in skipped}
    out[NONFINITE] = sum(jnp.sum(metrics[k]) for k in skipped)
    return params, opt_states, out


# ---------------------------------------------------------------------------------------------
# Sharding and jit.


def _batch_sharding(mesh: Mesh, batch_axes: BatchAxes, x: Any) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(batch_axes, *([None] * (jnp.ndim(x) - 1))))


def batch_constrainer(mesh: Mesh | None, batch_axes: BatchAxes) -> Callable[[Any], Any]:
    """``tree -> tree`` constraining every array's leading axis onto ``batch_axes`` of ``mesh``.

    Without a mesh: :func:`identity`. ``batch_axes`` is a mesh axis name, a tuple of them (as in
    ``jaxrl_llm.models.sharding``'s ``batch`` rule), or None (replicated).
    """
    if mesh is None:
        return identity

    def constrain(tree: Any) -> Any:
        def one(x: jax.Array) -> jax.Array:  # a scalar (a micro-batch's index) has no rows
            if jnp.ndim(x) == 0:
                return x
            return jax.lax.with_sharding_constraint(x, _batch_sharding(mesh, batch_axes, x))

        return jax.tree.map(one, tree)

    return constrain


def jit_step(
    step_fn: Callable[[StateT, BatchT], tuple[StateT, dict[str, jax.Array]]],
    *,
    mesh: Mesh | None = None,
    state_sharding: Any = None,
    batch_axes: BatchAxes = None,
    consts: tuple = (),
) -> Callable[[StateT, BatchT], tuple[StateT, dict[str, jax.Array]]]:
    """``step_fn`` jitted with the state donated.

    ``consts``: further arguments ``step_fn(state, batch, *consts)`` is called with each time
    (arrays that stay fixed, such as LoRA's frozen base): jit arguments in their own layouts,
    not constants folded into the program, not donated.

    With a mesh: in/out shardings (the state as ``state_sharding``, the batch's leading axis over
    ``batch_axes``, the metrics replicated), one compiled program per batch structure, run under
    ``jax.set_mesh(mesh)``; the state and the batch are first moved to those layouts (a no-op for
    arrays already in place). Without a mesh: a plain donating ``jax.jit``.
    """
    options = hostmem.update_compiler_options(mesh)  # XLA:CPU: the smaller peak
    if mesh is None:
        jitted = jax.jit(step_fn, donate_argnums=0, compiler_options=options)
        return lambda state, batch: jitted(state, batch, *consts)
    if state_sharding is None:
        raise ValueError("jit_step: a mesh needs the state_sharding")
    rep = NamedSharding(mesh, PartitionSpec())
    cache: dict[Hashable, Callable] = {}

    def call(state: StateT, batch: BatchT) -> tuple[StateT, dict[str, jax.Array]]:
        if isinstance(batch, Ragged):  # the micro-batches' rows over the batch axes
            micro = jax.tree.map(
                lambda x: NamedSharding(
                    mesh, PartitionSpec(None, None, batch_axes, *([None] * (jnp.ndim(x) - 3)))
                ),
                batch.micro,
            )
            batch_sharding = Ragged(jax.tree.map(lambda _: rep, batch.shared), micro, rep)
        else:
            batch_sharding = jax.tree.map(lambda x: _batch_sharding(mesh, batch_axes, x), batch)
        treedef = jax.tree.structure(batch)
        if treedef not in cache:
            const_shardings = jax.tree.map(lambda x: x.sharding, consts)
            cache[treedef] = jax.jit(
                step_fn,
                in_shardings=(state_sharding, batch_sharding, *const_shardings),
                out_shardings=(state_sharding, rep),
                donate_argnums=0,
                compiler_options=options,
            )
        # Committed arrays laid out otherwise (e.g. replicated log-probs) are moved first: jit
        # refuses a mismatch. Both are no-ops for arrays already in place.
        state = dist.put(state, state_sharding)
        batch = dist.put(batch, batch_sharding)
        with jax.set_mesh(mesh):
            return cache[treedef](state, batch, *consts)

    return call


# ---------------------------------------------------------------------------------------------
# The step factory.


def make_step(
    trainees: Sequence[Trainee],
    *,
    read: Callable[[StateT], tuple[jax.Array, tuple[Any, ...], tuple[Any, ...]]],
    write: Callable[[StateT, jax.Array, tuple[Any, ...], tuple[Any, ...]], StateT],
    epochs: int = 1,
    num_minibatches: int = 1,
    micro_batch_size: int | None = None,
    mesh: Mesh | None = None,
    state_sharding: Any = None,
    batch_axes: BatchAxes = None,
    check: Callable[[BatchT], None] | None = None,
    jit: bool = True,
) -> Callable[[StateT, BatchT], tuple[StateT, dict[str, jax.Array]]]:
    """The jitted ``step(state, batch) -> (state, metrics)`` training ``trainees`` on a batch.

    Args:
      trainees: the models (see :class:`Trainee`).
      read: ``state -> (step, params, opt_states)``: the step counter and, per trainee, its
        parameters and optimizer state.
      write: ``(state, step + 1, params, opt_states) -> state``: puts them back.
      epochs, num_minibatches, micro_batch_size: the shape of the update (see :func:`optimize`).
      mesh, state_sharding, batch_axes: the layout (see :func:`jit_step`); no mesh: a plain jit.
      check: ``batch -> None``, called when the step is traced; raise to refuse a batch.
      jit: False returns the traceable step itself (its batch constrained onto ``batch_axes``
        of ``mesh``), for a caller that jits a larger program around it.

    Metrics: those of :func:`optimize`, plus ``{name}/lr`` (the schedule at the state's step) for
    every trainee with a schedule.

    Raises:
      ValueError: bad sizes or trainees, here; sizes that do not divide the batch, at the first
        call with that batch shape.
    """
    trainees = tuple(trainees)
    _check_trainees(trainees)
    _check_sizes(epochs=epochs, num_minibatches=num_minibatches, micro_batch_size=micro_batch_size)
    constrain = batch_constrainer(mesh, batch_axes)

    def step(state: StateT, batch: BatchT) -> tuple[StateT, dict[str, jax.Array]]:
        if check is not None:
            check(batch)
        count, params, opt_states = read(state)
        params, opt_states, metrics = optimize(
            trainees,
            params,
            opt_states,
            batch,
            epochs=epochs,
            num_minibatches=num_minibatches,
            micro_batch_size=micro_batch_size,
            constrain=constrain,
        )
        for t in trainees:
            if t.schedule is not None:
                metrics[f"{t.name}/lr"] = t.schedule(count)
        return write(state, count + 1, params, opt_states), metrics

    if not jit:
        return step
    return jit_step(step, mesh=mesh, state_sharding=state_sharding, batch_axes=batch_axes)


# ---------------------------------------------------------------------------------------------
# Checks.


def _check_trainees(trainees: tuple[Trainee, ...]) -> None:
    if not trainees:
        raise ValueError("no trainees to train")
    names = [t.name for t in trainees]
    if len(set(names)) != len(names):
        raise ValueError(f"trainee names must be unique (they prefix the metrics); got {names}")


def _ragged_minibatches(batch: Ragged) -> int:
    """M of a ragged batch, checking that its leaves agree on it."""
    leads = {int(jnp.shape(x)[0]) for x in jax.tree.leaves((batch.shared, batch.micro))}
    leads.add(int(jnp.shape(batch.count)[0]))
    slots = {int(jnp.shape(x)[1]) for x in jax.tree.leaves(batch.micro)}
    if len(leads) != 1 or len(slots) != 1:
        raise ValueError(
            f"a Ragged batch needs [M, ...] shared leaves, [M, K, ...] micro leaves and an "
            f"int32[M] count; got leading sizes {sorted(leads)} and slot sizes {sorted(slots)}"
        )
    return leads.pop()


def _check_sizes(**sizes: int | None) -> None:
    for key, value in sizes.items():
        if value is None and key == "micro_batch_size":
            continue
        try:
            ok = not isinstance(value, bool) and operator.index(value) >= 1
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"{key} must be a positive integer, got {value!r}")


__all__ = [
    "NONFINITE",
    "BatchAxes",
    "DenominatorFn",
    "Pair",
    "Ragged",
    "Schedule",
    "SumsFn",
    "Trainee",
    "batch_constrainer",
    "finalize",
    "identity",
    "jit_step",
    "make_step",
    "optimize",
    "skip_by_select",
    "split_sizes",
    "strided_split",
    "token_pair",
]
