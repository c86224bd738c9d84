"""Scalar heads on the decoder trunk: the PPO critic and the reward model.

Both are the decoder (no LM head) followed by a linear ``score: [D] -> [num_labels]``, which is
exactly HF's ``*ForSequenceClassification`` parameter layout, so either loads from and exports
to such a checkpoint. They differ only in which positions they read:

* :class:`RewardModel` returns one score per sequence, read at the last real token
  (``max{t : mask[t]}``). HF finds that token as the last one that is not ``pad_token_id``;
  with a mask that marks exactly the pad tokens the two agree, and the mask also works when the
  pad id doubles as EOS.
* :class:`ValueModel` returns ``V(s_t)`` for every position ``[B, T]``.

The critic is a *separate* model initialised from the policy checkpoint (trunk copied, fresh
head), not a head on the policy's shared trunk: policy and value gradients then never interfere,
the critic can have its own learning rate, dtype and sharding, and it matches what verl,
OpenRLHF and TRL do. The cost is a second trunk in memory.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.transformer import CausalLM, Decoder, _Proj


class _ScalarHeadModel(nnx.Module):
    def __init__(self, config: ModelConfig, num_labels: int = 1, *, rngs: nnx.Rngs):
        self.config = config
        self.num_labels = num_labels
        self.model = Decoder(config, rngs=rngs)
        self.score = _Proj(
            rngs,
            (config.hidden_size, num_labels),
            ("embed", "labels"),
            False,
            config.jnp_param_dtype,
        )

    def token_scores(
        self,
        tokens_bt: jax.Array,
        mask_bt: jax.Array | None = None,
        *,
        positions_bt: jax.Array | None = None,
    ) -> jax.Array:
        """float32 ``[B, T, num_labels]`` scores at every position."""
        h_btd, _ = self.model(tokens_bt, mask_bt, positions_bt=positions_bt)
        w_dl = self.score.kernel[...].astype(h_btd.dtype)
        scores_ml = jnp.dot(
            h_btd.reshape(-1, h_btd.shape[-1]), w_dl, preferred_element_type=jnp.float32
        )
        return scores_ml.reshape(*h_btd.shape[:-1], self.num_labels)


def last_token_index(mask_bt: jax.Array) -> jax.Array:
    """int32[B]: index of the last ``True`` of each row (0 for an all-False row, as HF)."""
    t = mask_bt.shape[1]
    return jnp.argmax(jnp.where(mask_bt, jnp.arange(t, dtype=jnp.int32)[None, :], -1), axis=1)


class RewardModel(_ScalarHeadModel):
    """``r(x) = score(h_last)``: float32 ``[B]`` (``[B, num_labels]`` when num_labels > 1)."""

    def __call__(
        self,
        tokens_bt: jax.Array,
        mask_bt: jax.Array | None = None,
        *,
        positions_bt: jax.Array | None = None,
    ) -> jax.Array:
        scores_btl = self.token_scores(tokens_bt, mask_bt, positions_bt=positions_bt)
        if mask_bt is None:
            pooled_bl = scores_btl[:, -1]
        else:
            last_b = last_token_index(mask_bt)
            pooled_bl = jnp.take_along_axis(scores_btl, last_b[:, None, None], axis=1)[:, 0]
        return pooled_bl[:, 0] if self.num_labels == 1 else pooled_bl


class ValueModel(_ScalarHeadModel):
    """Critic ``V(s_t) = score(h_t)``: float32 ``[B, T]``."""

    def __init__(self, config: ModelConfig, num_labels: int = 1, *, rngs: nnx.Rngs):
        if num_labels != 1:
            raise ValueError(f"a value model has one output, got num_labels={num_labels}")
        super().__init__(config, 1, rngs=rngs)

    def __call__(
        self,
        tokens_bt: jax.Array,
        mask_bt: jax.Array | None = None,
        *,
        positions_bt: jax.Array | None = None,
    ) -> jax.Array:
        return self.token_scores(tokens_bt, mask_bt, positions_bt=positions_bt)[..., 0]

    @classmethod
    def from_causal_lm(cls, lm: CausalLM, *, rngs: nnx.Rngs) -> ValueModel:
        """A critic whose trunk is a copy of ``lm``'s and whose head is freshly initialised."""
        config = lm.config
        graphdef, state = nnx.split(nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0))))
        values = nnx.to_pure_dict(state)
        values["model"] = jax.tree.map(jnp.copy, nnx.to_pure_dict(nnx.state(lm.model, nnx.Param)))
        head = _Proj(
            rngs, (config.hidden_size, 1), ("embed", "labels"), False, config.jnp_param_dtype
        )
        values["score"] = {"kernel": head.kernel[...]}
        nnx.replace_by_pure_dict(state, values)
        return nnx.merge(graphdef, state)
