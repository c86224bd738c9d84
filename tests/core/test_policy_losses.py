"""Tests for jaxrl_llm.core.policy_losses against loop references, constants and gradients."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from jaxrl_llm.core import policy_losses as pl
from tests import reference as ref


def _batch(seed, *, spread=0.4):
    """Random [B, G, T] log-probs, old log-probs, advantages and a random (non-prefix) mask."""
    rng = np.random.default_rng(seed)
    shape = tuple(int(n) for n in rng.integers(1, 5, size=3))
    logp = -rng.exponential(1.0, size=shape)
    logp_old = logp + rng.normal(0.0, spread, size=shape)
    adv = rng.normal(0.0, 1.0, size=shape)
    mask = rng.random(shape) < 0.7
    return [np.asarray(x, np.float32) for x in (logp, logp_old, adv)] + [mask]


def _poison(mask, *xs, value=np.nan):
    """The same arrays with ``value`` written under the mask."""
    return [np.where(mask, x, np.float32(value)).astype(np.float32) for x in xs]


def _grad_logp(loss_fn, logp, *args):
    # Jitted for speed: eager op-by-op evaluation of the backward pass dominates the runtime.
    return jax.jit(jax.grad(lambda lp, *a: jnp.sum(loss_fn(lp, *a))))(logp, *args)


PPO_CONFIGS = [
    dict(clip_low=0.2, clip_high=0.2),
    dict(clip_low=0.2, clip_high=0.28),
    dict(clip_low=0.2, clip_high=0.2, dual_clip=3.0),
    dict(clip_low=0.1, clip_high=0.3, dual_clip=1.5, log_ratio_clamp=0.3),
]


class PolicyLossTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(0, 1, 2)
    def test_reinforce_matches_reference(self, seed):
        logp, _, adv, mask = _batch(seed)
        loss_fn = self.variant(pl.reinforce_loss)
        want, want_grad = ref.reinforce(logp, adv, mask)
        np.testing.assert_allclose(loss_fn(logp, adv, mask), want, rtol=1e-6, atol=1e-6)
        got_grad = _grad_logp(loss_fn, logp, adv, mask)
        np.testing.assert_allclose(got_grad, want_grad, rtol=1e-6, atol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(*[(seed, i) for seed in (0, 1) for i in range(len(PPO_CONFIGS))])
    def test_ppo_matches_reference(self, seed, config_index):
        config = PPO_CONFIGS[config_index]
        logp, logp_old, adv, mask = _batch(seed, spread=0.6)
        loss_fn = self.variant(functools.partial(pl.ppo_clip_loss, **config))
        want, want_grad = ref.ppo(logp, logp_old, adv, mask, **config)
        np.testing.assert_allclose(loss_fn(logp, logp_old, adv, mask), want, rtol=1e-5, atol=1e-6)
        got_grad = _grad_logp(loss_fn, logp, logp_old, adv, mask)
        np.testing.assert_allclose(got_grad, want_grad, rtol=1e-5, atol=1e-6)

    def test_ppo_hand_computed(self):
        # r = 1.5, 0.5, 5, 5; A = 1, -1, -1, -1; ε = 0.2, dual clip c = 3.
        logp_old = np.zeros(4, np.float32)
        logp = np.log(np.array([1.5, 0.5, 5.0, 1.1], np.float32))
        adv = np.array([1.0, -1.0, -1.0, -2.0], np.float32)
        mask = np.ones(4, bool)
        loss = pl.ppo_clip_loss(logp, logp_old, adv, mask, dual_clip=3.0)
        # max(-1.5, -1.2); max(0.5, 0.8); min(max(5, 1.2), 3); max(2.2, 2.2) unclipped.
        np.testing.assert_allclose(loss, [-1.2, 0.8, 3.0, 2.2], rtol=1e-6)
        no_dual = pl.ppo_clip_loss(logp, logp_old, adv, mask)
        np.testing.assert_allclose(no_dual, [-1.2, 0.8, 5.0, 2.2], rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_ppo_gradient_at_ratio_one_is_minus_advantage(self):
        logp, _, adv, mask = _batch(3)
        loss_fn = self.variant(functools.partial(pl.ppo_clip_loss, dual_clip=3.0))
        grad = _grad_logp(loss_fn, logp, logp, adv, mask)
        np.testing.assert_allclose(grad, np.where(mask, -adv, 0.0), rtol=1e-6, atol=1e-7)

    def test_ppo_clipped_tokens_have_zero_gradient(self):
        # Upper clip with A > 0, lower clip with A < 0, dual clip with A < 0 and r > c,
        # and two unclipped tokens (clip on the "wrong" side keeps the gradient).
        ratio = np.array([1.5, 0.5, 4.0, 1.5, 0.5], np.float32)
        adv = np.array([2.0, -1.0, -1.0, -1.0, 2.0], np.float32)
        logp_old = np.full(5, -1.0, np.float32)
        logp = logp_old + np.log(ratio)
        mask = np.ones(5, bool)
        fn = functools.partial(pl.ppo_clip_loss, dual_clip=3.0)
        grad = _grad_logp(fn, logp, logp_old, adv, mask)
        np.testing.assert_allclose(grad, [0.0, 0.0, 0.0, 1.5, -1.0], rtol=1e-6, atol=1e-7)

    def test_ppo_dual_clip_caps_negative_advantage_loss(self):
        adv = np.array([-0.5, -2.0], np.float32)
        logp_old = np.zeros(2, np.float32)
        mask = np.ones(2, bool)
        for log_r in (2.0, 10.0, 50.0):
            logp = np.full(2, log_r, np.float32)
            loss = pl.ppo_clip_loss(logp, logp_old, adv, mask, dual_clip=3.0, log_ratio_clamp=20.0)
            np.testing.assert_allclose(loss, -3.0 * adv, rtol=1e-6)

    def test_ppo_log_ratio_clamp_keeps_ratio_finite(self):
        logp, logp_old = np.array([0.0], np.float32), np.array([-200.0], np.float32)
        adv, mask = np.array([-1.0], np.float32), np.array([True])
        assert np.isinf(pl.ppo_clip_loss(logp, logp_old, adv, mask)[0])
        clamped = pl.ppo_clip_loss(logp, logp_old, adv, mask, log_ratio_clamp=20.0)
        np.testing.assert_allclose(clamped, [np.exp(20.0)], rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(0, 1, 2)
    def test_gspo_matches_reference(self, seed):
        logp, logp_old, adv, mask = _batch(seed, spread=0.1)
        config = dict(clip_low=0.03, clip_high=0.04, log_ratio_clamp=10.0)
        loss_fn = self.variant(functools.partial(pl.gspo_loss, **config))
        want, want_grad = ref.gspo(logp, logp_old, adv, mask, **config)
        np.testing.assert_allclose(loss_fn(logp, logp_old, adv, mask), want, rtol=1e-5, atol=1e-6)
        got_grad = _grad_logp(loss_fn, logp, logp_old, adv, mask)
        np.testing.assert_allclose(got_grad, want_grad, rtol=1e-5, atol=1e-6)

    def test_gspo_value_is_sequence_ratio_and_gradient_reaches_every_token(self):
        logp, logp_old, _, mask = _batch(5, spread=0.2)
        mask[..., 0] = True  # every sequence non-empty
        adv_bg = np.random.default_rng(5).normal(size=logp.shape[:-1]).astype(np.float32)
        adv = np.broadcast_to(adv_bg[..., None], logp.shape).astype(np.float32)
        fn = functools.partial(pl.gspo_loss, clip_low=10.0, clip_high=10.0)  # never clips
        loss = np.asarray(fn(logp, logp_old, adv, mask))
        seq_ratio = np.exp(
            np.sum(np.where(mask, logp - logp_old, 0), -1) / np.maximum(mask.sum(-1), 1)
        )
        want = np.where(mask, -adv * seq_ratio[..., None], 0.0)
        np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)
        grad = _grad_logp(fn, logp, logp_old, adv, mask)
        np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-6)  # ∂ℓ_t/∂logπ_t = −A·s_i
        assert np.all(np.abs(np.asarray(grad))[mask & (adv != 0)] > 0)

    def test_gspo_clips_whole_sequence(self):
        # Sequence ratio exp(0.5) > 1 + ε_high with A > 0: every token clipped, no gradient.
        logp = np.array([[0.4, 0.6, 9.0]], np.float32)
        logp_old = np.zeros((1, 3), np.float32)
        adv = np.ones((1, 3), np.float32)
        mask = np.array([[True, True, False]])
        fn = functools.partial(pl.gspo_loss, clip_low=0.2, clip_high=0.2)
        np.testing.assert_allclose(fn(logp, logp_old, adv, mask), [[-1.2, -1.2, 0.0]], rtol=1e-6)
        np.testing.assert_allclose(_grad_logp(fn, logp, logp_old, adv, mask), np.zeros((1, 3)))

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(0, 1, 2)
    def test_cispo_matches_reference(self, seed):
        logp, logp_old, adv, mask = _batch(seed, spread=0.5)
        config = dict(clip_low=10.0, clip_high=0.2)
        loss_fn = self.variant(functools.partial(pl.cispo_loss, **config))
        want, want_grad = ref.cispo(logp, logp_old, adv, mask, **config)
        np.testing.assert_allclose(loss_fn(logp, logp_old, adv, mask), want, rtol=1e-5, atol=1e-6)
        # The gradient is −sg(clip(r))·A: the clip bounds the weight, never removes the gradient.
        got_grad = _grad_logp(loss_fn, logp, logp_old, adv, mask)
        np.testing.assert_allclose(got_grad, want_grad, rtol=1e-5, atol=1e-6)

    def test_cispo_hand_computed(self):
        logp = np.log(np.array([2.0, 0.5, 1.1], np.float32))
        logp_old = np.zeros(3, np.float32)
        adv = np.array([1.0, -2.0, 3.0], np.float32)
        mask = np.ones(3, bool)
        fn = functools.partial(pl.cispo_loss, clip_low=0.2, clip_high=0.2)
        grad = _grad_logp(fn, logp, logp_old, adv, mask)
        np.testing.assert_allclose(grad, [-1.2, 2 * 0.8, -3 * 1.1], rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters((0, None), (1, 0.5), (2, 0.2))
    def test_value_loss_matches_reference(self, seed, clip_eps):
        value, value_old, ret, mask = _batch(seed, spread=0.7)
        loss_fn = self.variant(functools.partial(pl.value_loss, clip_eps=clip_eps))
        want = ref.value_loss(value, value_old, ret, mask, clip_eps=clip_eps)
        got = loss_fn(value, value_old, ret, mask)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    def test_value_loss_hand_computed(self):
        value, value_old, ret = (np.array([x], np.float32) for x in (1.0, 0.0, 2.0))
        mask = np.array([True])
        # v̂ = 0.5: ½·max((1 − 2)², (0.5 − 2)²) = 1.125; unclipped ½·1 = 0.5.
        np.testing.assert_allclose(
            pl.value_loss(value, value_old, ret, mask, clip_eps=0.5), [1.125]
        )
        np.testing.assert_allclose(pl.value_loss(value, value_old, ret, mask), [0.5])
        grad = jax.grad(lambda v: pl.value_loss(v, value_old, ret, mask, clip_eps=0.5).sum())(value)
        np.testing.assert_allclose(grad, [0.0])  # the clipped branch is active

    @chex.variants(with_jit=True, without_jit=True)
    def test_entropy_bonus_with_traced_coefficient(self):
        entropy = np.array([[1.0, 2.0, np.nan]], np.float32)
        mask = np.array([[True, True, False]])
        got = self.variant(lambda h, m, c: pl.entropy_bonus(h, m, coef=c))(entropy, mask, 0.5)
        np.testing.assert_allclose(got, [[-0.5, -1.0, 0.0]])

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(0, 1)
    def test_ratio_metrics_match_reference(self, seed):
        logp, logp_old, adv, mask = _batch(seed, spread=1.0)
        config = dict(clip_low=0.2, clip_high=0.28, dual_clip=2.0)
        got = self.variant(functools.partial(pl.ratio_metrics, **config))(logp, logp_old, adv, mask)
        want = ref.ratio_metrics(logp, logp_old, adv, mask, **config)
        self.assertEqual(set(got), set(want))
        for key, (total, denominator) in want.items():
            np.testing.assert_allclose(got[key][0], total, rtol=1e-5, atol=1e-5, err_msg=key)
            np.testing.assert_allclose(got[key][1], denominator, err_msg=key)


def test_vmap_over_prompts_equals_batched_call():
    logp, logp_old, adv, mask = _batch(10)
    for fn in (
        functools.partial(pl.gspo_loss, clip_low=0.1, clip_high=0.1),
        functools.partial(pl.ppo_clip_loss, dual_clip=3.0),
    ):
        vmapped = jax.jit(jax.vmap(fn))(logp, logp_old, adv, mask)
        np.testing.assert_allclose(vmapped, fn(logp, logp_old, adv, mask), rtol=1e-6)


def _all_losses():
    """(name, fn(logp, logp_old, adv, mask)) for every token loss, to run shared properties."""
    return [
        ("reinforce", lambda lp, lo, a, m: pl.reinforce_loss(lp, a, m)),
        ("ppo", functools.partial(pl.ppo_clip_loss, dual_clip=3.0, log_ratio_clamp=20.0)),
        ("gspo", functools.partial(pl.gspo_loss, clip_low=3e-4, clip_high=4e-4)),
        ("cispo", functools.partial(pl.cispo_loss, clip_low=10.0, clip_high=0.2)),
        ("value", functools.partial(pl.value_loss, clip_eps=0.5)),
        ("entropy", lambda lp, lo, a, m: pl.entropy_bonus(lp, m, coef=0.01)),
    ]


@pytest.mark.parametrize(("name", "loss_fn"), _all_losses())
def test_padding_values_do_not_leak_into_values_or_gradients(name, loss_fn):
    logp, logp_old, adv, mask = _batch(7)
    clean = loss_fn(logp, logp_old, adv, mask)
    (logp_pad,) = _poison(mask, logp, value=-np.inf)
    logp_old_pad, adv_pad = _poison(mask, logp_old, adv, value=np.nan)
    dirty = loss_fn(logp_pad, logp_old_pad, adv_pad, mask)
    np.testing.assert_array_equal(dirty, clean)
    np.testing.assert_array_equal(np.asarray(dirty)[~mask], 0.0)
    grad = jax.grad(lambda lp: jnp.sum(loss_fn(lp, logp_old_pad, adv_pad, mask)))(logp_pad)
    assert np.all(np.isfinite(grad)), name
    np.testing.assert_array_equal(np.asarray(grad)[~mask], 0.0)


@pytest.mark.parametrize(("name", "loss_fn"), _all_losses())
def test_extra_token_padding_changes_nothing(name, loss_fn):
    logp, logp_old, adv, mask = _batch(8)
    pad = [(0, 0)] * (logp.ndim - 1) + [(0, 3)]
    padded = [np.pad(x, pad, constant_values=np.float32(5.0)) for x in (logp, logp_old, adv)]
    got = loss_fn(*padded, np.pad(mask, pad))
    np.testing.assert_allclose(got[..., : logp.shape[-1]], loss_fn(logp, logp_old, adv, mask))
    np.testing.assert_array_equal(np.asarray(got)[..., logp.shape[-1] :], 0.0)


@pytest.mark.parametrize(("name", "loss_fn"), _all_losses())
def test_bf16_inputs_give_finite_f32(name, loss_fn):
    logp, logp_old, adv, mask = _batch(9)
    bf16 = [jnp.asarray(x, jnp.bfloat16) for x in (logp, logp_old, adv)]
    got = loss_fn(*bf16, mask)
    assert got.dtype == jnp.float32, name
    assert np.all(np.isfinite(got)), name
    want = loss_fn(*[np.asarray(x, np.float32) for x in bf16], mask)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_bad_inputs_name_the_argument():
    logp, logp_old, adv, mask = (np.zeros((2, 3), np.float32),) * 3 + (np.ones((2, 3), bool),)
    with pytest.raises(TypeError, match="argument `mask_bgt`"):
        pl.ppo_clip_loss(logp, logp_old, adv, mask.astype(np.float32))
    with pytest.raises(TypeError, match="argument `adv_bgt`"):
        pl.reinforce_loss(logp, adv.astype(np.int32), mask)
    with pytest.raises(ValueError, match="argument `adv_bgt`"):
        pl.cispo_loss(logp, logp_old, adv[:, :2], mask, clip_low=0.2, clip_high=0.2)
    with pytest.raises(ValueError, match="argument `dual_clip`"):
        pl.ppo_clip_loss(logp, logp_old, adv, mask, dual_clip=1.0)
    with pytest.raises(ValueError, match="argument `clip_low`"):
        pl.ppo_clip_loss(logp, logp_old, adv, mask, clip_low=-0.1)
    with pytest.raises(ValueError, match="argument `logp_bgt`"):
        scalar = np.float32(0.0)
        pl.gspo_loss(scalar, scalar, scalar, np.bool_(True), clip_low=0.1, clip_high=0.1)
    with pytest.raises(ValueError, match="argument `clip_eps`"):
        pl.value_loss(logp, logp_old, adv, mask, clip_eps=0.0)
    with pytest.raises(TypeError, match="argument `entropy_bgt`"):
        pl.entropy_bonus([1.0], mask, coef=0.1)
