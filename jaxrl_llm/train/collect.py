"""The host's part of a step: generation, rewards, selection; and DPO's pair batches.

:func:`collect` generates G samples per prompt, scores them on the host and applies the recipe's
selection: PODS keeps ``pods_num_keep`` of the G samples of each prompt (gathered, so the step
sees ``[B, m]``); DAPO's dynamic sampling drops prompts whose G rewards are all equal and
refills them from the next prompts of the stream (at most ``max_refill_batches`` extra batches
of B prompts; groups still missing stay in the batch as non-members with zero loss, so shapes
are static). The result is a :class:`~jaxrl_llm.train.step.Groups` of host arrays, which the
device step (:mod:`jaxrl_llm.train.step`) takes as it is.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import chain as ch
from jaxrl_llm import distributed as dist
from jaxrl_llm import recipe as rc
from jaxrl_llm import rewards as R
from jaxrl_llm.data import BatchIterator
from jaxrl_llm.models import sharding as shd
from jaxrl_llm.train.completions import jsonable
from jaxrl_llm.train.setup import Models, Sampler, Setup
from jaxrl_llm.train.step import Groups
from jaxrl_llm.train.update import DPOBatch

# ---------------------------------------------------------------------------------------------
# Generation and rewards (host side).


def _take(groups: Groups, rows: Any) -> Groups:
    return Groups(*(None if x is None else x[rows] for x in groups))


def _left_pad(ids: np.ndarray, mask: np.ndarray, width: int, pad: int):
    extra = width - ids.shape[1]
    if extra <= 0:
        return ids, mask
    return (
        np.pad(ids, ((0, 0), (extra, 0)), constant_values=pad),
        np.pad(mask, ((0, 0), (extra, 0))),
    )


def _concat(parts: list[Groups], pad: int) -> Groups:
    width = max(p.prompt_ids_bp.shape[1] for p in parts)
    padded = [_left_pad(p.prompt_ids_bp, p.prompt_mask_bp, width, pad) for p in parts]
    out = Groups(
        *(None if xs[0] is None else np.concatenate(xs) for xs in zip(*parts, strict=True))
    )
    return out._replace(
        prompt_ids_bp=np.concatenate([p[0] for p in padded]),
        prompt_mask_bp=np.concatenate([p[1] for p in padded]),
    )


def sample_completions(
    models: Models,
    params: dict,
    sampler: Sampler,
    prompt_ids: np.ndarray,
    prompt_mask: np.ndarray,
    key: jax.Array,
    *,
    policy: tuple[Any, dict] | None = None,
    with_stats: bool = False,
) -> Any:
    """``sampler``'s completions of the prompts with the policy ``params``, as host arrays
    (the fields of :func:`jaxrl_llm.rollout.generate`'s result). ``policy``: a ``(graphdef,
    params)`` to sample from instead of ``models.sampling_policy(params)`` (the rollout
    weights of :mod:`jaxrl_llm.train.placement`, on their own mesh). ``with_stats``: the pair
    ``(completions, stats)``, ``stats`` the paged engine's
    :class:`~jaxrl_llm.rollout.paged.PagedStats` (None for the static engine)."""
    from jaxrl_llm import rollout

    if policy is None:
        policy = models.sampling_policy(params)  # LoRA: the adapters on the base, or merged
    # generate() runs on the parameters' mesh by itself (batch over the data axes).
    out = rollout.generate(
        policy,
        prompt_ids,
        prompt_mask,
        rng=key,
        max_new_tokens=sampler.max_new_tokens,
        num_samples=sampler.num_samples,
        temperature=sampler.temperature,
        top_k=sampler.top_k,
        top_p=sampler.top_p,
        stop_token_ids=sampler.stop_ids,
        cache_dtype=sampler.cache_dtype,
        engine=sampler.engine,
        paged_options=sampler.paged_options(),
        return_full_logprobs=sampler.full_logprobs,
        return_stats=with_stats,
    )
    if with_stats:
        out, stats = out
        return jax.tree.map(np.asarray, jax.device_get(out)), stats
    return jax.tree.map(np.asarray, jax.device_get(out))


KV_FIELDS = (
    "peak_pages",
    "pool_pages",
    "page_bytes",
    "preemptions",
    "decode_dispatches",
    "prefill_tokens",
    "shared_prompt_tokens",
    "decode_steps",
    "prompts_stolen",
)
"""The :class:`~jaxrl_llm.rollout.paged.PagedStats` fields that :func:`kv_metrics` reads, the
columns of :func:`engine_rows` (rows saved with in-flight batches before the last two columns
existed read them as 0: ``asynchronous``)."""


def engine_rows(stats: Any) -> np.ndarray:
    """``int64[E, len(KV_FIELDS)]``: one row of :data:`KV_FIELDS` per paged engine that ran
    in this process (a data-parallel run's shards; none for the static engine, ``stats`` None).
    In a multi-process run, every process's rows (over the coordination service; every
    process must call it)."""
    engines = getattr(stats, "shards", None) or (stats,)
    rows = np.asarray(
        [[getattr(s, f) for f in KV_FIELDS] for s in engines if s is not None], np.int64
    ).reshape(-1, len(KV_FIELDS))
    if dist.is_multiprocess():
        rows = dist.host_allgather(rows, what="paged engine stats", tiled=True)
    return rows


def kv_metrics(rounds: list[np.ndarray]) -> dict[str, float]:
    """The rollout's KV-cache metrics from each generation round's :func:`engine_rows`
    (vLLM's cache usage and preemption counts); empty when no paged engine ran.

    Per engine (one pool on one data shard's devices), the most over engines and rounds:
    ``rollout/kv_peak_gib`` the pages held at the busiest moment, ``rollout/kv_pool_gib`` the
    pool as allocated (its trash page included), ``rollout/kv_usage_peak`` the peak's fraction
    of the pool's usable pages (1.0: the pool was the limit; with preemptions, a larger pool —
    ``rollout.memory_utilization``, ``rollout.max_total_tokens`` — would have run them without
    recomputation). Summed over engines and rounds: ``rollout/preemptions``, sequences whose
    pages were taken back to be recomputed. ``rollout/decode_dispatches``: the busiest
    engine's compiled decode calls, summed over rounds (the host's share of the rollout
    grows with it). ``rollout/prefix_shared_frac``: of the context tokens the prefills would
    have run, the fraction they did not, because pages already held them (another prompt's,
    or a recomputed sequence's siblings': prefix sharing; vLLM's prefix cache hit rate), over
    the engines and rounds.
    ``rollout/decode_steps``: the busiest engine's decode steps, summed over rounds (the
    rollout's critical path where a step's time barely depends on its rows, as on an
    accelerator); ``rollout/prompts_stolen``: the prompts data-parallel engines took from each
    other's queues (``PagedOptions.work_stealing``), summed."""
    rows = [r for r in rounds if len(r)]
    if not rows:
        return {}

    def busiest(field: str) -> float:  # each round's busiest engine, summed over rounds
        i = KV_FIELDS.index(field)
        return float(sum(np.max(r[:, i]) for r in rows))

    cols = dict(zip(KV_FIELDS, np.concatenate(rows).T.astype(np.float64), strict=True))
    peak, pool, page_bytes = cols["peak_pages"], cols["pool_pages"], cols["page_bytes"]
    ran, shared = cols["prefill_tokens"], cols["shared_prompt_tokens"]
    gib = float(2**30)
    return {
        "rollout/kv_peak_gib": float(np.max(peak * page_bytes)) / gib,
        "rollout/kv_pool_gib": float(np.max(pool * page_bytes)) / gib,
        "rollout/kv_usage_peak": float(np.max(peak / np.maximum(pool - 1, 1))),
        "rollout/preemptions": float(np.sum(cols["preemptions"])),
        "rollout/decode_dispatches": busiest("decode_dispatches"),
        "rollout/decode_steps": busiest("decode_steps"),
        "rollout/prompts_stolen": float(np.sum(cols["prompts_stolen"])),
        "rollout/prefix_shared_frac": float(shared.sum() / max(shared.sum() + ran.sum(), 1.0)),
    }


