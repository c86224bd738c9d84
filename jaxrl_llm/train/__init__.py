"""The trainer: the config resolved once, the device step, the host's collection, the loop.

    from jaxrl_llm.train import resolve, make_rl_step
    setup = resolve(config, run_dir)          # models, recipe, optimizers, plans, a TrainState
    step = make_rl_step(setup.recipe, setup.models, setup.update)
    state, metrics = step(setup.state, groups)   # π_old/π_ref/V, advantages, update: one jit

Submodules: ``setup`` (the config → frozen values: Sampler, UpdateShape, Models, plans),
``step`` (``make_rl_step``, the ``Groups`` it takes), ``collect`` (host: generation, rewards,
PODS / DAPO selection; DPO's pair batches), ``update`` (the policy, critic and DPO losses and
their update steps), ``accumulate`` (epochs × minibatches × micro-batches with exact
accumulation), ``forward`` (log-prob and value passes), ``state`` (TrainState, optimizers,
shardings), ``models`` / ``data`` (loading models, datasets and rewards), ``checkpoint`` and
``checksums`` (orbax), ``metrics``, ``evaluation``, ``loop`` (``train`` / ``evaluate`` /
``export``), ``cli``.
"""

from jaxrl_llm.train.setup import Setup, resolve
from jaxrl_llm.train.state import TrainState, init_train_state
from jaxrl_llm.train.step import Groups, make_rl_step

__all__ = ["Groups", "Setup", "TrainState", "init_train_state", "make_rl_step", "resolve"]
