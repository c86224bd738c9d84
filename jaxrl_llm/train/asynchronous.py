"""Async RL: the rollout of later steps runs while the update runs (``train.max_staleness``).

The schedule is fixed by the config, never by timing, so a run is reproducible and resumable:
with ``s = train.max_staleness`` the batch that step ``t`` (1-based) trains on is generated
with the policy of version ``v(t) = max(0, t - 1 - s)`` (version ``k`` = the parameters
after ``k`` updates), so every sample is at most ``s`` versions old::

    step t:   update t on batch t            (dispatched; the device runs it)
              rollout of batch t + s with v = t - 1    (the host drives it meanwhile)
              wait for update t's metrics; sync version t to the rollout's weights

``s = 0`` is synchronous (generate batch t, then update; the same numbers as the colocated
loop, up to the meshes' float order with a split placement). ``s = 1`` is verl's
"one-step off-policy" trainer; larger ``s`` bounds staleness as AReaL's ``max_head_offpolicyness``
and PipelineRL's lag do. There is one controller thread: overlap comes from JAX's asynchronous
dispatch (the update's program is enqueued before the rollout's host loop starts), so every
process launches the same programs in the same order, which multi-process runs need. On
several CPU processes the update is finished before the rollout starts (no overlap there:
gloo pairs cross-process collectives by order alone,
:func:`~jaxrl_llm.distributed.one_collective_program_at_a_time`).

Importance correction. Batch ``t`` was sampled by μ = π_{v(t)}, not by the policy that updates.
The step recomputes π_old under the current parameters (the proximal policy of the decoupled
PPO loss, Hilton et al. 2021, "Batch size-invariance for policy optimization"; AReaL, Fu et al.
2025) whenever the recipe's ``rollout_correction`` or ``old_logprobs`` asks for it, and the
sampler's per-token log-probs (``Groups.logp_sampler_bgt``, always the version that sampled
them) are μ. So the stale batch is corrected exactly as the recipe's correction says
(:mod:`jaxrl_llm.core.rollout_correction`; ``docs/async.md`` has the estimator).

Sampler keys follow the synchronous loop's chain: batch ``j`` is drawn with
``split(r_{j-1})[1]`` where ``r`` is :class:`~jaxrl_llm.train.state.TrainState`'s key chain, so
the keys of buffered batches are a function of the state and ``s = 0`` draws what the
synchronous loop draws.

Resume. The buffer (batches ``t+1 .. t+s`` after step ``t``, already generated from versions
``t-s .. t-1``, which no longer exist) is saved with the checkpoint as host arrays
(:meth:`~jaxrl_llm.train.checkpoint.Checkpointer.save`'s ``host``), with each batch's step,
policy version and collection metrics in ``meta``; the data iterator's position saved with it
is after the last buffered batch. A resumed run therefore continues exactly as the
uninterrupted one (``tests/train/test_async.py`` kills a run with SIGKILL and compares).

Partial rollouts (``train.partial_rollout_tokens: N``, ``s >= 2``; AReaL's interruptible
generation, PipelineRL's in-flight weight updates). Batch ``j`` is sampled over the ``s``
update windows before its update: in window ``w = j - s + k`` (``k = 0 .. s - 1``, during update
``w``, under version ``w - 1``) every unfinished sample continues by ``N`` tokens, and in the
last window (``w = j - 1``) to its end, so a long completion's later tokens come from newer
weights (before the first update, batches ``1 .. s`` start under version 0). Each segment
re-prefills prompt ⧺ tokens so far under the current weights
(:mod:`jaxrl_llm.rollout.partial`); every token keeps the version that sampled it
(``version_bgt``) and its sampler log-prob is that version's, so the token-level correction
is against the right μ. The batch is scored when complete. In-flight batches are saved with
the checkpoint too (their dataset indices, key and :class:`~jaxrl_llm.rollout.partial.InFlight`
arrays). With several processes every process holds the whole in-flight batch and samples its
share of each segment (:mod:`jaxrl_llm.rollout.partial`), so the state, the decision that a
batch is complete and what a checkpoint saves are the same on every process; the complete
batch is scored as :func:`~jaxrl_llm.train.collect.collect` scores one (each process its rows
of the rollout mesh, then gathered).

Metrics (per step): ``async/staleness_mean``, ``async/staleness_max`` (in policy versions, over
completion tokens), ``async/staleness_frac_k`` (the fraction of tokens ``k`` versions old, a
histogram for k = 0..s), ``async/behaviour_version``, ``async/buffered``, ``sync/seconds``,
``sync/bytes``, ``sync/arrays``, ``sync/version``. ``RUN_DIR/timeline.jsonl`` has one line per
step with the phases' start and end times (rollout, with the step it is for and its version;
update, from its call to its metrics, with the moment its dispatch returned; sync).
"""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxrl_llm import distributed as dist
from jaxrl_llm.data import BatchIterator
from jaxrl_llm.train import hostmem
from jaxrl_llm.train import state as st
from jaxrl_llm.train.faults import mark_phase
from jaxrl_llm.train.step import Groups