def score_completions(
    tokenizer: Any,
    reward: R.WeightedSum,
    prompts: Any,
    fields: dict[str, Any],
    tokens: np.ndarray,
    mask: np.ndarray,
    *,
    trainer_state: R.TrainerState | None = None,
) -> tuple[np.ndarray, R.RewardOutput, list]:
    """``(f32[B, G] rewards, the reward's output, the decoded texts)`` of the completions."""
    from jaxrl_llm import rollout

    texts = rollout.decode_completions(tokenizer, tokens, mask)
    reward_bg, out = R.score_groups(
        reward,
        prompts,
        texts,
        fields,
        tokens_bgt=tokens,
        mask_bgt=mask,
        trainer_state=trainer_state,
    )
    return reward_bg.astype(np.float32), out, texts


def trainer_state(setup: Setup, step: int | None) -> R.TrainerState | None:
    """The rewards' :class:`~jaxrl_llm.rewards.TrainerState` for the batch that update step
    ``step`` (1-based) trains; ``None`` when no step is given."""
    if step is None:
        return None
    return R.TrainerState(global_step=int(step) - 1, max_steps=int(setup.loop.max_steps))


def details_json(out: R.RewardOutput) -> np.ndarray:
    """``str[N]``: each sample's :meth:`~jaxrl_llm.rewards.RewardOutput.sample_details` as
    JSON (host values, through gathers, buffers and selections like the other fields)."""
    return np.asarray(
        [json.dumps(d, default=jsonable) for d in out.sample_details()], dtype=np.str_
    )


