"""The RL loop: ``train(config) -> final metrics``, ``evaluate(config)`` and ``export``.

One training step, in the shape of purejaxrl's ``train``::

    groups  = collect(setup, params, prompts, key)   # host: generate, score, PODS / DAPO refill
    state   = rl_step(state, groups)                  # device, one jit: π_old / π_ref / V, the
                                                      # advantage chain, value targets, update
    log; maybe checkpoint; maybe evaluate

:mod:`~jaxrl_llm.train.setup` resolves the config once; :mod:`~jaxrl_llm.train.collect` is the
host's part and :mod:`~jaxrl_llm.train.step` the device's. ``dpo`` runs the same loop on
preference pairs (no generation, no rewards): the reference's log-probs are computed as the pairs
are batched and :func:`~jaxrl_llm.train.update.make_dpo_step` updates; its evaluation is the
preference accuracy on held-out pairs, plus the generation accuracy when the pairs come with
answers.

A run directory holds ``config.yaml`` (the resolved config), ``metrics.jsonl``,
``tensorboard/``, ``checkpoints/``, ``curves.png`` and ``export/``. Calling :func:`train` on a
directory with checkpoints resumes from the latest one: the state carries the PRNG key, the
data position and the advantage chain's state (an adaptive KL controller), so the resumed run
computes exactly what an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxrl_llm import distributed as dist
from jaxrl_llm import memory_maps
from jaxrl_llm.config import (
    ConfigError,
    TrainConfig,
    build_recipe,
    save_config,
    to_dict,
    to_yaml,
)
from jaxrl_llm.data import BatchIterator
from jaxrl_llm.train import asynchronous, forward, hostmem, rundir
from jaxrl_llm.train import state as st
from jaxrl_llm.train import update as up
from jaxrl_llm.train.checkpoint import HOST_ARRAYS, Checkpointer
from jaxrl_llm.train.collect import collect, dpo_batch, to_global
from jaxrl_llm.train.completions import CompletionLog
from jaxrl_llm.train.evaluation import run_evaluation
from jaxrl_llm.train.faults import (
    NonFiniteUpdateError,
    StopSignals,
    TrainingInterrupted,
    mark_phase,
)
from jaxrl_llm.train.metrics import MetricsLogger, NullLogger, plot_run
from jaxrl_llm.train.setup import (
    ADAPTER_DIR,
    CHECKPOINT_DIR,
    CONFIG_FILE,
    EXPORT_DIR,
    PAD_MULTIPLE,
    CheckpointPlan,
    Setup,
    resolve,
)
from jaxrl_llm.train.step import make_rl_step

FLOAT32_MAX = float(np.finfo(np.float32).max)


StepFn = Callable[[st.TrainState, BatchIterator, jax.Array], tuple[st.TrainState, dict]]

# ---------------------------------------------------------------------------------------------
# The pieces the loop calls.


def checkpointer(plan: CheckpointPlan) -> Checkpointer:
    """The run's orbax checkpoint manager."""
    return Checkpointer(plan.directory, max_to_keep=plan.keep, save_every=plan.save_every)


def reference_logprob_fn(setup: Setup) -> Callable[..., jax.Array]:
    """The jitted log-prob pass of the policy's architecture (DPO's reference and evaluation)."""
    return forward.make_logprob_fn(
        setup.models.graphdef, micro_batch_size=setup.update.micro_batch_size
    )