TIMELINE_FILE = "timeline.jsonl"
BUFFER_META = "rollout_buffer"  # checkpoint meta key: the buffered batches' steps, versions


class Pending(NamedTuple):
    """One generated batch waiting for its update.

    Attributes:
      step: the step (1-based) that trains on it.
      version: the policy version that sampled it (the oldest, with partial rollouts).
      groups: the scored, selected :class:`~jaxrl_llm.train.step.Groups` (host arrays).
      metrics: the collection's metrics (rewards, lengths, rollout time).
      version_bgt: ``int32[B, G, T]`` each token's policy version (-1: no token), or None when
        the whole batch is of ``version``.
    """

    step: int
    version: int
    groups: Groups
    metrics: dict[str, float]
    version_bgt: np.ndarray | None = None


class InFlightBatch(NamedTuple):
    """A batch whose partial rollout is under way (``train.partial_rollout_tokens``).

    Attributes:
      step: the step that trains on it.
      indices: ``int64[B]`` its prompts' indices in the training set (the batch is rebuilt
        from them on resume).
      key_data: its sampler key's data (every segment uses the same key).
      state: the :class:`~jaxrl_llm.rollout.partial.InFlight` arrays.
      seconds: sampling time so far.
      kv_rows: each segment's paged engines' stats so far, every process's
        (:func:`~jaxrl_llm.train.collect.engine_rows`), for the batch's KV-cache metrics.
    """

    step: int
    indices: np.ndarray
    key_data: np.ndarray
    state: Any
    seconds: float = 0.0
    kv_rows: tuple = ()


def key_ahead(rng_data: Any, ahead: int) -> jax.Array:
    """The sampler key of the batch ``ahead`` steps after the one whose key chain state is
    ``rng_data`` (``ahead = 0``: ``split(rng)[1]``, the synchronous loop's step key)."""
    rng = jax.random.wrap_key_data(np.asarray(rng_data))
    for _ in range(ahead):
        rng = jax.random.split(rng)[0]
    return jax.random.split(rng)[1]


def staleness_metrics(pending: Pending, train_version: int, max_staleness: int) -> dict[str, float]:
    """Staleness of a batch at its update (``train_version`` = the updating policy's version),
    over its real completion tokens."""
    mask = np.asarray(pending.groups.mask_bgt, bool)
    if pending.version_bgt is None:
        age = np.full(mask.shape, train_version - pending.version, np.int64)
    else:
        age = train_version - np.asarray(pending.version_bgt, np.int64)
    ages = age[mask] if mask.any() else np.asarray([train_version - pending.version])
    out = {
        "async/staleness_mean": float(ages.mean()),
        "async/staleness_max": float(ages.max()),
        "async/behaviour_version": float(pending.version),
    }
    for k in range(max(max_staleness, int(ages.max())) + 1):
        out[f"async/staleness_frac_{k}"] = float(np.mean(ages == k))
    return out


# ---------------------------------------------------------------------------------------------
# The buffer in a checkpoint.

_FIELDS = Groups._fields
_TEXT_FIELDS = ("details_bg",)  # str arrays: saved as the UTF-8 bytes of their JSON list