def gather_reward_output(out: R.RewardOutput) -> R.RewardOutput:
    """Every process's scores, in process order (error counts summed); host values, so over
    the coordination service (:func:`~jaxrl_llm.distributed.host_allgather`)."""
    if not dist.is_multiprocess():
        return out
    names = sorted(out.num_errors)
    total, components, correct, errors = dist.host_allgather(
        (
            out.total_n,
            out.components,
            out.correct_n,
            np.asarray([[out.num_errors[k] for k in names]], np.int64),
        ),
        what="reward scores",
        tiled=True,
    )
    counts = errors.sum(axis=0)
    extras, reported = _gather_reported(out)
    return R.RewardOutput(
        total_n=total,
        components=components,
        num_errors={k: int(c) for k, c in zip(names, counts, strict=True)},
        correct_n=correct,
        extras=extras,
        reported=reported,
    )


def _gather_reported(out: R.RewardOutput) -> tuple[dict, dict]:
    """Every process's reported columns (in process order; ``None`` where a process's rewards
    did not report one) and scalars (each the mean over the processes that reported it), as
    JSON over the coordination service: their keys and value types may differ by process."""
    n = len(out.total_n)
    columns = [
        json.dumps(
            {name: {k: v[i] for k, v in cols.items()} for name, cols in out.extras.items()},
            default=jsonable,
        )
        for i in range(n)
    ]
    rows, scalars = dist.host_allgather(
        (
            np.asarray(columns, dtype=np.str_).reshape(n),
            np.asarray([json.dumps(out.reported)], dtype=np.str_),
        ),
        what="reported reward values",
        tiled=True,
    )
    rows = [json.loads(r) for r in rows.tolist()]
    extras: dict[str, dict[str, list]] = {}
    for i, row in enumerate(rows):
        for name, cols in row.items():
            for key, value in cols.items():
                extras.setdefault(name, {}).setdefault(key, [None] * len(rows))[i] = value
    per_process: dict[str, dict[str, list[float]]] = {}
    for blob in scalars.tolist():
        for name, values in json.loads(blob).items():
            for key, value in values.items():
                per_process.setdefault(name, {}).setdefault(key, []).append(value)
    reported = {
        name: {k: float(np.mean(v)) for k, v in values.items()}
        for name, values in per_process.items()
    }
    return extras, reported


def policy_rows(policy: tuple[Any, dict], num_rows: int) -> slice:
    """This process's rows of a batch that ``policy``'s mesh generates (every row in a
    single-process run): the rows its devices hold under the batch sharding of the mesh the
    parameters lie on (``generate`` splits the batch over that mesh's data axes)."""
    if not dist.is_multiprocess():
        return slice(0, int(num_rows))
    return dist.process_rows(shd.batch_sharding(policy_mesh(policy), 1), (int(num_rows),))


def policy_mesh(policy: tuple[Any, dict]) -> jax.sharding.Mesh:
    """The mesh ``policy``'s parameters lie on (multi-process runs)."""
    for leaf in jax.tree.leaves(policy[1]):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):
            return sharding.mesh
    raise ValueError(
        "collect: in a multi-process run the sampling policy's parameters must lie on a mesh "
        "over every process's devices (a NamedSharding)"
    )


def _sampling_rows(setup: Setup, policy: tuple[Any, dict] | None, num_rows: int) -> slice:
    """This process's rows of a batch sampled with ``policy`` (of its mesh), or with the train
    mesh's policy when ``None``; every row in a single-process run."""
    if policy is None:
        return setup.models.process_rows(num_rows)
    return policy_rows(policy, num_rows)


