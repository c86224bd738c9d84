"""The trainer: train state, update steps, checkpoints, metrics and the RL loop.

    from jaxrl_llm.train import build_setup, make_update_step
    setup = build_setup(config)                    # models, recipe, optimizers, TrainState
    step = make_update_step(setup.recipe, setup.graphdef, setup.tx, ...)
    state, metrics = step(setup.state, batch)      # one PPO-style update of a rollout batch

Submodules: ``state`` (TrainState, optimizers, build_setup), ``models`` (policy, reference,
critic, the ``tiny-random`` model), ``update`` (update-step factories), ``forward`` (log-probs
and values before the update), ``checkpoint`` (orbax), ``metrics`` (metrics.jsonl, TensorBoard,
progress bar, plot), ``data`` (datasets and reward from a config), ``run`` (a run's static
parts, ``prepare``), ``batches`` (rollout → selection → update batch), ``evaluation``,
``loop`` (``train`` / ``evaluate`` / ``export``), ``cli`` (``add_train_parsers``).
"""

from jaxrl_llm.train.state import TrainSetup, TrainState, build_setup, init_train_state

__all__ = ["TrainSetup", "TrainState", "build_setup", "init_train_state"]