def _to_saved(name: str, x: Any) -> np.ndarray:
    if name in _TEXT_FIELDS:
        return np.frombuffer(json.dumps(np.asarray(x).tolist()).encode(), np.uint8)
    return np.asarray(x)


def _from_saved(name: str, x: np.ndarray) -> np.ndarray:
    if name in _TEXT_FIELDS:
        return np.asarray(json.loads(np.asarray(x, np.uint8).tobytes().decode()), np.str_)
    return x


_INFLIGHT_SCALARS = ("last_version", "segments")


def buffer_to_host(entries: list[Any]) -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
    """``(arrays, description)`` of the buffered batches (:class:`Pending` and
    :class:`InFlightBatch`) for ``Checkpointer.save``."""
    arrays: dict[str, np.ndarray] = {}
    described = []
    for i, p in enumerate(entries):
        if isinstance(p, InFlightBatch):
            arrays[f"b{i}.indices"] = np.asarray(p.indices, np.int64)
            arrays[f"b{i}.key_data"] = np.asarray(p.key_data)
            names = [
                n
                for n in p.state._fields
                if n not in _INFLIGHT_SCALARS and getattr(p.state, n) is not None
            ]
            for name in names:
                arrays[f"b{i}.state.{name}"] = np.asarray(getattr(p.state, name))
            described.append(
                {
                    "step": int(p.step),
                    "in_flight": True,
                    "fields": names,
                    "scalars": {n: int(getattr(p.state, n)) for n in _INFLIGHT_SCALARS},
                    "seconds": float(p.seconds),
                    "kv_rows": [np.asarray(r, np.int64).tolist() for r in p.kv_rows],
                }
            )
            continue
        fields = []
        for name, x in zip(_FIELDS, p.groups, strict=True):
            if x is not None:
                arrays[f"b{i}.{name}"] = _to_saved(name, x)
                fields.append(name)
        if p.version_bgt is not None:
            arrays[f"b{i}.version_bgt"] = np.asarray(p.version_bgt, np.int32)
        described.append(
            {
                "step": int(p.step),
                "version": int(p.version),
                "fields": fields,
                "partial": p.version_bgt is not None,
                "metrics": {k: float(v) for k, v in p.metrics.items()},
            }
        )
    return arrays, described


def _kv_rows(rows: list) -> np.ndarray:
    from jaxrl_llm.train.collect import KV_FIELDS

    a = np.asarray(rows, np.int64)
    a = a.reshape(-1, a.shape[-1] if a.ndim == 2 else len(KV_FIELDS))
    # Rows saved before KV_FIELDS' last columns existed: those columns read as 0.
    return np.pad(a, ((0, 0), (0, len(KV_FIELDS) - a.shape[1])))


def buffer_from_host(
    arrays: Mapping[str, np.ndarray], described: list[Mapping[str, Any]]
) -> list[Pending]:
    """The inverse of :func:`buffer_to_host`."""
    out = []
    for i, d in enumerate(described):
        if d.get("in_flight"):
            from jaxrl_llm.rollout import partial

            fields = {name: arrays[f"b{i}.state.{name}"] for name in d["fields"]}
            state = partial.InFlight(**fields, **d["scalars"])
            out.append(
                InFlightBatch(
                    int(d["step"]),
                    arrays[f"b{i}.indices"],
                    arrays[f"b{i}.key_data"],
                    state,
                    float(d["seconds"]),
                    tuple(_kv_rows(r) for r in d.get("kv_rows", ())),
                )
            )
            continue
        values = {name: _from_saved(name, arrays[f"b{i}.{name}"]) for name in d["fields"]}
        groups = Groups(**{name: values.get(name) for name in _FIELDS})
        version_bgt = arrays[f"b{i}.version_bgt"] if d.get("partial") else None
        out.append(
            Pending(int(d["step"]), int(d["version"]), groups, dict(d["metrics"]), version_bgt)
        )
    return out


# ---------------------------------------------------------------------------------------------
# Partial rollouts.