def _generate_round(
    setup: Setup,
    params: dict,
    batch: Any,
    key: jax.Array,
    policy: tuple[Any, dict] | None = None,
    step: int | None = None,
):
    """Samples and scores one global batch of prompts; every process returns all its groups.

    In a multi-process run each process generates for and scores only its own rows of the
    batch (:func:`~jaxrl_llm.distributed.process_rows`: of the train mesh, or of ``policy``'s
    mesh when given), then the groups are gathered so that selection and metrics see the
    global batch in the order of a single-process run.
    """
    rows = _sampling_rows(setup, policy, len(batch.prompts))
    t0 = time.perf_counter()
    out, stats = sample_completions(
        setup.models,
        params,
        setup.sampler,
        batch.prompt_ids_bt[rows],
        batch.prompt_mask_bt[rows],
        key,
        policy=policy,
        with_stats=True,
    )
    seconds = time.perf_counter() - t0
    kv_rows = engine_rows(stats)
    return (*_score_round(setup, params, batch, rows, out, key, policy, seconds, step), kv_rows)


def _score_round(
    setup: Setup,
    params: dict | None,
    batch: Any,
    rows: slice,
    out: Any,
    key: jax.Array,
    policy: tuple[Any, dict] | None,
    sample_seconds: float,
    step: int | None,
):
    """Scores this process's ``rows`` of ``batch`` sampled as ``out`` (Generation fields, host
    arrays) for update step ``step``, then gathers the groups of every process (see
    :func:`_generate_round`)."""
    t1 = time.perf_counter()
    state = trainer_state(setup, step)
    reward_bg, reward_out, _ = score_completions(
        setup.tokenizer,
        setup.reward,
        batch.prompts[rows],
        {k: v[rows] for k, v in batch.fields.items()},
        out.tokens,
        out.mask,
        trainer_state=state,
    )
    t2 = time.perf_counter()
    local = dict(
        tokens=out.tokens.astype(np.int32),
        mask=out.mask.astype(bool),
        logp=out.logprobs.astype(np.float32),
        truncated=out.truncated.astype(bool),
        reward=reward_bg,
    )
    full = getattr(out, "full_logprobs", None)  # rollout.full_logprobs
    if full is not None:
        local["logp_full"] = np.asarray(full, np.float32)
    requires = setup.recipe.requires
    if ch.REWARD_COMPONENTS in requires:  # GDPO: the terms apart, in the config's order
        b, g = reward_bg.shape
        terms = [reward_out.components[name] for name in setup.reward.names]
        local["reward_k"] = np.stack(terms, -1).reshape(b, g, len(terms)).astype(np.float32)
    if ch.GIVEN_BASELINE in requires:  # ReMax: one greedy completion per prompt, same reward
        greedy = sample_completions(
            setup.models,
            params,
            setup.sampler.greedy(),
            batch.prompt_ids_bt[rows],
            batch.prompt_mask_bt[rows],
            key,
            policy=policy,
        )
        baseline_b1, _, _ = score_completions(
            setup.tokenizer,
            setup.reward,
            batch.prompts[rows],
            {k: v[rows] for k, v in batch.fields.items()},
            greedy.tokens,
            greedy.mask,
            trainer_state=state,
        )
        local["baseline"] = baseline_b1[:, 0]
    t3 = time.perf_counter()
    # over the devices that sampled it (idle now; the async loop's update may still run on the
    # train mesh), the scores over the coordination service
    mesh = None
    if dist.is_multiprocess():
        mesh = setup.models.mesh if policy is None else policy_mesh(policy)
    local, reward_out = dist.gather(local, mesh), gather_reward_output(reward_out)
    details = None
    if setup.loop.log_completions:  # what a logged completion shows beside its reward
        details = details_json(reward_out).reshape(local["reward"].shape)
    mask_bgt = local["mask"]
    if setup.sampler.mask_truncated:  # no loss on cut completions (TRL's option)
        mask_bgt = mask_bgt & ~local["truncated"][..., None]
    groups = Groups(
        prompt_ids_bp=np.asarray(batch.prompt_ids_bt, np.int32),
        prompt_mask_bp=np.asarray(batch.prompt_mask_bt, bool),
        tokens_bgt=local["tokens"],
        mask_bgt=mask_bgt,
        logp_sampler_bgt=local["logp"],
        reward_bg=local["reward"],
        member_bg=np.ones(local["reward"].shape, bool),
        baseline_b=local.get("baseline"),
        reward_bgk=local.get("reward_k"),
        logp_full_bgt=local.get("logp_full"),
        details_bg=details,
    )
    metrics = {"time/rollout": sample_seconds + (t3 - t2), "time/reward": t2 - t1}
    return groups, reward_out, local["truncated"], metrics


