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
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxrl_llm import distributed as dist
from jaxrl_llm.config import TrainConfig, save_config, to_yaml
from jaxrl_llm.data import BatchIterator
from jaxrl_llm.train import forward, hostmem
from jaxrl_llm.train import state as st
from jaxrl_llm.train import update as up
from jaxrl_llm.train.checkpoint import Checkpointer
from jaxrl_llm.train.collect import collect, dpo_batch, to_global
from jaxrl_llm.train.evaluation import run_evaluation
from jaxrl_llm.train.faults import mark_phase
from jaxrl_llm.train.metrics import MetricsLogger, NullLogger, plot_run
from jaxrl_llm.train.setup import (
    CHECKPOINT_DIR,
    CONFIG_FILE,
    EXPORT_DIR,
    PAD_MULTIPLE,
    CheckpointPlan,
    Setup,
    resolve,
)
from jaxrl_llm.train.step import make_rl_step

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


def make_train_step(setup: Setup, logprob: Callable[..., jax.Array]) -> StepFn:
    """``step(state, iterator, key) -> (state, metrics)``: the host's part of a step, then the
    device step (the RL step, or DPO's update on a batch of pairs)."""
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
        )

        def offline(
            state: st.TrainState, iterator: BatchIterator, key: jax.Array
        ) -> tuple[st.TrainState, dict[str, float]]:
            del key
            batch, metrics = dpo_batch(models, iterator.next_batch(), logprob)
            state, device_metrics = _timed(dpo_step, _positioned(state, iterator), batch)
            return state, {**metrics, **device_metrics}

        return offline

    rl_step = make_rl_step(
        setup.recipe,
        models,
        update,
        temperature=setup.sampler.temperature,
        old_logprobs=setup.old_logprobs,
    )

    def online(
        state: st.TrainState, iterator: BatchIterator, key: jax.Array
    ) -> tuple[st.TrainState, dict[str, float]]:
        groups, metrics = collect(setup, state.params, iterator, key)
        groups = to_global(models, groups)
        state, device_metrics = _timed(rl_step, _positioned(state, iterator), groups)
        return state, {**metrics, **device_metrics}

    return online


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


def _print_header(setup: Setup, log: Callable) -> None:
    from jaxrl_llm.explain import explain, format_explanation

    log(format_explanation(explain(setup.recipe)))
    for note in setup.data.notes:
        log(note)


def _resolve_run(
    config: TrainConfig, run_dir: str | Path | None, max_steps: int | None
) -> tuple[TrainConfig, Setup]:
    if max_steps is not None:
        config = dataclasses.replace(
            config, train=dataclasses.replace(config.train, max_steps=int(max_steps))
        )
    run_dir = Path(run_dir or config.run_dir or "").expanduser()
    if not str(run_dir):
        raise ValueError("train: give a run directory (--run-dir or run_dir in the config)")
    config = dataclasses.replace(config, run_dir=str(run_dir.absolute()))
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
) -> dict[str, float]:
    """Trains (or resumes) the run of ``config`` in ``run_dir``; returns the final metrics.

    Args:
      config: the resolved config.
      run_dir: the run directory (default ``config.run_dir``); existing checkpoints resume.
      max_steps: overrides ``train.max_steps`` (also the schedules' horizon).
      progress: show the progress bar.
      log: where the header and notes are printed.
    """
    config, setup = _resolve_run(config, run_dir, max_steps)
    primary = dist.is_primary()  # with several processes, process 0 alone logs and writes files
    log = log if primary else (lambda *_: None)
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
    state, start, skipped = _resume(ckpt, setup, iterator, config, log)
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
    train_step = make_train_step(setup, logprob)
    evaluating = bool(setup.data.eval_prompts or setup.data.eval_pairs)
    evaluate_every = setup.evaluation.every

    def evaluate_at(step: int, params: dict, logger: MetricsLogger) -> dict[str, float]:
        ev = run_evaluation(setup, params, step=step, logprob=logprob)  # K: the plan's
        logger.log(step, ev)  # all keys, the pass@k / maj@K intervals too
        logger.write(_format_eval(step, {k: v for k, v in ev.items() if "_ci_" not in k}))
        return ev

    final: dict[str, float] = {}
    step = start
    try:
        with (MetricsLogger if primary else NullLogger)(
            setup.run_dir, max_steps=plan.max_steps, start_step=start, progress=progress
        ) as logger:
            if evaluating and start == 0:
                evaluate_at(0, state.params, logger)
            while step < plan.max_steps:
                t_step = time.perf_counter()
                hostmem.release_free_heap()  # see hostmem: lowers the host peak on CPU
                mark_phase("rollout", step + 1)
                state, key = _split_key(state)
                state, metrics = train_step(state, iterator, key)  # collect, then the device step
                step = int(state.step)
                nonfinite = metrics.get("update/nonfinite", 0) > 0
                skipped += int(nonfinite)
                if nonfinite and plan.on_nonfinite == "skip":
                    logger.write(
                        f"step {step}: non-finite loss or gradient, update skipped (parameters "
                        f"and optimizer state unchanged; {skipped} steps skipped so far)"
                    )
                metrics = _step_metrics(metrics, t_step) | {"train/skipped_steps": skipped}
                if step % plan.log_every == 0 or step == plan.max_steps:
                    logger.log(step, metrics)
                logger.progress(step, metrics)
                final = metrics
                if config_pending:
                    save_config(config, setup.run_dir / CONFIG_FILE)
                    config_pending = False
                if nonfinite and plan.on_nonfinite == "raise":
                    raise FloatingPointError(
                        f"step {step}: non-finite loss or gradient; the update was skipped and the "
                        f"parameters are unchanged (metrics in {logger.path}). Set "
                        "train.on_nonfinite=skip to continue past such batches."
                    )
                if ckpt.should_save(step, final=step == plan.max_steps):
                    hostmem.release_free_heap()  # on CPU the save copies the state to host
                    ckpt.save(step, state, meta=_meta(config, iterator, skipped))
                    mark_phase("save", step)
                last = step == plan.max_steps
                if evaluating and (last or (evaluate_every and step % evaluate_every == 0)):
                    final = {**final, **evaluate_at(step, state.params, logger)}
            if ckpt.should_save(step, final=True):
                ckpt.save(step, state, meta=_meta(config, iterator, skipped))
    finally:
        ckpt.close()  # waits for pending saves, also when interrupted
    export_policy(setup, state.params)
    if primary:
        plot_run(setup.run_dir)
    final = dict(final)
    final["step"] = step
    return final