class PartialRollouts:
    """Segmented sampling of a run's batches (``train.partial_rollout_tokens``).

    Args:
      setup: the run's :class:`~jaxrl_llm.train.setup.Setup` (its sampler settings, reward
        and recipe's selection).
      segment_tokens: ``N``, new tokens per sample in each window but a batch's last.
    """

    def __init__(self, setup: Any, segment_tokens: int):
        self.setup, self.segment_tokens = setup, int(segment_tokens)
        self._batches: dict[int, Any] = {}

    def _batch(self, entry: InFlightBatch, iterator: BatchIterator) -> Any:
        if entry.step not in self._batches:  # rebuilt from the indices (after a resume)
            data = iterator.dataset
            self._batches[entry.step] = data.batch(entry.indices, **iterator.batch_kwargs)
        return self._batches[entry.step]

    def begin(self, step: int, iterator: BatchIterator, key: jax.Array) -> InFlightBatch:
        """Takes batch ``step``'s prompts from the stream; nothing sampled yet."""
        from jaxrl_llm.rollout import partial

        indices = iterator.next_indices()
        self._batches[step] = iterator.dataset.batch(indices, **iterator.batch_kwargs)
        sampler = self.setup.sampler
        state = partial.start(
            len(indices),
            sampler.num_samples,
            sampler.max_new_tokens,
            full_logprobs=sampler.full_logprobs,
        )
        return InFlightBatch(step, indices, np.asarray(jax.random.key_data(key)), state)

    def advance(
        self,
        entry: InFlightBatch,
        iterator: BatchIterator,
        policy: Any,
        version: int,
        *,
        to_end: bool,
    ) -> InFlightBatch:
        """Continues the unfinished samples by ``segment_tokens`` (or to their end)."""
        from jaxrl_llm.rollout import partial
        from jaxrl_llm.train.collect import engine_rows

        sampler = self.setup.sampler
        batch = self._batch(entry, iterator)
        t0 = time.perf_counter()
        stats: list = []
        state = partial.advance(
            policy,
            batch.prompt_ids_bt,
            batch.prompt_mask_bt,
            entry.state,
            rng=jax.random.wrap_key_data(np.asarray(entry.key_data)),
            version=int(version),
            segment_tokens=sampler.max_new_tokens if to_end else self.segment_tokens,
            temperature=sampler.temperature,
            top_k=sampler.top_k,
            top_p=sampler.top_p,
            stop_token_ids=sampler.stop_ids,
            cache_dtype=sampler.cache_dtype,
            engine=sampler.engine,
            paged_options=sampler.paged_options(),
            stats=stats,
        )
        # every process's rows, so that all hold (and a checkpoint saves) the same entry
        rows = tuple(engine_rows(s) for s in stats)
        return entry._replace(
            state=state,
            seconds=entry.seconds + time.perf_counter() - t0,
            kv_rows=entry.kv_rows + rows,
        )

    def finish(self, entry: InFlightBatch, iterator: BatchIterator, policy: Any) -> Pending:
        """Scores and selects the complete batch (several processes: each scores the rows of
        ``policy``'s mesh it holds, as :func:`~jaxrl_llm.train.collect.collect` does)."""
        from jaxrl_llm.rollout import partial
        from jaxrl_llm.train.collect import kv_metrics, score_generated

        out = jax.tree.map(np.asarray, partial.finish(entry.state))
        batch = self._batch(entry, iterator)
        groups, metrics, version_bgt = score_generated(
            self.setup, batch, out, sample_seconds=entry.seconds, step=entry.step, policy=policy
        )
        metrics.update(kv_metrics(list(entry.kv_rows)))  # each segment a round
        del self._batches[entry.step]
        valid = version_bgt >= 0
        version = int(version_bgt[valid].min()) if valid.any() else int(entry.state.last_version)
        metrics["async/segments"] = float(entry.state.segments)
        return Pending(entry.step, version, groups, metrics, version_bgt)


# ---------------------------------------------------------------------------------------------
# The driver.