def _select(recipe: rc.Recipe, groups: Groups) -> np.ndarray:
    rollout = ch.Rollout(
        reward_bg=jnp.asarray(groups.reward_bg), mask_bgt=jnp.asarray(groups.mask_bgt)
    )
    return np.asarray(rc.select(recipe, rollout).mask_bg)


def _round_metrics(groups: Groups, reward_out: R.RewardOutput, truncated: np.ndarray) -> dict:
    # a cut completion has the full budget's length (also when its loss is masked)
    lengths = np.where(truncated, groups.mask_bgt.shape[-1], groups.mask_bgt.sum(-1))
    metrics = dict(reward_out.metrics())
    metrics["groups/zero_std_fraction"] = float(
        np.mean(np.all(groups.reward_bg == groups.reward_bg[:, :1], axis=1))
    )
    metrics["response_length/mean"] = float(lengths.mean())
    metrics["response_length/max"] = float(lengths.max())
    metrics["response_length/truncated_fraction"] = float(truncated.mean())
    metrics["perf/generated_tokens"] = float(lengths.sum())
    if groups.baseline_b is not None:
        metrics["reward/greedy_baseline_mean"] = float(np.mean(groups.baseline_b))
    return metrics


def _selected(
    recipe: rc.Recipe, groups: Groups, extra_bg: tuple[np.ndarray, ...] = ()
) -> tuple[Groups, tuple[np.ndarray, ...]]:
    """The groups with the recipe's selection in ``member_bg``; PODS keeps ``pods_num_keep``
    of each group's samples (the members first), and ``extra_bg`` (arrays ``[B, G, ...]``)
    are taken along."""
    member = _select(recipe, groups)
    keep_m = recipe.selection.pods_num_keep
    if keep_m is not None:
        order = np.argsort(~member, axis=1, kind="stable")[:, :keep_m]

        def take(x: np.ndarray) -> np.ndarray:
            return np.take_along_axis(x, order.reshape(order.shape + (1,) * (x.ndim - 2)), 1)

        groups = groups._replace(
            tokens_bgt=take(groups.tokens_bgt),
            mask_bgt=take(groups.mask_bgt),
            logp_sampler_bgt=take(groups.logp_sampler_bgt),
            reward_bg=take(groups.reward_bg),
            reward_bgk=None if groups.reward_bgk is None else take(groups.reward_bgk),
            logp_full_bgt=None if groups.logp_full_bgt is None else take(groups.logp_full_bgt),
            details_bg=None if groups.details_bg is None else take(groups.details_bg),
        )
        member, extra_bg = take(member), tuple(take(x) for x in extra_bg)
    return groups._replace(member_bg=member), extra_bg


def score_generated(
    setup: Setup,
    batch: Any,
    out: Any,
    *,
    sample_seconds: float = 0.0,
    step: int | None = None,
    policy: tuple[Any, dict] | None = None,
) -> tuple[Groups, dict[str, float], np.ndarray | None]:
    """Scores and selects one batch sampled elsewhere (partial rollouts: ``out`` has the
    :class:`~jaxrl_llm.rollout.Generation` fields, host arrays, for the whole batch, and
    optionally ``version`` ``[B, G, T]``), as :func:`collect` does a batch without refills.
    Several processes (each holding the whole ``out``): each scores the rows it would have
    generated (of ``policy``'s mesh, as in :func:`collect`, or of the train mesh), then the
    groups are gathered. Returns ``(groups, metrics, version_bgt)``, the versions taken along
    PODS's selection."""
    recipe = setup.recipe
    if recipe.selection.dynamic_sampling or ch.GIVEN_BASELINE in recipe.requires:
        raise ValueError(
            f"score_generated: {recipe.name} refills groups or samples a greedy baseline, "
            "which a batch sampled elsewhere cannot do"
        )
    rows = _sampling_rows(setup, policy, len(batch.prompts))
    mine = out._replace(**{f: None if x is None else x[rows] for f, x in out._asdict().items()})
    groups, reward_out, truncated, times = _score_round(
        setup, None, batch, rows, mine, None, policy, sample_seconds, step
    )
    metrics = _round_metrics(groups, reward_out, truncated)
    version = getattr(out, "version", None)
    extra = () if version is None else (np.asarray(version, np.int32),)
    groups, extra = _selected(recipe, groups, extra)
    return groups, {**metrics, **times}, (extra[0] if extra else None)