def make_train_step(
    setup: Setup, logprob: Callable[..., jax.Array], completions: CompletionLog | None = None
) -> StepFn:
    """``step(state, iterator, key) -> (state, metrics)``: the host's part of a step, then the
    device step (the RL step, or DPO's update on a batch of pairs). ``completions`` records the
    host groups of an online step before its update."""
    models, update = setup.models, setup.update
    if setup.offline:
        dpo_step = up.make_dpo_step(
            setup.recipe,
            models.graphdef,
            models.tx,
            schedule=models.schedule,
            ppo_epochs=update.epochs,
            num_minibatches=update.num_minibatches,
            micro_batch_size=update.micro_batch_size,
            mesh=models.mesh,
            state_sharding=models.state_sharding,
            rules=models.rules,
            frozen=models.frozen,
        )

        def offline(
            state: st.TrainState, iterator: BatchIterator, key: jax.Array
        ) -> tuple[st.TrainState, dict[str, float]]:
            del key
            batch, metrics = dpo_batch(models, iterator.next_batch(), logprob)
            state, device_metrics = _timed(dpo_step, _positioned(state, iterator), batch)
            return state, {**metrics, **device_metrics}

        return offline

    rl_step = _rl_step(setup)

    def online(
        state: st.TrainState, iterator: BatchIterator, key: jax.Array
    ) -> tuple[st.TrainState, dict[str, float]]:
        groups, metrics = collect(setup, state.params, iterator, key, step=int(state.step) + 1)
        if completions is not None:
            completions.record(groups)
        groups = to_global(models, groups)
        state, device_metrics = _timed(rl_step, _positioned(state, iterator), groups)
        return state, {**metrics, **device_metrics}

    return online


def _rl_step(setup: Setup) -> Callable:
    return make_rl_step(
        setup.recipe,
        setup.models,
        setup.update,
        temperature=setup.sampler.temperature,
        old_logprobs=setup.old_logprobs,
    )


def is_async(setup: Setup) -> bool:
    """Whether the run's online steps go through the async driver: a split placement, or
    ``train.max_staleness > 0`` (:mod:`~jaxrl_llm.train.asynchronous`)."""
    if setup.offline:
        return False
    return setup.placement.split or setup.loop.max_staleness > 0


def _recorded_to_global(models: Any, completions: CompletionLog | None, groups: Any) -> Any:
    if completions is not None:
        completions.record(groups)
    return to_global(models, groups)


def make_async_driver(
    setup: Setup, *, timeline: Path | None = None, completions: CompletionLog | None = None
) -> asynchronous.AsyncDriver:
    """The async driver of an online run (its rollout weights on the placement's rollout mesh,
    or a colocated copy); ``completions`` records each step's host groups before its update."""
    from jaxrl_llm.train import placement

    models = setup.models
    weights = placement.RolloutWeights.build(models, setup.placement)

    n = setup.loop.partial_rollout_tokens
    partial = asynchronous.PartialRollouts(setup, n) if n > 0 else None

    def collect_with(policy: Any, iterator: BatchIterator, key: jax.Array, step: int) -> tuple:
        return collect(setup, None, iterator, key, policy=policy, step=step)

    return asynchronous.AsyncDriver(
        collect=collect_with,
        rl_step=_rl_step(setup),
        to_global=functools.partial(_recorded_to_global, models, completions),
        weights=weights,
        max_staleness=setup.loop.max_staleness,
        max_steps=setup.loop.max_steps,
        timeline=timeline,
        partial=partial,
    )


def _positioned(state: st.TrainState, iterator: BatchIterator) -> st.TrainState:
    """The state with the data position after this step's prompts (saved with it)."""
    return state._replace(data_position=np.asarray(iterator.position, np.int32))


def _timed(fn: Callable, state: st.TrainState, batch: Any) -> tuple:
    """Runs the device step, waiting for its metrics; adds ``time/update``."""
    t0 = time.perf_counter()
    hostmem.release_free_heap()
    mark_phase("update", int(state.step) + 1)
    state, out = fn(state, batch)
    out = {k: float(np.asarray(v)) for k, v in jax.device_get(out).items()}
    out["time/update"] = time.perf_counter() - t0
    return state, out


def _step_metrics(metrics: dict[str, float], t_step: float) -> dict[str, float]:
    metrics["time/step"] = time.perf_counter() - t_step
    metrics["perf/tokens_per_s"] = metrics["perf/tokens"] / metrics["time/step"]
    metrics["perf/peak_rss_gib"] = hostmem.peak_rss_gib()
    if "actor/kl_ref" in metrics:
        metrics["kl"] = metrics["actor/kl_ref"]
    elif "kl/rollout" in metrics:
        metrics["kl"] = metrics["kl/rollout"]
    return metrics


