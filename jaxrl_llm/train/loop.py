"""The RL loop: ``train(config) -> final metrics``, ``evaluate(config)`` and ``export``.

One training step of an online recipe::

    prompts (B, from the resumable stream)
      → rollout.generate (G samples each; key split from state.rng)
      → rewards (host, score_groups)
      → selection: PODS keeps m of G per prompt; DAPO drops prompts whose G rewards are equal and
        refills them from the next prompts (at most train.max_refill_batches extra batches of B;
        still-missing groups stay in the batch as non-members, so shapes are static)
      → forward passes: π_old (only when needed: several updates per batch, or a KL folded into
        the reward), π_ref (β > 0), critic values (ppo)
      → the recipe's advantage chain (its state, e.g. an adaptive β, carried in TrainState)
      → make_update_step (PPO epochs × minibatches × exact micro-batch accumulation)
      → metrics.jsonl / TensorBoard / progress bar → checkpoint every K steps → eval (greedy by
        default) on the held-out split every E steps, before the first and after the last
    at the end: export the policy as a Hugging Face folder (RUN_DIR/export) and plot the curves.

``dpo`` runs the same loop on preference pairs (no generation, no rewards) with
:func:`~jaxrl_llm.train.update.make_dpo_step`; its evaluation is the preference accuracy on
held-out pairs, plus the generation accuracy when the pairs come with answers.

A run directory holds ``config.yaml`` (the resolved config), ``metrics.jsonl``,
``tensorboard/``, ``checkpoints/``, ``curves.png`` and ``export/``. Calling :func:`train` on a
directory with checkpoints resumes from the latest one: the state carries the PRNG key, the
data position and the KL controller, so the resumed run computes exactly what an
uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxrl_llm import distributed as dist
from jaxrl_llm.config import TrainConfig, save_config, to_yaml
from jaxrl_llm.data import BatchIterator
from jaxrl_llm.train import hostmem
from jaxrl_llm.train import state as st
from jaxrl_llm.train.batches import build_update_batch, collect, dpo_batch
from jaxrl_llm.train.evaluation import run_evaluation
from jaxrl_llm.train.faults import mark_phase
from jaxrl_llm.train.metrics import MetricsLogger, NullLogger, plot_run
from jaxrl_llm.train.run import (
    CHECKPOINT_DIR,
    CONFIG_FILE,
    EXPORT_DIR,
    PAD_MULTIPLE,
    Run,
    checkpointer,
    config_changes,
    make_step_fn,
    prepare,
)

# ---------------------------------------------------------------------------------------------
# The loop.


def _print_header(run: Run, log) -> None:
    from jaxrl_llm.explain import explain, format_explanation

    log(format_explanation(explain(run.recipe)))
    for note in run.data.notes:
        log(note)


def _tensor_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    host = jax.device_get(metrics)
    return {k: float(np.asarray(v)) for k, v in host.items()}


def train(
    config: TrainConfig,
    *,
    run_dir: str | Path | None = None,
    max_steps: int | None = None,
    progress: bool = True,
    log=print,
) -> dict[str, float]:
    """Trains (or resumes) the run of ``config`` in ``run_dir``; returns the final metrics.

    Args:
      config: the resolved config.
      run_dir: the run directory (default ``config.run_dir``); existing checkpoints resume.
      max_steps: overrides ``train.max_steps`` (also the schedules' horizon).
      progress: show the progress bar.
      log: where the header and notes are printed.
    """
    if max_steps is not None:
        config = dataclasses.replace(
            config, train=dataclasses.replace(config.train, max_steps=int(max_steps))
        )
    run_dir = Path(run_dir or config.run_dir or "").expanduser()
    if not str(run_dir):
        raise ValueError("train: give a run directory (--run-dir or run_dir in the config)")
    config = dataclasses.replace(config, run_dir=str(run_dir.absolute()))
    run = prepare(config, run_dir)
    primary = dist.is_primary()  # with several processes, process 0 alone logs and writes files
    log = log if primary else (lambda *_: None)
    run.run_dir.mkdir(parents=True, exist_ok=True)
    ckpt = checkpointer(run)
    setup = run.setup
    state = setup.state
    batch_size = (
        config.preference.pairs_per_step if config.is_offline else (config.rollout.prompts_per_step)
    )
    iterator = BatchIterator(
        run.data.train,
        batch_size,
        seed=config.data.seed,
        shuffle=config.data.shuffle,
        pad_multiple=PAD_MULTIPLE,
    )
    start = skipped = 0  # skipped: steps whose update was non-finite (train.on_nonfinite)
    if ckpt.latest_step() is not None:
        state, meta = ckpt.restore(setup.state, setup.state_sharding)
        iterator.load_state_dict(meta["data"])
        skipped = int(meta.get("skipped_steps", 0))
        start = int(state.step)
        changes = config_changes(meta.get("config"), config)
        log(f"resuming {run.run_dir} from step {start}")
        if changes:
            log("config changed since the checkpoint: " + "; ".join(changes[:10]))
    # A resumed run rewrites config.yaml only once its first step has succeeded, so a launch that
    # fails (a bad override, a reward that raises) leaves the run's previous config in place.
    config_pending = primary
    if config_pending and start == 0:
        save_config(config, run.run_dir / CONFIG_FILE)
        config_pending = False
    mark_phase("start", start)
    hostmem.release_after_compiles()
    _print_header(run, log)
    step_fn = make_step_fn(run)
    t = config.train
    final: dict[str, float] = {}
    try:
        with (MetricsLogger if primary else NullLogger)(
            run.run_dir, max_steps=t.max_steps, start_step=start, progress=progress
        ) as logger:
            evaluating = bool(run.data.eval_prompts or run.data.eval_pairs)
            if evaluating and start == 0:
                ev = run_evaluation(run, state.params, step=0)
                logger.log(0, ev)
                logger.write(_format_eval(0, ev))
            step = start
            while step < t.max_steps:
                t_step = time.perf_counter()
                hostmem.release_free_heap()  # see hostmem: lowers the host peak on CPU
                mark_phase("rollout", step + 1)
                key, gen_key = jax.random.split(jax.random.wrap_key_data(state.rng))
                if config.is_offline:
                    batch, metrics = dpo_batch(run, iterator.next_batch())
                    kl_state = state.kl_state
                else:
                    groups, metrics = collect(run, state.params, iterator, gen_key)
                    batch, kl_state, more = build_update_batch(run, state, groups)
                    metrics.update(more)
                position = np.asarray(iterator.position, np.int32)
                sh = setup.state_sharding
                state = state._replace(
                    rng=jax.device_put(jax.random.key_data(key), sh.rng),
                    data_position=jax.device_put(position, sh.data_position),
                    kl_state=jax.device_put(kl_state, sh.kl_state),
                )
                t_update = time.perf_counter()
                hostmem.release_free_heap()
                mark_phase("update", step + 1)
                state, update_metrics = step_fn(state, batch)
                update_metrics = _tensor_metrics(update_metrics)
                step = int(state.step)
                metrics.update(update_metrics)
                metrics["time/update"] = time.perf_counter() - t_update
                metrics["time/step"] = time.perf_counter() - t_step
                metrics["perf/tokens_per_s"] = metrics["perf/tokens"] / metrics["time/step"]
                metrics["perf/peak_rss_gib"] = hostmem.peak_rss_gib()
                if "actor/kl_ref" in metrics:
                    metrics["kl"] = metrics["actor/kl_ref"]
                elif "kl/rollout" in metrics:
                    metrics["kl"] = metrics["kl/rollout"]
                if metrics.get("update/nonfinite", 0) > 0:
                    skipped += 1
                    if t.on_nonfinite == "skip":
                        logger.write(
                            f"step {step}: non-finite loss or gradient, update skipped (parameters "
                            f"and optimizer state unchanged; {skipped} steps skipped so far)"
                        )
                metrics["train/skipped_steps"] = skipped
                if step % t.log_every == 0 or step == t.max_steps:
                    logger.log(step, metrics)
                logger.progress(step, metrics)
                final = metrics
                if config_pending:
                    save_config(config, run.run_dir / CONFIG_FILE)
                    config_pending = False
                if metrics.get("update/nonfinite", 0) > 0 and t.on_nonfinite == "raise":
                    raise FloatingPointError(
                        f"step {step}: non-finite loss or gradient; the update was skipped and the "
                        f"parameters are unchanged (metrics in {logger.path}). Set "
                        "train.on_nonfinite=skip to continue past such batches."
                    )
                if ckpt.should_save(step, final=step == t.max_steps):
                    hostmem.release_free_heap()  # on CPU the save copies the state to host
                    ckpt.save(step, state, meta=_meta(config, iterator, skipped))
                    mark_phase("save", step)
                if evaluating and (
                    step == t.max_steps or (t.eval_every and step % t.eval_every == 0)
                ):
                    ev = run_evaluation(run, state.params, step=step)
                    logger.log(step, ev)
                    logger.write(_format_eval(step, ev))
                    final = {**final, **ev}
            if ckpt.should_save(step, final=True):
                ckpt.save(step, state, meta=_meta(config, iterator, skipped))
    finally:
        ckpt.close()  # waits for pending saves, also when interrupted
    export_policy(run, state.params)
    if primary:
        plot_run(run.run_dir)
    final = dict(final)
    final["step"] = step
    return final


def _meta(config: TrainConfig, iterator: BatchIterator, skipped: int = 0) -> dict[str, Any]:
    return {"data": iterator.state_dict(), "config": to_yaml(config), "skipped_steps": skipped}


def _format_eval(step: int, ev: dict[str, float]) -> str:
    parts = [
        f"{k.split('/', 1)[1]}={v:.4g}"
        for k, v in ev.items()
        if k != "eval/time" and k != "eval/num_prompts"
    ]
    return f"eval @ step {step}: " + ", ".join(parts)


def export_policy(run: Run, params, out: str | Path | None = None) -> Path:
    """Writes the policy with ``params`` as a Hugging Face folder (default RUN_DIR/export)."""
    from jaxrl_llm.models import save_pretrained

    out = Path(out) if out is not None else run.run_dir / EXPORT_DIR
    return save_pretrained(run.setup.policy(params), out, tokenizer=run.tokenizer)


def _restored(config: TrainConfig, run_dir: str | Path | None, log) -> tuple[Run, st.TrainState]:
    run = prepare(config, run_dir)
    state = run.setup.state
    ckpt_dir = run.run_dir / CHECKPOINT_DIR
    if ckpt_dir.exists():
        with checkpointer(run) as ckpt:
            if ckpt.latest_step() is not None:
                state, _ = ckpt.restore(run.setup.state, run.setup.state_sharding)
                log(f"restored step {int(state.step)} from {ckpt_dir}")
    else:
        log(f"no checkpoint in {run.run_dir}: using the initial weights")
    return run, state


def evaluate(
    config: TrainConfig,
    *,
    run_dir: str | Path | None = None,
    mode: str | None = None,
    max_new_tokens: int | None = None,
    log=print,
) -> dict[str, float]:
    """Held-out accuracy / mean reward (and dpo preference accuracy) of the latest checkpoint
    in ``run_dir`` (the initial weights without one); ``mode``: greedy or sampled."""
    run, state = _restored(config, run_dir, log)
    return run_evaluation(
        run, state.params, step=int(state.step), mode=mode, max_new_tokens=max_new_tokens
    )


def export(
    config: TrainConfig,
    *,
    run_dir: str | Path | None = None,
    out: str | Path | None = None,
    log=print,
) -> Path:
    """Exports the latest checkpoint of ``run_dir`` as a Hugging Face folder.

    Raises ``FileNotFoundError`` when ``run_dir`` has no checkpoint (nothing was trained).
    """
    ckpt_dir = Path(run_dir or config.run_dir or ".").expanduser().absolute() / CHECKPOINT_DIR
    if not any(p.is_dir() and p.name.isdigit() for p in ckpt_dir.glob("*")):
        raise FileNotFoundError(
            f"no checkpoint in {ckpt_dir} to export; train the run first (or check --run-dir)"
        )
    run, state = _restored(config, run_dir, log)
    return export_policy(run, state.params, out)


__all__ = [
    "CONFIG_FILE",
    "Run",
    "build_update_batch",
    "collect",
    "dpo_batch",
    "evaluate",
    "export",
    "export_policy",
    "make_step_fn",
    "prepare",
    "run_evaluation",
    "train",
]
