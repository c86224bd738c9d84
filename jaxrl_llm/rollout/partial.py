"""Partial rollouts: a batch generated in segments that continue under new weights.

An asynchronous RL loop (``train.max_staleness``) may update the policy while a long completion
is still being sampled. Partial rollouts let that completion continue under the newest weights
instead of finishing under stale ones or being thrown away: the rollout of a batch proceeds in
*segments* of at most ``segment_tokens`` new tokens per sample, the weights may change between
segments, and every token is tagged with the policy version that sampled it. This is AReaL's
interruptible generation (Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement
Learning System for Language Reasoning", §4) and PipelineRL's in-flight weight updates (Piché et
al. 2025, "PipelineRL").

    state = partial.start(B, G, T)                       # nothing sampled yet
    state = partial.advance(model_v0, ids, mask, state, rng=key, version=0, segment_tokens=64)
    state = partial.advance(model_v1, ids, mask, state, rng=key, version=1, segment_tokens=64)
    ...                                                   # until state.done_bg.all()
    out = partial.finish(state)                           # tokens, mask, logprobs, truncated,
                                                          # version  ([B, G, T] / [B, G])

The :class:`InFlight` state is plain host numpy (checkpointable as is). Each token's log-prob is
the sampler's, under the version that drew it, so ``logp_bgt`` is π_behaviour of the decoupled
PPO loss (Hilton et al. 2021) token by token even when a completion spans versions.

**Context re-prefilled.** A continuing sample's context is its prompt followed by its tokens so
far, prefilled again under the current weights; the KV cache of the previous weights is not
kept or reused (AReaL's choice: the continuation is then exactly what the new policy computes
for that prefix, and no KV cache outlives a segment). The cost is one prefill of
``P_b + n_bg`` tokens per continuing sample per segment, less the prompt's whole pages, which
with ``PagedOptions.prefix_sharing`` (the default) a prompt's continuing samples seated
together share: they are prefilled once per segment.

**Randomness independent of segmentation.** Token ``t`` of sample ``g`` of prompt ``b`` is
drawn with the key ``fold_in(fold_in(rng, b·G + g), t)`` whatever the segmentation: the paged
engine's keys, continued at the sample's token offset (``paged.run(seq_ids_bg=,
token_offsets_bg=)``). So with the same weights in every segment a segmented rollout samples
the tokens of one ``generate(engine="paged")`` call with the same ``rng`` (tested for segment
sizes 1, 3 and >= T; log-probs agree to float rounding, since a continuing token's logits come
from a prefill instead of a decode step). Pass the same ``rng`` to every ``advance`` of a batch
(checked). ``engine="static"`` draws with the same per-row keys (``engine._generate_static(
row_keys=)``; ``generate(engine="static")`` itself keeps its per-step batch key
``fold_in(rng, t)``), so both engines sample the same tokens here (tested).

**Work and compiled programs.** Done samples are not run at all. The first segment runs
``generate``'s layout (each prompt prefilled once for its G samples); later segments run each
continuing sample as its own sequence (``G = 1``, context ``P_b + n_bg`` tokens). Every shape
depends only on ``(B, G, T)`` and the prompts' padded width ``P``, never on how far the
samples got:

- paged: the pool has ``1 + S·⌈(P + T)/page⌉`` pages (``S = max(min(next_pow2(B·G), 64),
  next_pow2(G))`` slots unless ``paged_options`` says otherwise, B the engine's share of the
  prompts with data-parallel engines, the same in every segment; on a GPU or TPU, what
  ``paged_options.memory_utilization`` of the devices' memory leaves, fitted once for the
  whole rollout, at most ``min(S, B·G)`` worst cases); prefill chunks of 1, 2, 4 or 8
  rows and a power-of-two width in ``[16, prefill_chunk]``, with ``G`` or 1 samples per row;
  decode dispatches of a power-of-two number of rows in ``[min(8, S), S]``; page tables a
  multiple of 128 tokens wide, at most ``w = ⌈(P + T)/128⌉`` widths. At most
  ``2·4·c·w + d·w`` programs per batch shape, ``c = log2(prefill_chunk/16) + 1``,
  ``d = log2(S/8) + 1`` (1 when ``S <= 8``); ``segment_tokens`` changes no shape.
- static: one program for the first segment (``[B, P]``, G samples), then one per (row bucket,
  context width): rows a power of two below ``B·G``, or ``B·G`` (filler rows sample one token),
  widths multiples of 128 up to ``P + T``; ``segment_tokens`` is a static size (keep it fixed).
  At most ``1 + (⌈log2(B·G)⌉ + 1)·(w + 1)`` programs per batch shape.

In practice a segment loop reaches a handful of them, and a second batch of the same shapes
compiles none (tested with a compile counter: other prompts, other key, other weights). New
weights of the same structure never recompile.

**Several processes** (``jax.process_count() > 1``, paged engine only). Unlike ``generate``,
whose processes each pass their own rows, every process passes the *whole* batch: the same
prompts, :class:`InFlight`, ``rng``, ``version`` and ``segment_tokens`` (compared by crc32
over the coordination service at every :func:`advance`: a difference is a ``ValueError`` on
every process, not a hang). Each segment's rows (the prompts in the first segment, the
unfinished samples after it) are cut into contiguous shares, one per process
(``paged_dp.split_rows``); each process samples its share on the data-parallel engines of
its own devices with the samples' global sequence ids, so the tokens are those of one process;
the segment's outputs are then gathered over the weights' mesh, and every process holds the
same :class:`InFlight` again. A process whose share is empty (fewer unfinished samples than
processes) still takes part in the weights' reshard and the gathers. So the samples left
after the first segment are spread evenly over the processes whatever prompts they came from,
the loop's end (``done_bg.all()``) is the same decision everywhere, and the state is what a
checkpoint saves as is.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_llm import distributed as dist
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.rollout import engine as eng
from jaxrl_llm.rollout import paged, paged_dp


class InFlight(NamedTuple):
    """The state of a batch's partial rollout: host numpy arrays (checkpointable as is).

    Attributes:
      tokens_bgt: ``int32[B, G, T]`` tokens so far (the pad id where ``mask_bgt`` is False).
      mask_bgt: ``bool[B, G, T]`` True on sampled tokens (a prefix of each row).
      logp_bgt: ``float32[B, G, T]`` the sampler's log-prob of each token under the version that
        sampled it (as :class:`~jaxrl_llm.rollout.engine.Generation.logprobs`); 0 elsewhere.
      version_bgt: ``int32[B, G, T]`` the policy version that sampled each token; -1 where none.
      done_bg: ``bool[B, G]`` the sample stopped (a stop id, or its budget reached).
      truncated_bg: ``bool[B, G]`` done by its budget without a stop id.
      num_new_bg: ``int32[B, G]`` tokens sampled so far.
      budget_bg: ``int32[B, G]`` each sample's budget (``max_new_tokens_bg``, or T).
      last_version: the version of the latest :func:`advance` (-1 before the first).
      segments: how many :func:`advance` calls computed something.
      rng_key_data: ``uint32[...]`` the key data of the batch's ``rng`` (empty before the first
        :func:`advance`): every segment must use the same key.
      full_logp_bgt: ``float32[B, G, T]`` each token's full-vocabulary log-prob at temperature 1
        under the version that sampled it (``Generation.full_logprobs``), 0 elsewhere; ``None``
        unless :func:`start` was asked for them (``full_logprobs=True``).
    """

    tokens_bgt: np.ndarray
    mask_bgt: np.ndarray
    logp_bgt: np.ndarray
    version_bgt: np.ndarray
    done_bg: np.ndarray
    truncated_bg: np.ndarray
    num_new_bg: np.ndarray
    budget_bg: np.ndarray
    last_version: int = -1
    segments: int = 0
    rng_key_data: np.ndarray = np.zeros((0,), np.uint32)
    full_logp_bgt: np.ndarray | None = None


class PartialGeneration(NamedTuple):
    """:class:`~jaxrl_llm.rollout.engine.Generation`'s fields plus each token's version.

    Attributes:
      tokens, mask, logprobs: ``[B, G, T]`` as in ``Generation`` (the pad id, False, 0 after a
        sequence's end).
      truncated: ``bool[B, G]`` the sample hit its budget without a stop id.
      version: ``int32[B, G, T]`` the policy version that sampled each token; -1 where ``mask``
        is False.
      full_logprobs: ``float32[B, G, T]`` as ``Generation.full_logprobs`` (each under the
        version that sampled the token), or ``None`` unless asked for.
    """

    tokens: jax.Array
    mask: jax.Array
    logprobs: jax.Array
    truncated: jax.Array
    version: jax.Array
    full_logprobs: jax.Array | None = None


def _int(fn: str, name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"partial.{fn}: {name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"partial.{fn}: {name} must be >= {minimum}, got {value}")
    return int(value)


def start(
    num_prompts: int,
    num_samples: int,
    max_new_tokens: int,
    max_new_tokens_bg: jax.typing.ArrayLike | None = None,
    *,
    full_logprobs: bool = False,
) -> InFlight:
    """An empty :class:`InFlight` for ``num_prompts × num_samples`` samples of at most
    ``max_new_tokens`` tokens (``max_new_tokens_bg``: per-sample budgets ``int[B, G]`` in
    ``[1, max_new_tokens]``, as in :func:`~jaxrl_llm.rollout.engine.generate`).
    ``full_logprobs``: every segment also records the full-vocabulary τ = 1 log-probs
    (``InFlight.full_logp_bgt``, returned by :func:`finish`)."""
    b = _int("start", "num_prompts", num_prompts, 1)
    g = _int("start", "num_samples", num_samples, 1)
    t = _int("start", "max_new_tokens", max_new_tokens, 1)
    try:
        budget_bg = eng._check_budgets(max_new_tokens_bg, b, g, t)
    except (ValueError, TypeError) as e:
        raise type(e)(str(e).replace("generate:", "partial.start:", 1)) from None
    if budget_bg is None:
        budget_bg = np.full((b, g), t, np.int32)
    return InFlight(
        tokens_bgt=np.zeros((b, g, t), np.int32),
        mask_bgt=np.zeros((b, g, t), bool),
        logp_bgt=np.zeros((b, g, t), np.float32),
        version_bgt=np.full((b, g, t), -1, np.int32),
        done_bg=np.zeros((b, g), bool),
        truncated_bg=np.zeros((b, g), bool),
        num_new_bg=np.zeros((b, g), np.int32),
        budget_bg=budget_bg,
        rng_key_data=np.zeros((0,), np.uint32),
        full_logp_bgt=np.zeros((b, g, t), np.float32) if full_logprobs else None,
    )


def _check_inflight(inflight: object) -> InFlight:
    if not isinstance(inflight, InFlight):
        raise TypeError(
            f"partial.advance: inflight must be a partial.InFlight (from partial.start), got "
            f"{type(inflight).__name__}"
        )
    b, g, t = inflight.tokens_bgt.shape
    for name in ("mask_bgt", "logp_bgt", "version_bgt", "full_logp_bgt"):
        if name == "full_logp_bgt" and inflight.full_logp_bgt is None:
            continue
        if getattr(inflight, name).shape != (b, g, t):
            raise ValueError(
                f"partial.advance: inflight.{name} has shape {getattr(inflight, name).shape}, "
                f"tokens_bgt has {(b, g, t)}"
            )
    for name in ("done_bg", "truncated_bg", "num_new_bg", "budget_bg"):
        if getattr(inflight, name).shape != (b, g):
            raise ValueError(
                f"partial.advance: inflight.{name} has shape {getattr(inflight, name).shape}, "
                f"expected [B, G] = {(b, g)}"
            )
    return inflight


class _Sampler(NamedTuple):
    """The sampling settings of a segment, checked and resolved."""

    rng: jax.Array
    temperature: float
    top_p: float
    greedy: bool
    top_k: int
    stop_ids: np.ndarray
    pad_token_id: int
    cache_dtype: jnp.dtype
    full_logprobs: bool = False


class _Rows(NamedTuple):
    """What a segment samples: R contexts (unpadded), each with ``k`` samples (G in the first
    segment, else 1), their ``int32[R, k]`` budgets, sequence ids and token offsets."""

    contexts: list[np.ndarray]
    budgets: np.ndarray
    seq_ids: np.ndarray
    offsets: np.ndarray


Segment = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]
"""``(tokens int32[M, S], valid bool[M, S], logp f32[M, S], truncated bool[M], full f32[M, S]
or None)``, M = R·k."""


def _rows_of(
    seg: int,
    tok: np.ndarray,
    valid: np.ndarray,
    logp: np.ndarray,
    trunc: np.ndarray,
    full: np.ndarray | None = None,
) -> Segment:
    """A segment's outputs ``[R, k, S]`` / ``[R, k]`` as ``[M, S]`` / ``[M]`` (Segment)."""
    full = None if full is None else np.asarray(full).reshape(-1, seg)
    return (
        tok.reshape(-1, seg),
        valid.reshape(-1, seg),
        logp.reshape(-1, seg),
        trunc.reshape(-1),
        full,
    )


def _paged_segment(
    graphdef: nnx.GraphDef,
    params: eng.Params,
    config: ModelConfig,
    rows: _Rows,
    seg: int,
    sizes: tuple[int, int, int, int],
    sampler: _Sampler,
    paged_options: paged.PagedOptions | None,
    stats: list | None = None,
) -> Segment:
    """One segment on the paged engine; its pool shape from ``sizes = (B, G, T, P)`` only,
    not from its own contexts: by default for ``min(num_slots, 64)`` of the whole rollout's
    worst cases, on a GPU or TPU what ``PagedOptions.memory_utilization`` of the devices'
    memory leaves, fitted once for the whole rollout (``paged.run``'s ``whole_rollout``),
    so every segment shares the pool."""
    b, g, t, p = sizes
    paged_options = paged_options or paged.PagedOptions()
    options = paged.resolve_options(
        paged_options, num_seqs=b * g, num_samples=g, longest_prompt=p, max_new_tokens=t
    )
    mesh, weights = eng._mesh_of(params), paged.engine_params(params, config.jnp_dtype)
    # As generate runs them: one engine, or one per data shard of the mesh (of t devices each
    # with tensor_parallel), each sized for its share of the whole rollout.
    run, mesh, weights = paged_dp.engines(graphdef, mesh, weights, options, paged_options)
    arrays, run_stats = run(
        graphdef,
        mesh,
        weights,
        rows.contexts,
        rows.budgets,
        rng=sampler.rng,
        temperature=sampler.temperature,
        top_p=sampler.top_p,
        greedy=sampler.greedy,
        top_k=sampler.top_k,
        stop_ids=sampler.stop_ids,
        pad_token_id=sampler.pad_token_id,
        cache_dtype=sampler.cache_dtype,
        max_new_tokens=seg,
        options=options,
        seq_ids_bg=rows.seq_ids,
        token_offsets_bg=rows.offsets,
        full_logprobs=sampler.full_logprobs,
        whole_rollout=(b, g, p, t),
    )
    if stats is not None:
        stats.append(run_stats)
    return _rows_of(seg, *arrays)


_STATIC_WIDTH = 128
"""The static engine's context widths are multiples of this (capped at ``P + T``)."""


def _static_segment(
    graphdef: nnx.GraphDef,
    params: eng.Params,
    config: ModelConfig,
    rows: _Rows,
    seg: int,
    sizes: tuple[int, int, int, int],
    sampler: _Sampler,
    paged_options: paged.PagedOptions | None,
    stats: list | None = None,
) -> Segment:
    """One segment on the static engine with per-row keys: the R contexts left-padded to a
    width bucket, in a row bucket (a power of two, at most B·G; filler rows sample 1 token)."""
    del paged_options, stats  # the static engine has no pool
    b, g, t, p = sizes
    r, k = rows.budgets.shape
    cap = -(-(p + t) // 16) * 16
    longest = max(len(c) for c in rows.contexts)
    width = min(-(-longest // _STATIC_WIDTH) * _STATIC_WIDTH, cap)
    bucket = r if k > 1 else min(paged._next_pow2(r), b * g)
    ids = np.zeros((bucket, width), np.int32)
    mask = np.zeros((bucket, width), bool)
    mask[r:, -1] = True  # filler rows: one token (id 0), budget 1
    for i, c in enumerate(rows.contexts):
        ids[i, width - len(c) :] = c
        mask[i, width - len(c) :] = True

    def filled(x_rk: np.ndarray, value: int) -> np.ndarray:
        return np.concatenate([x_rk, np.full((bucket - r, k), value, np.int32)])

    static = eng._Static(
        max_new_tokens=seg,
        num_samples=k,
        greedy=sampler.greedy,
        top_k=sampler.top_k,
        use_top_p=sampler.top_p < 1.0,
        pad_token_id=sampler.pad_token_id,
        cache_dtype=jnp.dtype(sampler.cache_dtype).name,
        full_logprobs=sampler.full_logprobs,
    )
    out = eng._generate_static(
        graphdef,
        paged.engine_params(params, config.jnp_dtype),
        ids,
        mask,
        sampler.rng,
        sampler.temperature,
        sampler.top_p,
        sampler.stop_ids,
        filled(rows.budgets, 1),
        static,
        eng._mesh_of(params),
        row_keys=(filled(rows.seq_ids, 0).reshape(-1), filled(rows.offsets, 0).reshape(-1)),
    )
    return _rows_of(seg, *(None if x is None else np.asarray(x)[:r] for x in out))


def _take(rows: _Rows, part: slice) -> _Rows:
    return _Rows(rows.contexts[part], rows.budgets[part], rows.seq_ids[part], rows.offsets[part])


def _everyones(mine: Segment, counts: list[int], mesh: jax.sharding.Mesh | None) -> Segment:
    """Every process's segment rows in process order (``counts[p]`` rows from process ``p``),
    gathered over the devices of the weights' ``mesh`` (each process's rows padded to the
    most); one process: its own."""
    if len(counts) == 1:
        return mine
    most = max(counts)
    padded = jax.tree.map(
        lambda x: np.concatenate([x, np.zeros((most - len(x), *x.shape[1:]), x.dtype)]), mine
    )
    every = dist.gather(padded, mesh)
    return jax.tree.map(
        lambda x: np.concatenate([x[p * most : p * most + n] for p, n in enumerate(counts)]),
        every,
    )


def _check_same_everywhere(**groups: tuple[np.ndarray, ...]) -> None:
    """Several processes: each group of host arrays is the same on every process (compared by
    crc32 over the coordination service), else a ValueError naming the groups that differ,
    raised on every process alike."""
    names = list(groups)

    def crc(group: tuple[np.ndarray, ...]) -> int:
        value = 0
        for x in group:  # over the arrays' buffers, no copy: ~16 ms per 64 MiB on one core
            value = zlib.crc32(np.ascontiguousarray(x), value)
        return value

    digest = np.asarray([crc(group) for group in groups.values()], np.uint32)
    every = dist.host_allgather(digest, what="partial.advance: inputs")
    differ = [n for i, n in enumerate(names) if (every[:, i] != digest[i]).any()]
    if differ:
        raise ValueError(
            f"partial.advance: the processes passed different {', '.join(differ)}; in a "
            "multi-process run every process passes the whole batch (the same prompts, "
            "in-flight state, rng, version and segment_tokens) and samples its share of it"
        )


def advance(
    model: eng.ModelLike,
    prompt_ids_bp: jax.typing.ArrayLike,
    prompt_mask_bp: jax.typing.ArrayLike,
    inflight: InFlight,
    *,
    rng: jax.Array,
    version: int,
    segment_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_token_ids: int | Sequence[int] | None = None,
    cache_dtype: jax.typing.DTypeLike | None = None,
    engine: str = "paged",
    paged_options: paged.PagedOptions | None = None,
    stats: list | None = None,
) -> InFlight:
    """Continues every sample not yet done by at most ``segment_tokens`` tokens under ``model``.

        y_t ~ π_version(· | x_b, y_<t),   n_bg <= t < min(n_bg + segment_tokens, budget_bg)

    stopping a sample after a stop id. The context of sample ``(b, g)`` is its prompt followed
    by its ``n_bg`` tokens so far, *re-prefilled under the current weights*: the KV cache of the
    weights that sampled the earlier tokens is not reused (AReaL). Samples already done are not
    run at all. The new tokens are tagged ``version``; token ``t`` of sample ``(b, g)`` uses
    the key ``fold_in(fold_in(rng, b·G + g), t)``, so the segmentation does not change what is
    sampled (module docstring).

    Args:
      model: a :class:`~jaxrl_llm.models.CausalLM` or its ``(graphdef, params)``, as
        :func:`~jaxrl_llm.rollout.engine.generate` takes; the same graph in every segment of a
        batch (else each segment compiles its own programs).
      prompt_ids_bp, prompt_mask_bp: the batch's ``[B, P]`` left-padded prompts (the same in every
        segment), B as in :func:`start`.
      inflight: the batch's state (:func:`start`, or the previous ``advance``); not modified.
      rng: the batch's PRNG key, the same in every segment.
      version: the policy version of ``model``; never below the previous segment's.
      segment_tokens: at most this many new tokens per sample in this call, >= 1.
      temperature, top_k, top_p, stop_token_ids, cache_dtype: as in ``generate`` (keep them
        fixed within a batch).
      engine: ``"paged"`` or ``"static"``: either samples the same tokens (same per-row keys;
        module docstring); the static engine runs one process only. With several processes,
        every process passes the whole batch and gets it back (module docstring).
      paged_options: the paged engine's sizes; ``num_slots`` and ``num_pages`` default from
        ``(B, G, T, P)`` only (and the devices' memory, ``memory_utilization``), so every
        segment of a batch shares one pool shape.
      stats: a list to which the paged engine's :class:`~jaxrl_llm.rollout.paged.PagedStats`
        of this segment is appended (nothing for the static engine, or when every sample was
        done).

    Returns:
      The new :class:`InFlight` (fresh arrays).
    """
    inflight = _check_inflight(inflight)
    b, g, t = inflight.tokens_bgt.shape
    segment_tokens = _int("advance", "segment_tokens", segment_tokens, 1)
    version = _int("advance", "version", version, 0)
    if version < inflight.last_version:
        raise ValueError(
            f"partial.advance: version {version} goes backwards: this batch's previous segment "
            f"was sampled by version {inflight.last_version}; versions must not decrease"
        )
    if engine not in ("paged", "static"):
        raise ValueError(f"partial.advance: engine must be 'paged' or 'static', got {engine!r}")
    if engine == "static" and jax.process_count() > 1:
        raise ValueError(
            f"partial.advance: engine='static' runs in one process ({jax.process_count()} "
            "processes here); use engine='paged'"
        )
    graphdef, params, module = eng._split_model(model)
    config = eng._config_of(graphdef, params, module)
    ids_bp, mask_bp = eng._check_prompts(prompt_ids_bp, prompt_mask_bp, config, t)
    if ids_bp.shape[0] != b:
        raise ValueError(
            f"partial.advance: prompt_ids_bp has {ids_bp.shape[0]} prompts, but this in-flight "
            f"batch has B = {b} (partial.start(num_prompts={b}, ...))"
        )
    rng, temperature, top_k, top_p = eng._check_sampling(
        "partial.advance", rng, temperature, top_k, top_p
    )
    key_data = np.asarray(jax.random.key_data(rng), np.uint32).reshape(-1)
    if inflight.rng_key_data.size and not np.array_equal(key_data, inflight.rng_key_data):
        raise ValueError(
            "partial.advance: rng differs from the key of this batch's earlier segments; pass "
            "the same key to every advance of a batch (its tokens' keys fold in the token index)"
        )

    if jax.process_count() > 1:
        _check_same_everywhere(
            prompts=(ids_bp, mask_bp),
            inflight=(inflight.tokens_bgt, inflight.num_new_bg, inflight.done_bg),
            budgets=(inflight.budget_bg,),
            rng=(key_data,),
            version=(np.int64(version), np.int64(segment_tokens)),
        )
    active = np.argwhere(~inflight.done_bg)  # [M, 2] (b, g), row-major
    out = inflight._replace(last_version=version, rng_key_data=key_data)
    if not active.size:
        return out
    sampler = _Sampler(
        rng=rng,
        temperature=temperature,
        top_p=top_p,
        greedy=temperature == 0.0,
        top_k=0 if top_k >= config.vocab_size else top_k,
        stop_ids=eng._stop_ids(stop_token_ids, config),
        pad_token_id=eng._pad_id(config),
        cache_dtype=eng._cache_dtype(cache_dtype, config),
        full_logprobs=inflight.full_logp_bgt is not None,
    )
    n_m = inflight.num_new_bg[active[:, 0], active[:, 1]].astype(np.int64)
    seg = min(segment_tokens, t)
    prompts_b = [ids_bp[i][mask_bp[i]].astype(np.int32) for i in range(b)]
    if not inflight.num_new_bg.any():
        # First segment: every sample starts from its prompt (and none is done, budgets being
        # >= 1), so the G samples of a prompt share its prefill, as in one generate call.
        run = _Rows(
            contexts=prompts_b,
            budgets=np.minimum(inflight.budget_bg, seg).astype(np.int32),
            seq_ids=np.arange(b * g, dtype=np.int32).reshape(b, g),
            offsets=np.zeros((b, g), np.int32),
        )
    else:
        left_m = inflight.budget_bg[active[:, 0], active[:, 1]] - n_m
        run = _Rows(
            contexts=[
                np.concatenate([prompts_b[bi], inflight.tokens_bgt[bi, gi, :n]])
                for (bi, gi), n in zip(active, n_m, strict=True)
            ],
            budgets=np.minimum(left_m, seg).astype(np.int32)[:, None],
            seq_ids=(active[:, 0] * g + active[:, 1]).astype(np.int32)[:, None],
            offsets=n_m.astype(np.int32)[:, None],
        )
    sizes = (b, g, t, ids_bp.shape[1])
    segment = _paged_segment if engine == "paged" else _static_segment
    # Several processes: each samples its share of the rows, then every process gets them all.
    parts = paged_dp.split_rows(len(run.contexts), jax.process_count())
    mine = _take(run, parts[jax.process_index()])
    tok_ms, valid_ms, logp_ms, trunc_m, full_ms = _everyones(
        segment(graphdef, params, config, mine, seg, sizes, sampler, paged_options, stats),
        [(part.stop - part.start) * run.budgets.shape[1] for part in parts],
        eng._mesh_of(params),
    )
    full = None if full_ms is None else inflight.full_logp_bgt.copy()
    tokens, mask, logp, version_bgt = (
        inflight.tokens_bgt.copy(),
        inflight.mask_bgt.copy(),
        inflight.logp_bgt.copy(),
        inflight.version_bgt.copy(),
    )
    num_new, done, truncated = (
        inflight.num_new_bg.copy(),
        inflight.done_bg.copy(),
        inflight.truncated_bg.copy(),
    )
    for m, ((bi, gi), n) in enumerate(zip(active, n_m, strict=True)):
        k = int(valid_ms[m].sum())
        tokens[bi, gi, n : n + k] = tok_ms[m, :k]
        mask[bi, gi, n : n + k] = True
        logp[bi, gi, n : n + k] = logp_ms[m, :k]
        if full is not None:
            full[bi, gi, n : n + k] = full_ms[m, :k]
        version_bgt[bi, gi, n : n + k] = version
        num_new[bi, gi] = n + k
        stopped = not bool(trunc_m[m])  # the segment ended in a stop id
        done[bi, gi] = stopped or n + k >= inflight.budget_bg[bi, gi]
        truncated[bi, gi] = done[bi, gi] and not stopped
    tokens = np.where(mask, tokens, sampler.pad_token_id).astype(np.int32)
    return out._replace(
        tokens_bgt=tokens,
        mask_bgt=mask,
        logp_bgt=logp,
        version_bgt=version_bgt,
        done_bg=done,
        truncated_bg=truncated,
        num_new_bg=num_new,
        segments=inflight.segments + 1,
        full_logp_bgt=full,
    )


def finish(inflight: InFlight, *, allow_unfinished: bool = False) -> PartialGeneration:
    """The batch's completions as :class:`PartialGeneration` (``Generation``'s fields + version).

    Every sample must be done (``inflight.done_bg.all()``) unless ``allow_unfinished``: then an
    unfinished sample is returned as it stands, ``truncated`` True.
    """
    if not isinstance(inflight, InFlight):
        raise TypeError(
            f"partial.finish: expected a partial.InFlight, got {type(inflight).__name__}"
        )
    open_bg = ~inflight.done_bg
    full = inflight.full_logp_bgt
    if open_bg.any() and not allow_unfinished:
        b, g = (int(i) for i in np.argwhere(open_bg)[0])
        raise ValueError(
            f"partial.finish: {int(open_bg.sum())} samples are not done (the first: prompt {b}, "
            f"sample {g}, {int(inflight.num_new_bg[b, g])} of {int(inflight.budget_bg[b, g])} "
            f"tokens); advance further, or pass allow_unfinished=True"
        )
    return PartialGeneration(
        tokens=jnp.asarray(inflight.tokens_bgt),
        mask=jnp.asarray(inflight.mask_bgt),
        logprobs=jnp.asarray(inflight.logp_bgt),
        truncated=jnp.asarray(inflight.truncated_bg | open_bg),
        version=jnp.asarray(inflight.version_bgt),
        full_logprobs=None if full is None else jnp.asarray(full),
    )


def generate_partial(
    weights: Sequence[eng.ModelLike] | Callable[[int], tuple[eng.ModelLike, int]],
    prompt_ids_bp: jax.typing.ArrayLike,
    prompt_mask_bp: jax.typing.ArrayLike,
    *,
    rng: jax.Array,
    max_new_tokens: int,
    segment_tokens: int,
    num_samples: int = 1,
    versions: Sequence[int] | None = None,
    max_new_tokens_bg: jax.typing.ArrayLike | None = None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_token_ids: int | Sequence[int] | None = None,
    cache_dtype: jax.typing.DTypeLike | None = None,
    engine: str = "paged",
    paged_options: paged.PagedOptions | None = None,
    return_full_logprobs: bool = False,
) -> PartialGeneration:
    """:func:`start`, then :func:`advance` segment by segment until every sample is done.

    ``weights`` is either a sequence of models, segment ``i`` sampled by ``weights[i]`` with
    version ``versions[i]`` (default ``i``; the last model and version serve any later
    segments), or a callable ``i -> (model, version)``. At most ``⌈T / segment_tokens⌉``
    segments run. ``return_full_logprobs``: also the full-vocabulary τ = 1 log-probs
    (``PartialGeneration.full_logprobs``). Other arguments as in :func:`advance` and
    ``generate``; with several processes, every process passes the whole batch and gets the
    whole of it back (module docstring).
    """
    b = np.asarray(prompt_ids_bp).shape[0] if np.ndim(prompt_ids_bp) else 0
    state = start(
        b, num_samples, max_new_tokens, max_new_tokens_bg, full_logprobs=return_full_logprobs
    )
    if callable(weights):
        pick = weights
    else:
        weights = list(weights)
        if not weights:
            raise ValueError("generate_partial: weights is empty; give at least one model")
        vs = list(range(len(weights))) if versions is None else [int(v) for v in versions]
        if len(vs) != len(weights):
            raise ValueError(
                f"generate_partial: {len(vs)} versions for {len(weights)} models; give one each"
            )

        def pick(i: int) -> tuple[eng.ModelLike, int]:
            j = min(i, len(weights) - 1)
            return weights[j], vs[j]

    segment = 0
    while not state.done_bg.all():
        model, version = pick(segment)
        state = advance(
            model,
            prompt_ids_bp,
            prompt_mask_bp,
            state,
            rng=rng,
            version=version,
            segment_tokens=segment_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            stop_token_ids=stop_token_ids,
            cache_dtype=cache_dtype,
            engine=engine,
            paged_options=paged_options,
        )
        segment += 1
    return finish(state)


__all__ = ["InFlight", "PartialGeneration", "advance", "finish", "generate_partial", "start"]