def _explain_rows(setup: Setup) -> list[tuple[str, str]]:
    """The ``explain`` table as ``(question, answer)`` rows, for the trackers."""
    from jaxrl_llm.explain import QUESTIONS, explain

    answers = explain(setup.recipe)
    return [(question, getattr(answers, field)) for field, question in QUESTIONS]


def _print_header(setup: Setup, log: Callable) -> None:
    from jaxrl_llm.explain import explain, format_explanation

    log(format_explanation(explain(setup.recipe)))
    for note in setup.data.notes:
        log(note)
    if not setup.offline and setup.loop.max_staleness > 0:
        s = setup.loop.max_staleness
        correction = getattr(setup.recipe.objective, "rollout_correction", None)
        if correction is None:
            log(
                f"async (train.max_staleness={s}): samples are up to {s} policy versions old "
                f"and {setup.recipe.name} has no rollout correction: the update treats them as "
                "on-policy (docs/async.md)"
            )
        else:
            log(
                f"async (train.max_staleness={s}): samples are up to {s} policy versions old, "
                f"corrected by rollout_correction mode={correction.mode} "
                f"level={correction.level} (docs/async.md)"
            )


def _resolve_run(
    config: TrainConfig, run_dir: str | Path | None, max_steps: int | None
) -> tuple[TrainConfig, Setup]:
    if max_steps is not None:
        config = dataclasses.replace(
            config, train=dataclasses.replace(config.train, max_steps=int(max_steps))
        )
    run_dir = rundir.run_dir_path(run_dir, config.run_dir)
    config = dataclasses.replace(config, run_dir=str(run_dir))
    return config, resolve(config, run_dir)


# ---------------------------------------------------------------------------------------------
# The loop.


def train(
    config: TrainConfig,
    *,
    run_dir: str | Path | None = None,
    max_steps: int | None = None,
    progress: bool = True,
    log: Callable[..., None] = print,
    overwrite: bool = False,
) -> dict[str, float]:
    """Trains (or resumes) the run of ``config`` in ``run_dir``; returns the final metrics.

    Before anything is loaded the run directory is checked and locked
    (:mod:`~jaxrl_llm.train.rundir`: one writer; a run that cannot be resumed is refused unless
    ``overwrite``). SIGTERM / SIGINT stop the loop after its step with a checkpoint
    (:mod:`~jaxrl_llm.train.faults`).

    Args:
      config: the resolved config.
      run_dir: the run directory (default ``config.run_dir``); existing checkpoints resume.
      max_steps: overrides ``train.max_steps`` (also the schedules' horizon).
      progress: show the progress bar.
      log: where the header and notes are printed.
      overwrite: delete the run directory's previous run (its checkpoints, metrics, export)
        and start at step 0.

    Raises:
      RunDirError: the run directory cannot be used (see :mod:`~jaxrl_llm.train.rundir`).
      TrainingInterrupted: a signal stopped the run; its checkpoint is saved.
      NonFiniteUpdateError: a NaN / inf update with ``train.on_nonfinite: raise``.
    """
    directory = rundir.run_dir_path(run_dir, config.run_dir)
    primary = dist.is_primary()  # with several processes, process 0 alone logs and writes files
    quiet_log = log if primary else (lambda *_: None)
    with rundir.open_run(
        directory,
        overwrite=overwrite,
        primary=primary,
        multiprocess=jax.process_count() > 1,
        log=quiet_log,
    ):
        return _train_locked(config, directory, max_steps, progress, quiet_log, primary)


