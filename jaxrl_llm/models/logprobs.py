"""Per-token log-probs of given tokens straight from the model, never holding ``[B, T, V]``.

For tokens ``y`` and final hidden states ``h`` (causal LM with head ``W: [V, D]``):

    log π(y_t | y_<t) = z_t[y_t] − logsumexp(z_t),   z_t = W h_{t−1} / τ,   t = start … T−1

``jaxrl_llm.core.logprobs`` computes this from logits, which the caller must first materialise:
``[B, T, V]`` float32 is 1.6 GB for B=8, T=1024, V=49152 and dominates an RL step's memory. Here
the hidden states are split into time chunks of ``chunk_size`` and each chunk's logits are
formed, reduced by ``core.logprobs`` and dropped inside a ``lax.scan`` whose body is
rematerialised (``jax.checkpoint``): forward and backward hold one ``[B, chunk, V]`` block at a
time, and only ``[B, T, D]`` hidden states are kept for the backward pass. See
``scripts/bench_logprob_memory.py`` for measured peaks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.core import logprobs as core_logprobs
from jaxrl_llm.models import attention, grad_accumulation
from jaxrl_llm.models.transformer import CausalLM

MAX_CHUNK_ROWS = 256
"""Upper bound on ``B * chunk`` on CPU: a chunk's ``[B, chunk, V]`` logits (and their softmax
in the backward pass) stay near 50 MB for V = 49152 in f32 however large the batch is. (At 1024
rows three such blocks, 0.56 GiB, were live at once in the SmolLM2 GRPO update; 256 rows cut
its scratch by 0.3 GiB at the same speed; fewer rows save nothing more there.)"""

ACCELERATOR_BLOCK_BYTES = 512 * 2**20
"""The float32 logits one block holds on a GPU or TPU. Every block pays a fixed cost besides
its GEMM: in the backward pass it adds its ``[V, D]`` head gradient into the float32
accumulator (on an H200, 0.6 ms for a 1B model's 128,256 × 2,048 head). At CPU-sized blocks of
256 rows a 1B GRPO update ran 72 of them, ~7% of the step (BENCHMARKS.md, "Accelerator runs");
at 512 MiB (1,024 rows of that vocabulary) it runs 18."""


def block_rows(vocab_size: int, *, accelerator: bool) -> int:
    """The default most rows of logits in one block: :data:`MAX_CHUNK_ROWS` on CPU; on an
    accelerator as many multiples of it as fit :data:`ACCELERATOR_BLOCK_BYTES` of float32."""
    if not accelerator:
        return MAX_CHUNK_ROWS
    fit = ACCELERATOR_BLOCK_BYTES // (4 * vocab_size)
    return max(MAX_CHUNK_ROWS, fit // MAX_CHUNK_ROWS * MAX_CHUNK_ROWS)


def model_block_rows(lm: CausalLM) -> int:
    """``lm``'s ``config.logits_block_rows``, or for None the default of the platform this
    traces for (:func:`~jaxrl_llm.models.attention.trace_platform`, as ``attention_impl="auto"``
    is resolved)."""
    rows = lm.config.logits_block_rows
    if rows is not None:
        return rows
    return block_rows(lm.config.vocab_size, accelerator=attention.trace_platform() != "cpu")


HEAD_GRAD_BLOCK_BYTES = 128 * 2**20
"""The float32 bytes of the head's gradient that one block of a fused backward pass forms
before adding it into the head's accumulator
(:func:`~jaxrl_llm.models.grad_accumulation.map_chunks`'s ``weight_block_rows``); a head that
fits one block (SmolLM2's 108 MiB) is not split.

In one block a chunk's whole head gradient is a temporary: XLA:CPU writes the product to a
buffer of its own before the add, and under FSDP every backend forms it whole on each device,
as a partial sum over the device's rows, before the reduce-scatter. In blocks, a 1B Llama GRPO
update (bench_accelerator's plan run) holds 2.30 → 1.55 GiB of temporaries per GPU on 8 H200s
and 4.35 → 3.08 GiB per chip on a v5p-8 (deviceless compiles; one H200: no change), and a
micro-batched fp32 update on CPU of Llama-3.2-1B's shape 5.74 → 5.14 GiB (BENCHMARKS.md, "The
LM head's gradient in blocks"; ``scripts/bench_head_grad_blocks.py``). SmolLM2's head in two
blocks grew its update's temporaries by 19 MiB (the cotangent's block is a copy), and the
issue-5 update's peak, which is in the optimizer, did not fall.

A minibatch of one micro-batch has no accumulator to add into; its head gradient goes into one
of its own, in the same blocks (:func:`~jaxrl_llm.models.grad_accumulation.own_accumulators`):
the plan run in one micro-batch 2.07 → 1.38 GiB per GPU on 8 H200s; on a v5p-8 3.65 → 2.89 GiB
per chip in micro-batches of 8 rows but 3.65 → 3.81 in one of 64 (docs/models.md)."""


def model_head_grad_rows(lm: CausalLM) -> int | None:
    """The head rows of one block of its fused gradient: as many as fit
    :data:`HEAD_GRAD_BLOCK_BYTES` of float32. None (one block) under a mesh with a ``tensor``
    axis, which splits the head's vocabulary: a block at a traced offset along a split axis is
    not a local slice."""
    if jax.sharding.get_abstract_mesh().shape.get("tensor", 1) > 1:
        return None
    return max(1, HEAD_GRAD_BLOCK_BYTES // (4 * lm.config.hidden_size))


def hidden_logprobs(
    lm: CausalLM,
    h_bnd: jax.Array,
    targets_bn: jax.Array,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = 256,
    with_entropy: bool = False,
    with_log_sum_sq: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Log-probs (and optionally entropies) of ``targets_bn`` from the states that predict them.

    ``h_bnd[:, i]`` is the hidden state whose logits predict ``targets_bn[:, i]``. Chunks are
    ``chunk_size`` steps long at the CPU's block size, longer in proportion where the model's
    blocks are larger (:func:`model_block_rows`: 4x at 1,024 rows), and shortened so that
    ``B * chunk`` is at most the block rows: few wide rows (packed) fill a block along time,
    many rows share it. A bf16 head is cast once, before the chunks. Returns f32
    ``[B, N]`` (a pair with the entropy when ``with_entropy``, or with ``log Σ_v π(v)²`` —
    :func:`~jaxrl_llm.core.logprobs.token_logprobs_and_log_sum_sq`, for WPO — when
    ``with_log_sum_sq``; not both).
    """
    if with_entropy and with_log_sum_sq:
        raise ValueError("hidden_logprobs: with_entropy and with_log_sum_sq are exclusive")
    b, n, d = h_bnd.shape
    c = n
    if chunk_size is not None:  # a block holds at most the model's block rows of logits
        rows = model_block_rows(lm)
        steps = chunk_size * max(1, rows // MAX_CHUNK_ROWS)
        c = max(1, min(n, steps, rows // b))
    pad = -n % c
    if pad:  # pad the (small) hidden states, never the logits
        h_bnd = jnp.pad(h_bnd, ((0, 0), (0, pad), (0, 0)))
        targets_bn = jnp.pad(targets_bn, ((0, 0), (0, pad)))
    chunks = (n + pad) // c
    h_kbcd = h_bnd.reshape(b, chunks, c, d).swapaxes(0, 1)
    y_kbc = targets_bn.reshape(b, chunks, c).swapaxes(0, 1)

    def _logits(w_vd: jax.Array, head_vd: jax.Array | None, h_bcd: jax.Array) -> jax.Array:
        return lm.logits(h_bcd, head_vd=head_vd, weight_vd=w_vd)

    def _reduce(logits_bcv: jax.Array, y_bc: jax.Array) -> tuple[jax.Array, ...]:
        if with_entropy:
            return core_logprobs.token_logprobs_and_entropy(
                logits_bcv, y_bc, temperature=temperature
            )
        if with_log_sum_sq:
            return core_logprobs.token_logprobs_and_log_sum_sq(
                logits_bcv, y_bc, temperature=temperature
            )
        return (core_logprobs.token_logprobs(logits_bcv, y_bc, temperature=temperature),)

    w_vd = lm.head_weight()
    prepare = lambda w: lm.head_cast(w, h_bnd.dtype)  # a bf16 head is cast once
    # Inside a micro-batch loop the head's gradient goes straight into its accumulator.
    outs_k = grad_accumulation.map_chunks(
        _logits,
        _reduce,
        w_vd,
        h_kbcd,
        y_kbc,
        prepare=prepare,
        weight_block_rows=model_head_grad_rows(lm),
    )
    if outs_k is None:
        head_vd = prepare(w_vd)
        chunk = jax.checkpoint(lambda h_bcd, y_bc: _reduce(_logits(w_vd, head_vd, h_bcd), y_bc))
        if chunks == 1:  # no loop
            outs_k = tuple(o[None] for o in chunk(h_kbcd[0], y_kbc[0]))
        else:
            _, outs_k = jax.lax.scan(lambda _, xs: (None, chunk(*xs)), None, (h_kbcd, y_kbc))
    outs = tuple(o.swapaxes(0, 1).reshape(b, chunks * c)[:, :n] for o in outs_k)
    return outs if with_entropy or with_log_sum_sq else outs[0]


def completion_logprobs(
    lm: CausalLM,
    tokens_bt: jax.Array,
    mask_bt: jax.Array | None = None,
    *,
    start: int = 1,
    temperature: float = 1.0,
    chunk_size: int | None = 256,
    with_entropy: bool = False,
    with_log_sum_sq: bool = False,
    positions_bt: jax.Array | None = None,
    lora_keys_bt: jax.Array | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """``log π(tokens[:, t] | tokens[:, <t])`` for ``t`` in ``[start, T)``: f32 ``[B, T − start]``.

    With a prompt of ``P`` (left-padded) slots followed by completions, ``start=P`` scores
    exactly the completion tokens and forms logits only for them. Padding positions hold
    finite garbage; mask them downstream. ``temperature`` must be the sampling temperature.
    ``lora_keys_bt``: per-token keys of the LoRA adapters' dropout (the update's forward only).
    """
    if not 1 <= start < tokens_bt.shape[1]:
        raise ValueError(f"start must be in [1, T={tokens_bt.shape[1]}), got {start}")
    h_btd, _ = lm.model(tokens_bt, mask_bt, positions_bt=positions_bt, lora_keys_bt=lora_keys_bt)
    return hidden_logprobs(
        lm,
        h_btd[:, start - 1 : -1],
        tokens_bt[:, start:],
        temperature=temperature,
        chunk_size=chunk_size,
        with_entropy=with_entropy,
        with_log_sum_sq=with_log_sum_sq,
    )
