"""The sampler: G completions for each of B prompts under one ``jax.jit``.

Per call, one compiled program does:

1. prefill: the left-padded prompts ``[B, P]`` run once through the model into its KV cache,
   keeping only the last position's hidden state for the LM head (forming ``[B, P, V]`` logits
   would cost more than the whole prefill on a 49k vocabulary);
2. the cache is re-laid out for decoding (``decode.py``: keys ``[N, K, Dh, S]``, values
   ``[N, K, S, Dh]``, ``S = P + T`` slots preallocated) and its rows and the last logits are
   repeated G times (``N = B·G``; sample ``g`` of prompt ``b`` is row ``b·G + g``): the G
   samples of a prompt share its prefill;
3. a ``lax.while_loop`` over at most ``T - 1`` decode steps, each one cached forward of all
   ``N`` rows at once (one ``[N, D]`` matmul per weight), sampling (``sampling.py``) and
   in-place writes into preallocated ``[T, N]`` outputs. A row stops after a stop token (kept
   and masked valid); stopped rows keep running with ``mask = False`` so shapes stay static,
   and the loop exits as soon as every row has stopped.

The program runs on the paged engine's weights (``paged.engine_params``): the stacked layers
sliced into per-layer copies, and weights stored wider than the compute dtype (f32 master
weights, bf16 compute) cast, in one small program before it, so the prefill and every decode
step run unrolled on the same copies. Temperature, top-p and the stop ids are traced values and
prompt widths are padded on the left to a multiple of ``prompt_bucket``, so batches of similar
length reuse one compiled program; padding changes no result (positions come from the mask).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from jaxrl_llm import distributed as dist
from jaxrl_llm import memory_maps
from jaxrl_llm.models import sharding
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.transformer import CausalLM, KVCache
from jaxrl_llm.rollout import decode, paged, paged_dp, sampling

Params = dict[str, Any]
"""Model parameters as a pure dict (``nnx.to_pure_dict``): nested dicts of arrays."""

ModelLike = CausalLM | tuple[nnx.GraphDef, nnx.State | Params]
"""What ``generate`` samples from: a model, or its ``nnx.split`` halves."""


class Generation(NamedTuple):
    """What :func:`generate` returns: G sampled completions for each of B prompts.

    Attributes:
      tokens: ``int32[B, G, T]`` completion token ids; the pad id after a sequence stops.
      mask: ``bool[B, G, T]`` True on generated tokens, the stop token included.
      logprobs: ``float32[B, G, T]`` log-prob of each token under the distribution it was
        sampled from (``log softmax(logits / τ)`` restricted to the top-k/top-p set; with no
        filter exactly the trainer's ``token_logprobs`` at temperature τ; greedy: τ = 1);
        0 where ``mask`` is False.
      truncated: ``bool[B, G]`` True when the sequence hit its budget (``max_new_tokens``, or
        its ``max_new_tokens_bg`` entry) without a stop token.
      full_logprobs: ``float32[B, G, T]`` with ``generate(return_full_logprobs=True)``, else
        ``None``: each token's log-prob under the whole vocabulary at temperature 1,
        ``log softmax(logits)[token]`` (``sampling.full_logprobs``; no temperature, no
        top-k/top-p), the trainer's ``token_logprobs`` at τ = 1 of the same tokens. What an
        importance-sampling correction needs when top-k/top-p truncate the support, where
        ``logprobs`` is of the truncated, renormalised distribution. Equal to ``logprobs``
        when greedy (τ = 1 and no filter there by definition) and, for τ = 1 with no filter,
        up to float rounding. 0 where ``mask`` is False.
    """

    tokens: jax.Array
    mask: jax.Array
    logprobs: jax.Array
    truncated: jax.Array
    full_logprobs: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything the compiled program depends on besides array shapes (hashable)."""

    max_new_tokens: int
    num_samples: int
    greedy: bool
    top_k: int
    use_top_p: bool
    pad_token_id: int
    cache_dtype: str
    full_logprobs: bool = False  # also the full-vocabulary τ = 1 log-probs (Generation)


@functools.partial(jax.jit, static_argnames=("graphdef", "static"))
def _rollout(
    graphdef: nnx.GraphDef,
    weights: paged.EngineParams,
    prompt_ids_bp: jax.Array,
    prompt_mask_bp: jax.Array,
    rng: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    stop_ids_s: jax.Array,
    budget_n: jax.Array | None = None,
    seq_id_n: jax.Array | None = None,
    pos0_n: jax.Array | None = None,
    *,
    static: _Static,
) -> Generation:
    """The static engine's program. ``weights``: the paged engine's (``paged.engine_params``:
    the layers sliced and cast once, outside this program, for the prefill and every decode
    step; a program that slices and casts the stacked weights itself holds a cast copy and its
    slices at once, 4.22 GiB of a 1B model's temporaries on XLA:GPU, and XLA:CPU sinks slices
    into the decode loop)."""
    lm: CausalLM = paged.merged_model(graphdef, weights.rest, weights.layers)
    layers = paged.layer_modules(lm, weights.layers)
    b, p = prompt_ids_bp.shape
    g, t = static.num_samples, static.max_new_tokens
    n = b * g

    cache = KVCache.init(lm.config, b, p, static.cache_dtype)
    h_bpd, cache = lm.model(prompt_ids_bp, prompt_mask_bp, cache=cache, layers=layers)
    logits_bv = lm.logits(h_bpd[:, -1])  # left padding: the last column is real for every row
    cache = decode.from_prefill(cache, p + t)
    if g > 1:  # the G samples of a prompt share its prefill
        cache = jax.tree.map(lambda x: jnp.repeat(x, g, axis=0) if x.ndim else x, cache)
        logits_nv = jnp.repeat(logits_bv, g, axis=0)
    else:
        logits_nv = logits_bv
    cache = decode.constrain(cache)
    logits_nv = sharding.constrain(logits_nv, ("batch", "vocab"))

    def key(step: jax.Array | int) -> jax.Array:
        if seq_id_n is None:  # one key per step for the whole batch
            return jax.random.fold_in(rng, step)
        # Per-row keys, the paged engine's: fold_in(fold_in(rng, sequence id), token index).
        return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.fold_in(rng, s), i))(
            seq_id_n, pos0_n + step
        )

    def pick(logits_nv: jax.Array, step: jax.Array | int) -> tuple[jax.Array, jax.Array]:
        return sampling.sample(
            logits_nv,
            key(step),
            temperature=temperature,
            top_k=static.top_k,
            top_p=top_p if static.use_top_p else None,
            greedy=static.greedy,
        )

    def stopped(
        token_n: jax.Array,
    ) -> jax.Array:  # stop ids are padded with -1, which no token equals
        return jnp.any(token_n[:, None] == stop_ids_s[None, :], axis=1)

    token_n, logp_n = pick(logits_nv, 0)
    tokens_tn = jnp.full((t, n), static.pad_token_id, jnp.int32).at[0].set(token_n)
    logp_tn = jnp.zeros((t, n), jnp.float32).at[0].set(logp_n)
    mask_tn = jnp.zeros((t, n), bool).at[0].set(True)
    full_tn = None  # only in the program that returns them (None is an empty pytree)
    if static.full_logprobs:
        full_tn = (
            jnp.zeros((t, n), jnp.float32).at[0].set(sampling.full_logprobs(logits_nv, token_n))
        )
    alive_n = ~stopped(token_n)
    if budget_n is not None:  # per-sample budgets: a row stops after its budget_n tokens
        alive_n = alive_n & (budget_n > 1)

    # (step, token_n, alive_n, cache, tokens_tn, logp_tn, mask_tn, full_tn or None)
    Carry = tuple[
        jax.Array,
        jax.Array,
        jax.Array,
        decode.DecodeCache,
        jax.Array,
        jax.Array,
        jax.Array,
        jax.Array | None,
    ]

    def cond(carry: Carry) -> jax.Array:
        step, _, alive_n, *_ = carry
        return (step < t) & jnp.any(alive_n)

    def body(carry: Carry) -> Carry:
        step, token_n, alive_n, cache, tokens_tn, logp_tn, mask_tn, full_tn = carry
        logits_nv, cache = decode.decode_step(lm, token_n, alive_n, cache, layers)
        new_n, logp_n = pick(logits_nv, step)
        tokens_tn = tokens_tn.at[step].set(jnp.where(alive_n, new_n, static.pad_token_id))
        logp_tn = logp_tn.at[step].set(jnp.where(alive_n, logp_n, 0.0))
        mask_tn = mask_tn.at[step].set(alive_n)
        if full_tn is not None:
            full_n = sampling.full_logprobs(logits_nv, new_n)
            full_tn = full_tn.at[step].set(jnp.where(alive_n, full_n, 0.0))
        alive_n = alive_n & ~stopped(new_n)
        if budget_n is not None:
            alive_n = alive_n & (step + 1 < budget_n)
        return step + 1, new_n, alive_n, cache, tokens_tn, logp_tn, mask_tn, full_tn

    carry = (jnp.int32(1), token_n, alive_n, cache, tokens_tn, logp_tn, mask_tn, full_tn)
    _, _, alive_n, _, tokens_tn, logp_tn, mask_tn, full_tn = jax.lax.while_loop(cond, body, carry)

    def bgt(x_tn: jax.Array) -> jax.Array:
        return x_tn.T.reshape(b, g, t)

    if budget_n is not None:  # alive_n is False at a budget's end too: truncated = no stop id
        hit = mask_tn & jnp.any(tokens_tn[..., None] == stop_ids_s[None, None], axis=-1)
        alive_n = ~jnp.any(hit, axis=0)
    full_bgt = None if full_tn is None else bgt(full_tn)
    return Generation(bgt(tokens_tn), bgt(mask_tn), bgt(logp_tn), alive_n.reshape(b, g), full_bgt)