def _train_locked(
    config: TrainConfig,
    run_dir: Path,
    max_steps: int | None,
    progress: bool,
    log: Callable[..., None],
    primary: bool,
) -> dict[str, float]:
    config, setup = _resolve_run(config, run_dir, max_steps)
    setup.run_dir.mkdir(parents=True, exist_ok=True)
    plan = setup.loop
    ckpt = checkpointer(setup.checkpoint)
    iterator = BatchIterator(
        setup.data.train,
        plan.batch_size,
        seed=plan.data_seed,
        shuffle=plan.shuffle,
        pad_multiple=PAD_MULTIPLE,
    )
    state, start, skipped, meta = _resume(ckpt, setup, iterator, config, log)
    completions = None
    if primary and plan.log_completions:
        completions = CompletionLog(
            setup.run_dir,
            setup.tokenizer,
            num_groups=plan.log_completions,
            log_every=plan.log_every,
            max_steps=plan.max_steps,
            start_step=start,
            stop_ids=setup.sampler.stop_ids,
        )
    driver = None
    if is_async(setup):
        timeline = setup.run_dir / asynchronous.TIMELINE_FILE if primary else None
        driver = make_async_driver(setup, timeline=timeline, completions=completions)
        try:
            driver.restore(meta, meta.get(HOST_ARRAYS))
        except ValueError as e:
            raise rundir.RunDirError(f"cannot resume {setup.run_dir}: {e}") from e

    def save(step: int, state: st.TrainState) -> None:
        host, extra = driver.checkpoint() if driver is not None else (None, {})
        ckpt.save(step, state, meta=_meta(config, iterator, skipped) | extra, host=host)

    # A resumed run rewrites config.yaml only once its first step has succeeded, so a launch that
    # fails (a bad override, a reward that raises) leaves the run's previous config in place.
    config_pending = primary
    if config_pending and start == 0:
        save_config(config, setup.run_dir / CONFIG_FILE)
        config_pending = False
    mark_phase("start", start)
    hostmem.release_after_compiles()
    _print_header(setup, log)
    logprob = reference_logprob_fn(setup)
    train_step = driver.step if driver is not None else make_train_step(setup, logprob, completions)
    evaluating = bool(setup.data.eval_prompts or setup.data.eval_pairs)
    evaluate_every = setup.evaluation.every

    def evaluate_at(step: int, params: dict, logger: MetricsLogger) -> dict[str, float]:
        samples = [] if completions is not None else None
        ev = run_evaluation(setup, params, step=step, logprob=logprob, samples=samples)  # K: plan's
        if samples:
            completions.write(samples)
        logger.log(step, ev)  # all keys, the pass@k / maj@K intervals too
        logger.write(_format_eval(step, {k: v for k, v in ev.items() if "_ci_" not in k}))
        return ev

    final: dict[str, float] = {}
    step = start
    stop, saved = StopSignals(), False
    preempted = False
    try:
        stop.install()  # SIGTERM / SIGINT: stop after the step, with a checkpoint
        with (MetricsLogger if primary else NullLogger)(
            setup.run_dir,
            max_steps=plan.max_steps,
            start_step=start,
            progress=progress,
            tracking=setup.tracking,
            run_config=to_dict(config),
            explanation=_explain_rows(setup),
        ) as logger:
            if completions is not None:
                completions.sink = logger.log_completions  # the trackers' tables
            if evaluating and start == 0:
                evaluate_at(0, state.params, logger)
            while step < plan.max_steps:
                if _stop_requested(stop):
                    _stop(stop, step, state, ckpt, setup, primary, save)
                t_step = time.perf_counter()
                hostmem.release_free_heap()  # see hostmem: lowers the host peak on CPU
                memory_maps.relieve(where="jaxrl-llm train")  # XLA:CPU's compiled programs
                mark_phase("rollout", step + 1)
                state, key = _split_key(state)
                if completions is not None:
                    completions.step = step + 1
                state, metrics = train_step(state, iterator, key)  # collect, then the device step
                step = int(state.step)
                nonfinite = metrics.get("update/nonfinite", 0) > 0
                if nonfinite and plan.on_nonfinite == "raise":  # before anything is written
                    raise NonFiniteUpdateError(_nonfinite_message(step, metrics, setup.run_dir))
                skipped += int(nonfinite)
                if nonfinite and plan.on_nonfinite == "skip":
                    logger.write(
                        f"step {step}: non-finite loss or gradient, update skipped (parameters "
                        f"and optimizer state unchanged; {skipped} steps skipped so far)"
                    )
                metrics = _step_metrics(metrics, t_step) | {"train/skipped_steps": skipped}
                if not preempted and metrics.get("rollout/preemptions", 0) > 0:
                    preempted = True  # once a run, as vLLM warns of its first preemption
                    logger.write(_preemption_message(step, metrics))
                if step % plan.log_every == 0 or step == plan.max_steps:
                    logger.log(step, metrics)
                logger.progress(step, metrics)
                final = metrics
                if config_pending:
                    save_config(config, setup.run_dir / CONFIG_FILE)
                    config_pending = False
                if ckpt.should_save(step, final=step == plan.max_steps):
                    hostmem.release_free_heap()  # on CPU the save copies the state to host
                    save(step, state)
                    mark_phase("save", step)
                    saved = True
                    if primary:  # the steps before this one are on disk now
                        rundir.record_checkpointed(setup.run_dir)
                last = step == plan.max_steps
                if evaluating and (last or (evaluate_every and step % evaluate_every == 0)):
                    final = {**final, **evaluate_at(step, state.params, logger)}
            if ckpt.should_save(step, final=True):
                save(step, state)
                saved = True
    finally:
        stop.uninstall()
        ckpt.close()  # waits for pending saves, also when interrupted
        if primary and saved:
            rundir.record_checkpointed(setup.run_dir)
    export_policy(setup, state.params)
    if primary:
        plot_run(setup.run_dir)
    final = dict(final)
    final["step"] = step
    return final