def _resume(
    ckpt: Checkpointer, setup: Setup, iterator: BatchIterator, config: TrainConfig, log: Callable
) -> tuple[st.TrainState, int, int]:
    """``(state, start step, skipped steps)``: the latest checkpoint's, with the data stream
    moved to its position, or the fresh state."""
    if ckpt.latest_step() is None:
        return setup.state, 0, 0
    state, meta = ckpt.restore(setup.state, setup.state_sharding)
    iterator.load_state_dict(meta["data"])
    start = int(state.step)
    log(f"resuming {setup.run_dir} from step {start}")
    changes = config_changes(meta.get("config"), config)
    if changes:
        log("config changed since the checkpoint: " + "; ".join(changes[:10]))
    return state, start, int(meta.get("skipped_steps", 0))


def _split_key(state: st.TrainState) -> tuple[st.TrainState, jax.Array]:
    """The state with its PRNG key advanced, and this step's key."""
    key, step_key = jax.random.split(jax.random.wrap_key_data(state.rng))
    return state._replace(rng=jax.random.key_data(key)), step_key


def _meta(config: TrainConfig, iterator: BatchIterator, skipped: int = 0) -> dict[str, Any]:
    return {"data": iterator.state_dict(), "config": to_yaml(config), "skipped_steps": skipped}


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


def export_policy(setup: Setup, params: dict, out: str | Path | None = None) -> Path:
    """Writes the policy with ``params`` as a Hugging Face folder (default RUN_DIR/export)."""
    from jaxrl_llm.models import save_pretrained

    out = Path(out) if out is not None else setup.run_dir / EXPORT_DIR
    return save_pretrained(setup.policy(params), out, tokenizer=setup.tokenizer)


def _restored(
    config: TrainConfig, run_dir: str | Path | None, log: Callable
) -> tuple[Setup, st.TrainState]:
    setup = resolve(config, run_dir)
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
) -> dict[str, float]:
    """Held-out accuracy / mean reward (and dpo preference accuracy) of the latest checkpoint
    in ``run_dir`` (the initial weights without one); ``mode``: greedy or sampled.

    ``num_samples`` K (default ``train.eval_num_samples``): K > 1 samples K completions per
    prompt and adds ``eval/mean@K``, ``eval/best@K``, ``eval/pass@k`` (k = 1, 2, 4, ... ≤ K
    and K), ``eval/maj@K``, each with ``_ci_low`` / ``_ci_high``, and ``eval/num_samples``
    (:mod:`~jaxrl_llm.train.eval_metrics`)."""
    setup, state = _restored(config, run_dir, log)
    return run_evaluation(
        setup,
        state.params,
        step=int(state.step),
        logprob=reference_logprob_fn(setup),
        mode=mode,
        max_new_tokens=max_new_tokens,
        num_samples=num_samples,
    )


def export(
    config: TrainConfig,
    *,
    run_dir: str | Path | None = None,
    out: str | Path | None = None,
    log: Callable[..., None] = print,
) -> Path:
    """Exports the latest checkpoint of ``run_dir`` as a Hugging Face folder.

    Raises ``FileNotFoundError`` when ``run_dir`` has no checkpoint (nothing was trained).
    """
    ckpt_dir = Path(run_dir or config.run_dir or ".").expanduser().absolute() / CHECKPOINT_DIR
    if not any(p.is_dir() and p.name.isdigit() for p in ckpt_dir.glob("*")):
        raise FileNotFoundError(
            f"no checkpoint in {ckpt_dir} to export; train the run first (or check --run-dir)"
        )
    setup, state = _restored(config, run_dir, log)
    return export_policy(setup, state.params, out)


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