def _split_model(model: ModelLike) -> tuple[nnx.GraphDef, Params, CausalLM | None]:
    """(graphdef, pure param dict, module or None) from a CausalLM or a (graphdef, params) pair."""
    if isinstance(model, CausalLM):
        graphdef, state = nnx.split(model)
        return graphdef, nnx.to_pure_dict(state), model
    if isinstance(model, tuple) and len(model) == 2:
        graphdef, params = model
        if isinstance(params, nnx.State):
            params = nnx.to_pure_dict(params)
        return graphdef, params, None
    raise TypeError(
        f"generate: model must be a jaxrl_llm CausalLM or a (graphdef, params) pair from "
        f"nnx.split, got {type(model).__name__}"
    )


def _config_of(graphdef: nnx.GraphDef, params: Params, module: CausalLM | None) -> ModelConfig:
    return (module if module is not None else nnx.merge(graphdef, params)).config


def _as_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"generate: {name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"generate: {name} must be >= {minimum}, got {value}")
    return int(value)


def _as_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating | np.integer):
        raise TypeError(f"generate: {name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"generate: {name} must be finite, got {value}")
    return value


def _check_sampling(
    fn: str, rng: object, temperature: object, top_k: object, top_p: object
) -> tuple[jax.Array, float, int, float]:
    """``(rng, temperature, top_k, top_p)`` checked: ``rng`` as one typed PRNG key (key data
    is wrapped), τ >= 0, k >= 0, p in (0, 1]; ``fn`` names the caller in the errors."""
    top_k = _as_int("top_k", top_k, 0)
    temperature = _as_float("temperature", temperature)
    top_p = _as_float("top_p", top_p)
    if temperature < 0:
        raise ValueError(f"{fn}: temperature must be >= 0 (0 is greedy), got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"{fn}: top_p must be in (0, 1], got {top_p}")
    if not isinstance(rng, jax.Array):
        raise TypeError(f"{fn}: rng must be a jax PRNG key, got {type(rng).__name__}")
    if not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        rng = jax.random.wrap_key_data(rng)
    if rng.shape != ():
        raise ValueError(f"{fn}: rng must be a single PRNG key, got shape {rng.shape}")
    return rng, temperature, top_k, top_p


def _pad_id(config: ModelConfig) -> int:
    """The pad id written after a sequence's end: the model's, when it is a valid id; else 0."""
    pad = config.pad_token_id
    return int(pad) if pad is not None and 0 <= pad < config.vocab_size else 0


def _stop_ids(stop_token_ids: int | Sequence[int] | None, config: ModelConfig) -> np.ndarray:
    """int32[S], S a multiple of 8 (padded with -1): few distinct shapes, no recompiles."""
    if stop_token_ids is None:
        eos = config.eos_token_id
        stop_token_ids = () if eos is None else eos
    ids = tuple(int(s) for s in np.atleast_1d(np.asarray(stop_token_ids, np.int64)).tolist())
    for s in ids:
        if not 0 <= s < config.vocab_size:
            raise ValueError(
                f"generate: stop token id {s} is outside the vocabulary [0, {config.vocab_size})"
            )
    ids = sorted(set(ids))
    padded = np.full((max(8, -(-len(ids) // 8) * 8),), -1, np.int32)
    padded[: len(ids)] = ids
    return padded


def _check_prompts(
    prompt_ids_bt: jax.typing.ArrayLike,
    prompt_mask_bt: jax.typing.ArrayLike,
    config: ModelConfig,
    max_new_tokens: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Host-side checks; returns (ids with padding set to 0, mask) as numpy arrays."""
    ids = np.asarray(prompt_ids_bt)
    mask = np.asarray(prompt_mask_bt)
    if ids.ndim != 2:
        raise ValueError(f"generate: prompt_ids_bt must have rank 2 [B, T], got shape {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"generate: prompt_ids_bt must hold integer token ids, got {ids.dtype}")
    if mask.dtype != np.bool_:
        raise TypeError(
            f"generate: prompt_mask_bt must be a boolean mask, got dtype {mask.dtype}; "
            f"convert with `prompt_mask_bt.astype(bool)`"
        )
    if mask.shape != ids.shape:
        raise ValueError(
            f"generate: prompt_mask_bt has shape {mask.shape}, prompt_ids_bt has {ids.shape}"
        )
    if ids.shape[0] == 0:
        raise ValueError("generate: the batch is empty (prompt_ids_bt has B = 0 rows)")
    lengths = mask.sum(axis=1)
    empty = np.flatnonzero(lengths == 0)
    if ids.shape[1] == 0 or empty.size:
        row = int(empty[0]) if empty.size else 0
        raise ValueError(
            f"generate: prompt {row} is empty (no True in prompt_mask_bt); every prompt needs "
            f"at least one token"
        )
    # Left padding: each row is False...False True...True.
    not_left = np.flatnonzero(np.any(mask[:, :-1] & ~mask[:, 1:], axis=1))
    if not_left.size:
        raise ValueError(
            f"generate: prompt {int(not_left[0])} is not left-padded (its mask has a gap or "
            f"trailing padding); pad prompts on the left so they all end in the last column"
        )
    bad = mask & ((ids < 0) | (ids >= config.vocab_size))
    if bad.any():
        row, col = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"generate: token id {int(ids[row, col])} at prompt {row}, position {col} is "
            f"outside the vocabulary [0, {config.vocab_size})"
        )
    longest = int(lengths.max())
    context = config.max_position_embeddings
    if longest + max_new_tokens > context:
        row = int(np.argmax(lengths))
        what = (
            "is longer than"
            if longest > context
            else f"plus max_new_tokens={max_new_tokens} is longer than"
        )
        raise ValueError(
            f"generate: prompt {row} has {longest} tokens, which {what} the model's context "
            f"(max_position_embeddings={context})"
        )
    return np.where(mask, ids, 0).astype(np.int32), mask


def _left_pad_to(ids: np.ndarray, mask: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    extra = width - ids.shape[1]
    if extra <= 0:
        return ids, mask
    return np.pad(ids, ((0, 0), (extra, 0))), np.pad(mask, ((0, 0), (extra, 0)))


def _cache_dtype(cache_dtype: jax.typing.DTypeLike | None, config: ModelConfig) -> jnp.dtype:
    """The KV-cache dtype: as asked; by default the compute dtype, except float32 on CPU.

    XLA:CPU emulates bf16 arithmetic in f32: a bf16 cache there costs a full-cache convert in
    every layer of every decode step (measured: SmolLM2, 32 sequences, ~8 ms of a ~50 ms step)
    and saves memory the CPU rarely lacks. Accelerators keep the compute dtype.
    """
    if cache_dtype is not None:
        return jnp.dtype(cache_dtype)
    if jax.default_backend() == "cpu":
        return jnp.dtype(jnp.promote_types(config.dtype, jnp.float32))
    return jnp.dtype(config.dtype)


def _mesh_of(params: Params) -> jax.sharding.Mesh | None:
    for leaf in jax.tree.leaves(params):
        s = getattr(leaf, "sharding", None)
        if isinstance(s, NamedSharding) and s.mesh.size > 1:
            return s.mesh
    return None


def _rollout_multiprocess(
    graphdef: nnx.GraphDef,
    args: tuple[
        paged.EngineParams, np.ndarray, np.ndarray, jax.Array, np.float32, np.float32, np.ndarray
    ],
    static: _Static,
    mesh: jax.sharding.Mesh | None,
) -> Generation:
    """One process's share of a multi-process rollout: its prompt rows in, its rows out.

    The processes' rows form the global batch (process order) with
    ``jax.make_array_from_process_local_data``; the sampler runs on the global arrays; each
    process reads back the rows its own devices hold (``global_array_to_host_local_array``),
    which are the rows it passed in.
    """
    from jax.experimental import multihost_utils

    weights, ids, mask, *rest = args
    if mesh is None:
        raise ValueError(
            "generate: in a multi-process run the parameters must live on a mesh over every "
            "process's devices (e.g. models.sharding.shard_model)"
        )
    batch_axes = tuple(a for a in sharding.BATCH_AXES if a in mesh.shape)
    local_dp = sharding.data_parallel_size(mesh) // jax.process_count()
    if local_dp < 1 or ids.shape[0] % local_dp:
        raise ValueError(
            f"generate: this process passed {ids.shape[0]} prompts, not a multiple of its "
            f"{max(local_dp, 1)} data-parallel shards (mesh {dict(mesh.shape)} over "
            f"{jax.process_count()} processes); give each process B / processes prompts with "
            "B a multiple of data × fsdp"
        )
    widths = dist.host_allgather(np.int64(ids.shape[1]), what="generate: prompt width").tolist()
    if len(set(widths)) > 1:
        raise ValueError(
            f"generate: processes passed prompts of different (padded) widths {widths} "
            "(process order); pad the global batch once and give each process its rows"
        )
    spec = jax.sharding.PartitionSpec(batch_axes)
    with jax.set_mesh(mesh):
        batch = NamedSharding(mesh, jax.sharding.PartitionSpec(batch_axes, None))
        ids, mask = (jax.make_array_from_process_local_data(batch, x) for x in (ids, mask))
        out = _rollout(graphdef, weights, ids, mask, *rest, static=static)
        return multihost_utils.global_array_to_host_local_array(out, mesh, spec)


def generate(
    model: ModelLike,
    prompt_ids_bt: jax.typing.ArrayLike,
    prompt_mask_bt: jax.typing.ArrayLike,
    *,
    rng: jax.Array,
    max_new_tokens: int,
    num_samples: int = 1,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_token_ids: int | Sequence[int] | None = None,
    cache_dtype: jax.typing.DTypeLike | None = None,
    prompt_bucket: int = 16,
    max_new_tokens_bg: jax.typing.ArrayLike | None = None,
    engine: str = "static",
    paged_options: paged.PagedOptions | None = None,
    return_stats: bool = False,
    return_full_logprobs: bool = False,
) -> Generation | tuple[Generation, paged.PagedStats | None]:
    """Samples ``num_samples`` completions of ``max_new_tokens`` tokens for each prompt.

        y_t ~ π(· | x, y_<t),   π ∝ exp(logits / τ) on the top-k ∩ top-p set,   t < T

    stopping a sequence after its first stop token. See :class:`Generation` for the outputs.

    Args:
      model: a :class:`~jaxrl_llm.models.CausalLM`, or its ``(graphdef, params)`` from
        ``nnx.split`` (params as ``nnx.State`` or a pure dict). Sharded parameters (e.g.
        ``models.sharding.shard_model``) make the whole rollout run on their mesh, the batch
        split over the ``data``/``fsdp`` axes.
      prompt_ids_bt: ``int[B, P]`` token ids, left-padded (see :func:`encode_prompts`).
      prompt_mask_bt: ``bool[B, P]`` True on real tokens; every row needs at least one.
      rng: a PRNG key; the same key gives the same completions (on any mesh). In a
        multi-process run (``jax.process_count() > 1``) every process passes the same key and
        its own rows of the global batch (contiguous, in process order, the same padded
        width), and gets back the completions of those rows; the sampler runs on the global
        batch.
      max_new_tokens: ``T >= 1``, the length of every output.
      num_samples: ``G >= 1`` completions per prompt, sharing the prompt's prefill.
      temperature: τ >= 0; 0 is greedy decoding.
      top_k: keep the k most likely tokens (0: all).
      top_p: keep the smallest set of most likely tokens with mass >= p, in (0, 1] (1: all).
      stop_token_ids: ids that end a sequence; ``None``: the model's EOS id(s) from its config;
        ``()``: never stop early (every sequence runs ``max_new_tokens``).
      cache_dtype: KV-cache dtype (e.g. ``jnp.bfloat16`` to halve its memory); default the
        model's compute dtype, but float32 on CPU (see :func:`_cache_dtype`).
      prompt_bucket: prompt widths are padded on the left to a multiple of this, so similar
        batches reuse one compiled program.
      max_new_tokens_bg: optional ``int[B, G]`` per-sample budgets, each in
        ``[1, max_new_tokens]``: sample ``g`` of prompt ``b`` stops after that many tokens
        (``truncated`` when it got there without a stop id). ``None``: ``max_new_tokens``.
      engine: ``"static"`` (one dense batch, ``P + T`` cache slots per row, this module),
        ``"paged"`` (continuous batching over a paged KV cache, ``paged.py``) or ``"auto"``:
        :func:`choose_engine`, paged unless every row must run exactly ``max_new_tokens`` (no
        stop ids, no per-sample budgets); what the trainer, ``evaluate`` and ``jaxrl-llm
        generate`` use by default (``rollout.engine``). The function's own default stays
        ``"static"``: the engines draw different tokens for the same key, and a caller's
        samples for a key do not change under it. On a mesh
        whose ``data`` × ``fsdp`` size D is > 1 the paged engine is data-parallel
        (``paged_dp.py``): D engines, each with its own scheduler, page pool and allocator,
        one per data shard on that shard's devices (weights tensor-parallel within it), the
        prompts split into D contiguous shards (the first ``B mod D`` one prompt larger),
        host schedulers in threads, the same tokens as one device. Explicit
        ``paged_options`` sizes are per engine. Multi-process: as above, each process passes
        its own rows (any number) and runs the engines of the data shards on its own devices
        (a data shard spanning processes is an error). Greedy tokens agree between engines;
        sampled tokens use different (per-sequence) keys in the paged engine.
      paged_options: sizes of the paged engine (:class:`paged.PagedOptions`).
      return_stats: also return the paged engine's :class:`paged.PagedStats` (``None`` for
        the static engine; data-parallel: :class:`paged_dp.DataParallelStats`, the shards'
        sums, each shard's in ``shards``; multi-process: this process's shards); for
        benchmarks.
      return_full_logprobs: also return ``Generation.full_logprobs``, each token's log-prob
        under the whole vocabulary at temperature 1 (both engines; computed inside the
        compiled programs, which without it are unchanged).

    Returns:
      A :class:`Generation` of ``[B, G, T]`` tokens, mask and log-probs and ``[B, G]`` truncated
      (with ``return_stats``, the pair ``(generation, stats)``).
    """
    memory_maps.relieve(where="rollout.generate")  # XLA:CPU: programs past Linux's limit
    graphdef, params, module = _split_model(model)
    config = _config_of(graphdef, params, module)
    max_new_tokens = _as_int("max_new_tokens", max_new_tokens, 1)
    num_samples = _as_int("num_samples", num_samples, 1)
    prompt_bucket = _as_int("prompt_bucket", prompt_bucket, 1)
    if not isinstance(return_full_logprobs, bool | np.bool_):
        raise TypeError(
            f"generate: return_full_logprobs must be a bool, got {return_full_logprobs!r}"
        )
    rng, temperature, top_k, top_p = _check_sampling("generate", rng, temperature, top_k, top_p)
    ids, mask = _check_prompts(prompt_ids_bt, prompt_mask_bt, config, max_new_tokens)
    width = -(-ids.shape[1] // prompt_bucket) * prompt_bucket
    ids, mask = _left_pad_to(ids, mask, width)
    static = _Static(
        max_new_tokens=max_new_tokens,
        num_samples=num_samples,
        greedy=temperature == 0.0,
        top_k=0 if top_k >= config.vocab_size else top_k,
        use_top_p=top_p < 1.0,
        pad_token_id=_pad_id(config),
        cache_dtype=_cache_dtype(cache_dtype, config).name,
        full_logprobs=bool(return_full_logprobs),
    )
    stop = _stop_ids(stop_token_ids, config)
    budgets_bg = _check_budgets(max_new_tokens_bg, ids.shape[0], num_samples, max_new_tokens)
    engine = choose_engine(engine, can_stop_early=bool((stop >= 0).any()) or budgets_bg is not None)
    mesh = _mesh_of(params)
    # Both engines run on the layers sliced (and cast) once, in one program, before their own.
    weights = paged.engine_params(params, config.jnp_dtype)
    if engine == "paged":
        if budgets_bg is None:
            budgets_bg = np.full((ids.shape[0], num_samples), max_new_tokens, np.int32)
        prompts = [ids[i][mask[i]] for i in range(ids.shape[0])]
        options = paged.resolve_options(
            paged_options,
            num_seqs=ids.shape[0] * num_samples,
            num_samples=num_samples,
            longest_prompt=max(len(p) for p in prompts),
            max_new_tokens=max_new_tokens,
        )
        # One engine, or one per data shard (of t devices each with tensor_parallel).
        run, mesh, weights = paged_dp.engines(graphdef, mesh, weights, options, paged_options)
        arrays, stats = run(
            graphdef,
            mesh,
            weights,
            prompts,
            budgets_bg,
            rng=rng,
            temperature=temperature,
            top_p=top_p,
            greedy=static.greedy,
            top_k=static.top_k,
            stop_ids=stop,
            pad_token_id=static.pad_token_id,
            cache_dtype=jnp.dtype(static.cache_dtype),
            max_new_tokens=max_new_tokens,
            options=options,
            full_logprobs=static.full_logprobs,
        )
        out = Generation(*(jnp.asarray(x) for x in arrays))
        return (out, stats) if return_stats else out
    out = _generate_static(
        graphdef, weights, ids, mask, rng, temperature, top_p, stop, budgets_bg, static, mesh
    )
    return (out, None) if return_stats else out


ENGINES: tuple[str, ...] = ("auto", "paged", "static")
"""The values of ``generate(engine=...)`` and ``rollout.engine``."""


def choose_engine(engine: str, *, can_stop_early: bool) -> str:
    """The engine ``engine`` names, ``"auto"`` resolved: ``"paged"`` when sequences can end
    at different times (stop ids, per-sample budgets), where continuous batching refills the
    slots they free and the dense engine would run every row to the longest; ``"static"``
    when every row runs exactly ``max_new_tokens``, where there is nothing to refill and the
    one dense batch is as fast and holds less (BENCHMARKS.md "Rollout engines": the fixed
    workload, 32 prompts × 64 tokens, paged 1.01x static on CPU since the paged engine slices
    its layer weights once per run, 0.82x before; the quickstart's 24-token rollouts 4.6–4.7 s
    static, 4.7–5.3 s paged, +0.1 GiB peak RSS; long-tail budgets: paged 2.7x static; on an
    H200, 1B-class model, 256 rows × 256 tokens with no stop: static 1.63x paged, measured
    before the paged GPU path stopped copying its layer weights at every step, "Accelerator
    runs").

    Raises:
      ValueError: ``engine`` is not one of :data:`ENGINES`.
    """
    if engine not in ENGINES:
        raise ValueError(f"generate: engine must be one of {ENGINES}, got {engine!r}")
    if engine != "auto":
        return engine
    return "paged" if can_stop_early else "static"


def _check_budgets(
    budgets: jax.typing.ArrayLike | None, b: int, g: int, max_new_tokens: int
) -> np.ndarray | None:
    """int32[B, G] per-sample budgets in [1, max_new_tokens], or None."""
    if budgets is None:
        return None
    arr = np.asarray(budgets)
    if arr.shape != (b, g):
        raise ValueError(
            f"generate: max_new_tokens_bg must have shape [B, G] = {(b, g)}, got {arr.shape}"
        )
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"generate: max_new_tokens_bg must hold integers, got {arr.dtype}")
    bad = np.argwhere((arr < 1) | (arr > max_new_tokens))
    if bad.size:
        i, j = (int(x) for x in bad[0])
        raise ValueError(
            f"generate: max_new_tokens_bg[{i}, {j}] = {int(arr[i, j])} is outside "
            f"[1, max_new_tokens={max_new_tokens}]"
        )
    return arr.astype(np.int32)


def _generate_static(
    graphdef: nnx.GraphDef,
    weights: paged.EngineParams,
    ids: np.ndarray,
    mask: np.ndarray,
    rng: jax.Array,
    temperature: float,
    top_p: float,
    stop: np.ndarray,
    budgets_bg: np.ndarray | None,
    static: _Static,
    mesh: jax.sharding.Mesh | None,
    row_keys: tuple[np.ndarray, np.ndarray] | None = None,
) -> Generation:
    """The static engine's call on ``weights`` (``paged.engine_params``). ``row_keys =
    (seq_id_n, pos0_n)`` (``int32[N]`` each, with ``budgets_bg``; one process) draws token
    ``t`` of row ``n`` with the paged engine's key ``fold_in(fold_in(rng, seq_id_n[n]),
    pos0_n[n] + t)`` instead of the batch's ``fold_in(rng, t)`` (partial rollouts,
    ``partial.py``)."""
    args = (weights, ids, mask, rng, np.float32(temperature or 1.0), np.float32(top_p), stop)
    if budgets_bg is not None:
        if jax.process_count() > 1:
            raise NotImplementedError(
                "generate: max_new_tokens_bg is not supported in a multi-process run yet"
            )
        args = (*args, budgets_bg.reshape(-1))
    if row_keys is not None:
        if budgets_bg is None or jax.process_count() > 1:
            raise NotImplementedError("generate: per-row keys need budgets and one process")
        args = (*args, *(np.asarray(x, np.int32) for x in row_keys))
    if jax.process_count() > 1:
        return _rollout_multiprocess(graphdef, args, static, mesh)
    if mesh is None or not jax.sharding.get_abstract_mesh().empty:
        return _rollout(graphdef, *args, static=static)
    with jax.set_mesh(mesh):
        batch = sharding.batch_sharding(mesh, 2)
        if ids.shape[0] % sharding.data_parallel_size(mesh) == 0:
            ids, mask = jax.device_put((ids, mask), batch)
        return _rollout(graphdef, weights, ids, mask, *args[3:], static=static)