def _stop_requested(stop: StopSignals) -> bool:
    """Whether a signal asked to stop, on any process (all processes agree: every process must
    call it, as a collective; over the coordination service, so it does not wait for devices)."""
    signum = stop.signum or 0
    if jax.process_count() > 1:
        signum = int(np.max(dist.host_allgather(np.int32(signum), what="stop signal")))
        if signum and stop.signum is None:
            stop.signum = signum
    return bool(signum)


def _stop(
    stop: StopSignals,
    step: int,
    state: st.TrainState,
    ckpt: Checkpointer,
    setup: Setup,
    primary: bool,
    save: Callable[[int, st.TrainState], None],
) -> None:
    """Saves the checkpoint of ``step`` (unless saved already), waits until it is on disk and
    raises :class:`TrainingInterrupted`."""
    import signal

    if ckpt.should_save(step, final=True) and step > 0:
        save(step, state)
        mark_phase("save", step)
    ckpt.wait()
    if primary:
        rundir.record_checkpointed(setup.run_dir)
    name = signal.Signals(stop.signum).name
    saved = ckpt.latest_step()
    where = (
        f"checkpoint step {saved} is in {setup.checkpoint.directory / str(saved)}"
        if saved is not None
        else "no step was done, nothing to save"
    )
    raise TrainingInterrupted(
        f"stopped by {name} after step {step}: {where}. Rerun the same command to resume "
        f"(exit status {128 + stop.signum}).",
        signum=stop.signum,
        step=step,
    )


def _nonfinite_message(step: int, metrics: dict[str, float], run_dir: Path) -> str:
    huge = {
        k: v
        for k, v in metrics.items()
        if k.startswith("reward/") and not (abs(v) <= FLOAT32_MAX)  # inf, NaN, or > float32
    }
    hint = ""
    if huge:
        shown = ", ".join(f"{k}={v:.3g}" for k, v in list(huge.items())[:3])
        hint = (
            f" The rewards are out of float32's range (|r| <= {FLOAT32_MAX:.3g}), in which the "
            f"advantages are computed: {shown}. Scale or clip the reward."
        )
    return (
        f"step {step}: non-finite loss or gradient; the update was skipped and nothing of step "
        f"{step} was written (no metrics line, no checkpoint; {run_dir} holds the run as it was "
        f"after the previous step).{hint} Set train.on_nonfinite=skip to continue past such "
        "batches."
    )