def collect(
    setup: Setup,
    params: dict,
    it: BatchIterator,
    key: jax.Array,
    *,
    policy: tuple[Any, dict] | None = None,
    step: int | None = None,
) -> tuple[Groups, dict[str, float]]:
    """Generates, scores and selects the groups update step ``step`` trains (see the module
    docstring; ``step`` is what the rewards' ``trainer_state`` says, ``None`` without one).

    ``policy``: the ``(graphdef, params)`` to sample from instead of
    ``setup.models.sampling_policy(params)``, e.g. ``RolloutWeights.sampling_policy()`` on the
    rollout mesh (:mod:`jaxrl_llm.train.placement`); each process then generates the rows of
    that mesh, and the groups come back as host arrays as always."""
    recipe = setup.recipe
    b = setup.loop.batch_size
    dynamic = recipe.selection.dynamic_sampling
    kept: list[Groups] = []
    dropped: list[Groups] = []
    metrics: dict[str, float] = {}
    times = {"time/rollout": 0.0, "time/reward": 0.0}
    rounds = 0
    kv_rounds: list[np.ndarray] = []
    while True:
        groups, reward_out, truncated, t, kv_rows = _generate_round(
            setup, params, it.next_batch(), jax.random.fold_in(key, rounds), policy, step
        )
        kv_rounds.append(kv_rows)
        for k, v in t.items():
            times[k] += v
        if rounds == 0:
            metrics.update(_round_metrics(groups, reward_out, truncated))
        groups, _ = _selected(recipe, groups)
        member = groups.member_bg
        if not dynamic:
            kept = [groups]
            break
        keep_b = member.any(axis=1)
        kept += [_take(groups, [i]) for i in np.flatnonzero(keep_b)]
        dropped += [_take(groups, [i]) for i in np.flatnonzero(~keep_b)]
        if len(kept) >= b or rounds >= setup.loop.max_refill_batches:
            break
        rounds += 1
    pad = setup.data.train.pad_id
    if dynamic:
        metrics["selection/refill_batches"] = float(rounds)
        metrics["selection/kept_groups_fraction"] = min(len(kept), b) / b
        filler = [g._replace(member_bg=np.zeros_like(g.member_bg)) for g in dropped]
        final = _concat((kept + filler)[:b], pad=pad)
    else:
        final = _concat(kept, pad=pad)
    metrics.update(times)
    metrics.update(kv_metrics(kv_rounds))
    return final, metrics


def to_global(models: Models, tree: Any) -> Any:
    """Several processes: host arrays become global arrays, each process giving its own rows
    (``make_array_from_process_local_data``); one process: unchanged (the step places them).
    Groups lose their host-only ``details_bg``."""
    if isinstance(tree, Groups):
        tree = tree.for_update()
    if not dist.is_multiprocess():
        return tree
    return jax.tree.map(lambda x: x if isinstance(x, jax.Array) else models.to_device(x), tree)


# ---------------------------------------------------------------------------------------------
# DPO batches.


def dpo_batch(
    models: Models, pairs: Any, logprob: Callable[..., jax.Array]
) -> tuple[DPOBatch, dict[str, float]]:
    """A :class:`~jaxrl_llm.train.update.DPOBatch` from a data PreferenceBatch, with the
    reference's sequence log-probs when the run has a reference (``logprob``: a jitted
    :func:`~jaxrl_llm.train.forward.make_logprob_fn`)."""
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
    if models.ref_params is not None:
        with jax.set_mesh(models.mesh):
            for side in ("chosen", "rejected"):
                logp = logprob(
                    models.ref_params,
                    models.to_device(fields[f"{side}_tokens_nl"]),
                    models.to_device(fields[f"{side}_input_mask_nl"]),
                    completion_len=fields[f"{side}_mask_nt"].shape[1],
                    graphdef=models.ref_graphdef,
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
    return to_global(models, DPOBatch(**fields)), metrics


__all__ = [
    "collect",
    "dpo_batch",
    "engine_rows",
    "gather_reward_output",
    "kv_metrics",
    "policy_rows",
    "sample_completions",
    "score_completions",
    "to_global",
]