class AsyncDriver:
    """The online step of an async (or split-placement) run: ``step(state, iterator, key)``.

    Args:
      collect: ``collect(policy, iterator, key, step) -> (groups, metrics)``, the host's part
        of update step ``step``, sampling with ``policy`` (the rollout weights' ``(graphdef,
        params)``).
      rl_step: the device step of :func:`~jaxrl_llm.train.step.make_rl_step`; its
        ``dispatch(state, groups) -> (state, wait)`` returns before the step is done (``wait()``
        gives the metrics), so the rollout overlaps it.
      to_global: host groups to the train mesh's arrays.
      weights: the rollout side's weights (``sync(params, version)``, ``sampling_policy()``,
        ``version``), see :mod:`jaxrl_llm.train.placement`.
      max_staleness: ``s``.
      max_steps: no batch is generated past it.
      timeline: ``RUN_DIR/timeline.jsonl`` (None: not written, e.g. on processes other than 0).
      partial: segmented sampling (``train.partial_rollout_tokens``), or None.
    """

    def __init__(
        self,
        *,
        collect: Callable[..., tuple],
        rl_step: Any,
        to_global: Callable[[Groups], Any],
        weights: Any,
        max_staleness: int,
        max_steps: int,
        timeline: Path | None = None,
        partial: PartialRollouts | None = None,
    ):
        self.collect, self.rl_step, self.to_global = collect, rl_step, to_global
        self.partial = partial
        self.weights = weights
        self.max_staleness = int(max_staleness)
        self.max_steps = int(max_steps)
        self.timeline = timeline
        self.buffer: collections.deque[Pending | InFlightBatch] = collections.deque()
        self._synced = False
        self._t0 = time.time()

    # -- checkpoint ------------------------------------------------------------------------

    def checkpoint(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """``(host arrays, meta entries)`` of the buffer, saved with the state."""
        arrays, described = buffer_to_host(list(self.buffer))
        return arrays, {BUFFER_META: {"max_staleness": self.max_staleness, "batches": described}}

    def restore(self, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray] | None) -> None:
        """Loads the buffer saved with a checkpoint (nothing when it has none)."""
        saved = meta.get(BUFFER_META)
        self.buffer.clear()
        if not saved or not saved["batches"]:
            return
        entries = buffer_from_host(arrays or {}, saved["batches"])
        if len(entries) > self.max_staleness:
            raise ValueError(
                f"the checkpoint holds {len(entries)} batches generated ahead for "
                f"train.max_staleness={saved['max_staleness']}, more than this run's "
                f"train.max_staleness={self.max_staleness} allows; resume with "
                f"train.max_staleness={saved['max_staleness']}"
            )
        self.buffer.extend(entries)

    # -- the step --------------------------------------------------------------------------

    def _generate(
        self, step: int, iterator: BatchIterator, key: jax.Array, phases: list, *, due: int
    ) -> Pending | InFlightBatch:
        """Batch ``step`` under the current rollout weights: complete, or with partial
        rollouts its first segment (complete if ``step <= due``, the next update's step)."""
        t0 = time.time()
        mark_phase("rollout", step)
        if self.partial is not None:
            entry = self.partial.begin(step, iterator, key)
            return self._continue(entry, iterator, phases, due=due, t0=t0)
        groups, metrics = self.collect(self.weights.sampling_policy(), iterator, key, step)
        version = int(self.weights.version)
        phases.append(self._phase("rollout", t0, for_step=step, version=version))
        return Pending(step, version, groups, metrics)

    def _continue(
        self,
        entry: InFlightBatch,
        iterator: BatchIterator,
        phases: list,
        *,
        due: int,
        t0: float | None = None,
    ) -> Pending | InFlightBatch:
        """One window's segment of an in-flight batch, to its end when it is due at the next
        update (``entry.step <= due``); the scored :class:`Pending` once complete."""
        t0 = time.time() if t0 is None else t0
        version = int(self.weights.version)
        to_end = entry.step <= due
        policy = self.weights.sampling_policy()
        entry = self.partial.advance(entry, iterator, policy, version, to_end=to_end)
        done = to_end or bool(entry.state.done_bg.all())  # the same on every process
        out = self.partial.finish(entry, iterator, policy) if done else entry
        phases.append(self._phase("rollout", t0, for_step=entry.step, version=version))
        return out

    def _phase(self, name: str, t0: float, **extra: Any) -> dict[str, Any]:
        return {"phase": name, "start": t0 - self._t0, "end": time.time() - self._t0, **extra}

    def _sync(self, params: Any, version: int, phases: list) -> dict[str, float]:
        t0 = time.time()
        report = self.weights.sync(params, version)
        phases.append(self._phase("sync", t0, version=int(version)))
        return {
            "sync/seconds": float(report.seconds),
            "sync/bytes": float(report.bytes),
            "sync/arrays": float(report.num_arrays),
            "sync/version": float(report.version),
        }

    def step(
        self, state: st.TrainState, iterator: BatchIterator, key: jax.Array
    ) -> tuple[st.TrainState, dict[str, float]]:
        """One step: ``state`` has its key chain advanced past this step (``key`` is the
        synchronous loop's key of this step's batch)."""
        t = int(state.step) + 1
        s = self.max_staleness
        # the key as host data: it lies with the state on the train mesh, the rollout elsewhere
        key = jax.random.wrap_key_data(np.asarray(jax.device_get(jax.random.key_data(key))))
        rng = np.asarray(jax.device_get(state.rng))  # read now: the step donates the state
        phases: list[dict[str, Any]] = []
        extra: dict[str, float] = {}
        if not self._synced:  # the first step of this process: the rollout gets version t-1
            extra.update(self._sync(state.params, t - 1, phases))
            self._synced = True
        # Batches t .. t+s-1 must exist before update t (a fresh run, or s = 0).
        have = {p.step for p in self.buffer}
        last = min(t + s - 1, self.max_steps) if s else t
        for j in range(t, last + 1):
            if j not in have:
                key_j = key if j == t else key_ahead(rng, j - t - 1)
                self.buffer.append(self._generate(j, iterator, key_j, phases, due=t))
        pending = self.buffer.popleft()
        if isinstance(pending, InFlightBatch):  # due now (a resume with fewer windows left)
            pending = self._continue(pending, iterator, phases, due=t)
        if pending.step != t:
            raise RuntimeError(f"async buffer out of order: batch of step {pending.step} at {t}")
        groups = self.to_global(pending.groups)
        state = state._replace(data_position=np.asarray(iterator.position, np.int32))
        hostmem.release_free_heap()
        mark_phase("update", t)
        t_update = time.time()
        # enqueued: the device runs it while the host samples on
        new_state, wait = self.rl_step.dispatch(state, groups)
        t_dispatched = time.time()
        if dist.one_collective_program_at_a_time():
            # Several CPU processes: gloo pairs collectives by order alone, and XLA:CPU would
            # run the update's cross-process collectives beside the rollout's (the weights'
            # reshard, ...), in a different order on each process ("collective mismatch"
            # aborts, seen in the two-process async test). Finish the update first there.
            done = wait()
            wait = lambda: done
        # this window (update t): batch t + 1 is due next
        for i, entry in enumerate(list(self.buffer)):  # partial rollouts: one more segment each
            if isinstance(entry, InFlightBatch):
                self.buffer[i] = self._continue(entry, iterator, phases, due=t + 1)
        if s and t + s <= self.max_steps:  # overlaps the update on the device
            key_next = key_ahead(rng, s - 1)
            self.buffer.append(self._generate(t + s, iterator, key_next, phases, due=t + 1))
        metrics = wait()
        phases.append(self._phase("update", t_update, step=t, dispatched=t_dispatched - self._t0))
        metrics["time/update"] = time.time() - t_update
        extra.update(self._sync(new_state.params, t, phases))
        metrics.update(pending.metrics)
        metrics.update(extra)
        metrics.update(staleness_metrics(pending, t - 1, s))
        metrics["async/buffered"] = float(len(self.buffer))
        if self.timeline is not None:
            with open(self.timeline, "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": t, "phases": phases}) + "\n")
        return new_state, metrics


__all__ = [
    "BUFFER_META",
    "TIMELINE_FILE",
    "AsyncDriver",
    "Pending",
    "buffer_from_host",
    "buffer_to_host",
    "key_ahead",
    "staleness_metrics",
]