def _resume(
    ckpt: Checkpointer, setup: Setup, iterator: BatchIterator, config: TrainConfig, log: Callable
) -> tuple[st.TrainState, int, int, dict[str, Any]]:
    """``(state, start step, skipped steps, meta)``: the latest checkpoint's, with the data
    stream moved to its position, or the fresh state (and an empty meta)."""
    if ckpt.latest_step() is None:
        return setup.state, 0, 0, {}
    try:
        state, meta = ckpt.restore(setup.state, setup.state_sharding)
    except FileNotFoundError as e:  # every step unreadable: moved aside, none left
        raise rundir.RunDirError(f"{e}. {rundir.START_OVER}") from e
    try:
        iterator.load_state_dict(meta["data"])
        saved = meta.get("data_fingerprint")
        if saved is not None and saved != data_fingerprint(iterator.dataset):
            raise ValueError(
                f"the training examples differ from the ones the checkpoint was trained on "
                f"(the same number, {len(iterator.dataset)}, but other prompts or order)"
            )
    except ValueError as e:
        raise rundir.RunDirError(
            f"cannot resume {setup.run_dir} from step {int(state.step)}: {e}. The checkpoint's "
            "data position counts examples of the data it was trained on: resume with the same "
            f"data (see {setup.run_dir / CONFIG_FILE}), or train the new data in a new run. "
            + rundir.START_OVER
        ) from e
    start = int(state.step)
    log(f"resuming {setup.run_dir} from step {start}")
    changes = config_changes(meta.get("config"), config)
    if changes:
        log("config changed since the checkpoint: " + "; ".join(changes[:10]))
    return state, start, int(meta.get("skipped_steps", 0)), meta


def _split_key(state: st.TrainState) -> tuple[st.TrainState, jax.Array]:
    """The state with its PRNG key advanced, and this step's key."""
    key, step_key = jax.random.split(jax.random.wrap_key_data(state.rng))
    return state._replace(rng=jax.random.key_data(key)), step_key


def _meta(config: TrainConfig, iterator: BatchIterator, skipped: int = 0) -> dict[str, Any]:
    return {
        "data": iterator.state_dict(),
        "data_fingerprint": data_fingerprint(iterator.dataset),
        "config": to_yaml(config),
        "skipped_steps": skipped,
    }


def _preemption_message(step: int, metrics: dict[str, float]) -> str:
    """The warning of a rollout's first preemption (metrics: :func:`collect.kv_metrics`)."""
    return (
        f"step {step}: the rollout's KV-cache pool ({metrics['rollout/kv_pool_gib']:.3g} GiB "
        "per engine) could not hold every live sequence: "
        f"{metrics['rollout/preemptions']:.0f} sequences were preempted and recomputed, which "
        "slows the rollout (the tokens sampled are the same). A larger pool avoids it "
        "(rollout.memory_utilization on a GPU/TPU, rollout.max_total_tokens), as do fewer "
        "sequences at once (rollout.max_num_seqs); the metrics rollout/preemptions and "
        "rollout/kv_usage_peak follow it"
    )


def data_fingerprint(dataset: Any) -> str | None:
    """sha256 of the training examples' token ids (prompts; a preference set's chosen and
    rejected too), in order: what a checkpoint's data position indexes. ``None`` for a dataset
    without token ids. Resuming on other data of the same size is refused with it."""
    parts = [
        getattr(dataset, name)
        for name in ("prompt_ids", "chosen_ids", "rejected_ids")
        if isinstance(getattr(dataset, name, None), list | tuple)
    ]
    if not parts:
        return None
    import hashlib

    digest = hashlib.sha256()
    for ids in parts:
        lengths = np.asarray([len(x) for x in ids], np.int64)
        digest.update(lengths.tobytes())
        if len(ids):
            digest.update(np.concatenate([np.asarray(x, np.int64) for x in ids]).tobytes())
    return digest.hexdigest()


def _format_eval(step: int, ev: dict[str, float]) -> str:
    parts = [
        f"{k.split('/', 1)[1]}={v:.4g}"
        for k, v in ev.items()
        if k != "eval/time" and k != "eval/num_prompts"
    ]
    return f"eval @ step {step}: " + ", ".join(parts)


def config_changes(saved_yaml: str | None, config: TrainConfig) -> list[str]:
    """``key: old -> new`` for every setting that differs from a checkpoint's config."""
    if not saved_yaml:
        return []
    import yaml

    def flat(d: dict, prefix: str = "") -> dict[str, Any]:
        out = {}
        for k, v in d.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict):
                out.update(flat(v, key + "."))
            else:
                out[key] = v
        return out

    old = flat(yaml.safe_load(saved_yaml) or {})
    new = flat(yaml.safe_load(to_yaml(config)) or {})
    return [
        f"{k}: {old.get(k)!r} -> {new.get(k)!r}"
        for k in sorted(set(old) | set(new))
        if old.get(k) != new.get(k) and k != "run_dir"
    ]


# ---------------------------------------------------------------------------------------------
# evaluate / export.


def export_policy(
    setup: Setup,
    params: dict,
    out: str | Path | None = None,
    *,
    critic_params: dict | None = None,
) -> Path:
    """Writes the policy with ``params`` as a Hugging Face folder (default RUN_DIR/export).

    The model files of a previous export there are removed first (a stale shard index would
    load the old weights); a folder holding something else, a file, or ``RUN_DIR/export`` as a
    symlink is refused (:func:`~jaxrl_llm.train.rundir.prepare_export_dir`).

    ``critic_params`` (a PPO run's): the critic is written too, to ``<out>/critic``, as the
    value model ``transformers.AutoModelForSequenceClassification`` (one label) loads and
    ``critic.path`` starts a run from (a LoRA critic merged into its trunk), as verl keeps its
    critic's Hugging Face folder and OpenRLHF's ``--save_value_network`` saves it."""
    from jaxrl_llm.models import lora, save_pretrained
    from jaxrl_llm.models.hub import read_generation_config

    default = out is None
    out = Path(out).expanduser().absolute() if out is not None else setup.run_dir / EXPORT_DIR
    if dist.is_primary():
        rundir.prepare_export_dir(out, default=default)
        if critic_params is not None:
            rundir.prepare_export_dir(out / rundir.CRITIC_EXPORT_DIR, default=False)
    policy = setup.policy(params)
    models = setup.models
    if critic_params is not None:
        critic = setup.models.critic(critic_params)
        if models.critic_frozen is not None:
            critic = lora.merge_into_base(critic)
        save_pretrained(critic, out / rundir.CRITIC_EXPORT_DIR, tokenizer=setup.tokenizer)
    if models.lora is not None:  # LoRA: the adapter in PEFT's format, then the merged model
        from jaxrl_llm.models import peft

        # Every process joins the gathers of sharded adapters; process 0 alone writes.
        peft.save_adapter(
            policy,
            setup.run_dir / ADAPTER_DIR,
            config=models.lora,
            base_model_name_or_path=models.base_path,
        )
        policy = lora.merge_into_base(policy)
    # The source's sampling defaults and end-of-turn ids go with the weights, as in HF's
    # save_pretrained (a GGUF source has none to copy).
    generation, _ = read_generation_config(models.base_path)
    return save_pretrained(
        policy, out, tokenizer=setup.tokenizer, generation_config=generation or None
    )


def _restored(
    config: TrainConfig, run_dir: str | Path | None, log: Callable
) -> tuple[Setup, st.TrainState]:
    directory = rundir.run_dir_path(run_dir, config.run_dir)
    rundir.check_run_dir(directory, writing=False)
    setup = resolve(config, directory)
    state = setup.state
    if setup.checkpoint.directory.exists():
        with checkpointer(setup.checkpoint) as ckpt:
            if ckpt.latest_step() is not None:
                state, _ = ckpt.restore(setup.state, setup.state_sharding)
                log(f"restored step {int(state.step)} from {setup.checkpoint.directory}")
    else:
        log(f"no checkpoint in {setup.run_dir}: using the initial weights")
    return setup, state


def evaluate(
    config: TrainConfig,
    *,
    run_dir: str | Path | None = None,
    mode: str | None = None,
    max_new_tokens: int | None = None,
    num_samples: int | None = None,
    log: Callable[..., None] = print,
    samples: list[dict] | None = None,
    show: int = 0,
) -> dict[str, float]:
    """Held-out accuracy / mean reward (and dpo preference accuracy) of the latest checkpoint
    in ``run_dir`` (the initial weights without one); ``mode``: greedy or sampled.

    ``num_samples`` K (default ``train.eval_num_samples``): K > 1 samples K completions per
    prompt and adds ``eval/mean@K``, ``eval/best@K``, ``eval/pass@k`` (k = 1, 2, 4, ... ≤ K
    and K), ``eval/maj@K``, each with ``_ci_low`` / ``_ci_high``, and ``eval/num_samples``
    (:mod:`~jaxrl_llm.train.eval_metrics`). ``samples`` receives the first ``show`` held-out
    prompts with their completions (:func:`~jaxrl_llm.train.completions.eval_records`)."""
    setup, state = _restored(config, run_dir, log)
    return run_evaluation(
        setup,
        state.params,
        step=int(state.step),
        logprob=reference_logprob_fn(setup),
        mode=mode,
        max_new_tokens=max_new_tokens,
        num_samples=num_samples,
        samples=samples,
        show=show,
    )


def export(
    config: TrainConfig,
    *,
    run_dir: str | Path | None = None,
    out: str | Path | None = None,
    log: Callable[..., None] = print,
    critic: bool = False,
) -> Path:
    """Exports the latest checkpoint of ``run_dir`` as a Hugging Face folder; ``critic``: the
    run's critic too, to ``<out>/critic`` (see :func:`export_policy`).

    Raises ``FileNotFoundError`` when ``run_dir`` has no checkpoint (nothing was trained), and
    ``ConfigError`` for ``critic`` when the run's recipe has no critic.
    """
    directory = rundir.run_dir_path(run_dir, config.run_dir)
    rundir.check_run_dir(directory, writing=False)
    ckpt_dir = directory / CHECKPOINT_DIR
    if not rundir.step_folders(ckpt_dir):
        raise FileNotFoundError(
            f"no checkpoint in {ckpt_dir} to export; train the run first (or check --run-dir)"
        )
    target = Path(out).expanduser().absolute() if out is not None else directory / EXPORT_DIR
    primary = dist.is_primary()
    if critic and getattr(build_recipe(config), "critic", None) is None:
        raise ConfigError(
            f"--critic: the run in {directory} has no critic to export (algorithm.name = "
            f"{config.algorithm.name!r}; only recipes with a value model, e.g. ppo, have one)",
            "algorithm.name",
        )
    if primary:  # before loading: a refused folder costs nothing
        rundir.check_export_dir(target, default=out is None)
        if critic:
            rundir.check_export_dir(target / rundir.CRITIC_EXPORT_DIR, default=False)
    with rundir.locked(directory, primary=primary, multiprocess=jax.process_count() > 1):
        setup, state = _restored(config, directory, log)
        if not critic and state.critic_params is not None:
            log("the run's critic is not exported; add --critic to write it to <out>/critic")
        return export_policy(
            setup, state.params, out, critic_params=state.critic_params if critic else None
        )


__all__ = [
    "CONFIG_FILE",
    "checkpointer",
    "config_changes",
    "evaluate",
    "export",
    "export_policy",
    "make_train_step",
    "train",
]
