"""Tests for jaxrl_llm.core.kl: estimators, straight-through gradients, shaping, controllers."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from jax.sharding import PartitionSpec as P

from jaxrl_llm.core import kl
from tests.reference import ref_adaptive_kl_beta, ref_kl, ref_mean_sequence_kl

ESTIMATORS = (
    ("k1", kl.kl_k1),
    ("abs", kl.kl_abs),
    ("k2", kl.kl_k2),
    ("k3", kl.kl_k3),
    ("k1", kl.kl_k1_st),
    ("k3", kl.kl_k3_st),
)
LOGP = jnp.asarray([-1.0, -2.0])
LOGP_REF = jnp.asarray([-1.5, -1.0])


def random_logps(seed, shape, scale=1.0):
    rng = np.random.default_rng(seed)
    logp = -np.abs(rng.normal(size=shape)) * scale
    logp_ref = -np.abs(rng.normal(size=shape)) * scale
    return logp.astype(np.float32), logp_ref.astype(np.float32)


class EstimatorsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters((None, None), (20.0, 10.0), (1.0, None), (None, 0.5))
    def test_against_reference(self, log_ratio_clamp, value_clamp):
        logp, logp_ref = random_logps(0, (3, 4, 5), scale=3.0)
        clamps = dict(log_ratio_clamp=log_ratio_clamp, value_clamp=value_clamp)
        for name, estimator in ESTIMATORS:
            got = self.variant(functools.partial(estimator, **clamps))(logp, logp_ref)
            want = ref_kl(name, logp, logp_ref, **clamps)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)

    def test_golden_values_and_gradients(self):
        # docs/numerics.md, "KL": from running verl's kl_penalty on CPU.
        np.testing.assert_allclose(kl.kl_k3(LOGP, LOGP_REF), [0.1065, 0.7183], atol=1e-4)
        grad = lambda f: jax.grad(lambda lp: jnp.sum(f(lp, LOGP_REF)))(LOGP)
        np.testing.assert_allclose(grad(kl.kl_k3), [0.3935, -1.7183], atol=1e-4)
        np.testing.assert_allclose(grad(kl.kl_k3_st), [0.5, -1.0], atol=1e-6)
        np.testing.assert_allclose(grad(kl.kl_k1_st), [0.5, -1.0], atol=1e-6)
        np.testing.assert_allclose(grad(kl.kl_k2), [0.5, -1.0], atol=1e-6)
        np.testing.assert_allclose(grad(kl.kl_k1), [1.0, 1.0])
        np.testing.assert_allclose(kl.kl_k1(LOGP, LOGP_REF), [0.5, -1.0])
        np.testing.assert_allclose(kl.kl_k2(LOGP, LOGP_REF), [0.125, 0.5])
        np.testing.assert_allclose(kl.kl_abs(LOGP, LOGP_REF), [0.5, 1.0])

    def test_straight_through_values_equal_base_and_gradient_ignores_clamps(self):
        logp, logp_ref = random_logps(1, (4, 6), scale=5.0)
        clamps = dict(log_ratio_clamp=2.0, value_clamp=1.0)
        for base, st in ((kl.kl_k1, kl.kl_k1_st), (kl.kl_k3, kl.kl_k3_st)):
            np.testing.assert_array_equal(
                st(logp, logp_ref, **clamps), base(logp, logp_ref, **clamps)
            )
            grad = jax.grad(lambda lp, st=st: jnp.sum(st(lp, logp_ref, **clamps)))(logp)
            np.testing.assert_allclose(grad, logp - logp_ref, rtol=1e-6)

    def test_clamps_keep_extreme_ratios_finite(self):
        logp = jnp.asarray([-0.1, -200.0])
        logp_ref = jnp.asarray([-200.0, -0.1])
        verl = kl.kl_k3(logp, logp_ref, log_ratio_clamp=20.0, value_clamp=10.0)
        np.testing.assert_allclose(verl, [10.0, 10.0])
        # Only the log-ratio clamp: Δ = ±20 gives e^{−20} + 19 and e^{20} − 21.
        inner = kl.kl_k3(logp, logp_ref, log_ratio_clamp=20.0)
        np.testing.assert_allclose(inner, [np.exp(-20.0) + 19.0, np.exp(20.0) - 21.0], rtol=1e-6)
        np.testing.assert_allclose(kl.kl_k1(logp, logp_ref, value_clamp=10.0), [10.0, -10.0])

    def test_nonnegative_estimators(self):
        logp, logp_ref = random_logps(2, (50,), scale=4.0)
        for estimator in (kl.kl_abs, kl.kl_k2, kl.kl_k3, kl.kl_k3_st):
            self.assertTrue((np.asarray(estimator(logp, logp_ref)) >= 0.0).all())

    def test_k3_is_an_unbiased_kl_estimate(self):
        # Tokens sampled from π: E_π[k1] = E_π[k3] = KL(π‖π_ref).
        logits = jnp.asarray([1.0, 0.2, -0.5, -2.0])
        logits_ref = jnp.asarray([0.3, 0.3, 0.0, -1.0])
        logp_all = jax.nn.log_softmax(logits)
        ref_all = jax.nn.log_softmax(logits_ref)
        exact = jnp.sum(jnp.exp(logp_all) * (logp_all - ref_all))
        tokens = jax.random.categorical(jax.random.key(0), logits, shape=(200_000,))
        for estimator in (kl.kl_k1, kl.kl_k3):
            estimate = jnp.mean(estimator(logp_all[tokens], ref_all[tokens]))
            np.testing.assert_allclose(estimate, exact, rtol=0.03)

    def test_bf16_inputs_give_finite_f32(self):
        logp, logp_ref = random_logps(3, (3, 7), scale=10.0)
        for _, estimator in ESTIMATORS:
            out = estimator(jnp.asarray(logp, jnp.bfloat16), jnp.asarray(logp_ref, jnp.bfloat16))
            self.assertEqual(out.dtype, jnp.float32)
            self.assertTrue(np.isfinite(out).all())


class ShapingTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_kl_in_reward(self):
        rng = np.random.default_rng(4)
        reward = rng.normal(size=(2, 3, 5)).astype(np.float32)
        kl_bgt = rng.normal(size=(2, 3, 5)).astype(np.float32)
        mask = rng.random((2, 3, 5)) < 0.6
        kl_bgt = np.where(mask, kl_bgt, np.nan).astype(np.float32)
        got = self.variant(functools.partial(kl.kl_in_reward, beta=0.05))(reward, kl_bgt, mask)
        want = np.where(mask, reward - 0.05 * np.nan_to_num(kl_bgt), 0.0)
        np.testing.assert_allclose(got, want, rtol=1e-6)

    def test_kl_in_reward_with_a_traced_beta(self):
        reward = jnp.asarray([[1.0, jnp.nan, 2.0]])
        kl_bt = jnp.asarray([[0.5, jnp.inf, 1.0]])
        mask = jnp.asarray([[True, False, True]])
        shaped = jax.jit(lambda beta: kl.kl_in_reward(reward, kl_bt, mask, beta=beta))
        state = kl.adaptive_kl_controller(0.1, target=0.1, horizon=1000).init()
        np.testing.assert_allclose(shaped(state.beta), [[0.95, 0.0, 1.9]], rtol=1e-6)

    def test_kl_in_reward_propagates_nan_on_valid_tokens_only(self):
        reward = jnp.asarray([jnp.nan, 1.0, jnp.nan])
        mask = jnp.asarray([True, True, False])
        out = kl.kl_in_reward(reward, jnp.zeros(3), mask, beta=0.1)
        self.assertTrue(np.isnan(out[0]))
        np.testing.assert_array_equal(out[1:], [1.0, 0.0])

    @chex.variants(with_jit=True, without_jit=True)
    def test_mean_sequence_kl(self):
        rng = np.random.default_rng(5)
        kl_bgt = rng.normal(size=(3, 4, 6)).astype(np.float32)
        mask = rng.random((3, 4, 6)) < 0.5
        mask[0, 0] = False
        kl_bgt = np.where(mask, kl_bgt, np.nan).astype(np.float32)
        got = self.variant(kl.mean_sequence_kl)(kl_bgt, mask)
        np.testing.assert_allclose(got, ref_mean_sequence_kl(kl_bgt, mask), rtol=1e-5)
        # Hand-computed: sequence means 1 and 4 (the empty sequence is left out) → 2.5.
        kl_bt = jnp.asarray([[1.0, 1.0, jnp.nan], [2.0, 6.0, 4.0], [jnp.nan] * 3])
        m = jnp.asarray([[True, True, False], [True, True, True], [False] * 3])
        self.assertAlmostEqual(float(self.variant(kl.mean_sequence_kl)(kl_bt, m)), 2.5)
        self.assertEqual(float(self.variant(kl.mean_sequence_kl)(kl_bt, m & False)), 0.0)

    def test_mean_sequence_kl_under_shard_map(self):
        mesh = jax.make_mesh((8,), ("data",))
        rng = np.random.default_rng(6)
        put = lambda x: jax.device_put(x, jax.sharding.NamedSharding(mesh, P("data")))
        kl_bt = put(jnp.asarray(rng.normal(size=(16, 5)), jnp.float32))
        mask = np.asarray(rng.random((16, 5)) < 0.5)
        mask[:6] = False  # shards with no sequence at all
        mask = put(jnp.asarray(mask))
        fn = functools.partial(kl.mean_sequence_kl, axis_name="data")
        got = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P()))(
            kl_bt, mask
        )
        np.testing.assert_allclose(got, kl.mean_sequence_kl(kl_bt, mask), rtol=1e-5)


class ControllerTest(parameterized.TestCase):
    def test_adaptive_golden(self):
        # docs/numerics.md, "KL": β = 0.001, KL = 0.3, n = 256 → 0.00100512 (verl: target 0.1,
        # horizon 10000).
        ctrl = kl.adaptive_kl_controller(0.001, target=0.1, horizon=10_000)
        state = ctrl.update(ctrl.init(), jnp.asarray(0.3), 256)
        np.testing.assert_allclose(state.beta, 0.00100512, rtol=1e-6)
        self.assertEqual(state.beta.dtype, jnp.float32)

    def test_adaptive_matches_reference_over_a_jitted_scan(self):
        ctrl = kl.adaptive_kl_controller(0.05, target=0.2, horizon=500)
        observed = jnp.asarray([0.0, 0.1, 0.2, 0.25, 1.0, 0.19, 0.5])

        def step(state, observed_kl):
            state = ctrl.update(state, observed_kl, 64)
            return state, state.beta

        _, betas = jax.jit(lambda kls: jax.lax.scan(step, ctrl.init(), kls))(observed)
        beta, want = 0.05, []
        for value in observed.tolist():
            beta = ref_adaptive_kl_beta(beta, value, 64, target=0.2, horizon=500)
            want.append(beta)
        np.testing.assert_allclose(betas, want, rtol=1e-5)
        self.assertLess(betas[0], 0.05)  # KL below target lowers β
        self.assertGreater(betas[4], betas[3])  # KL above target raises β

    def test_fixed(self):
        ctrl = kl.fixed_kl_controller(0.01)
        state = ctrl.update(ctrl.init(), jnp.asarray(5.0), 1000)
        np.testing.assert_allclose(state.beta, 0.01)
        self.assertIsInstance(state, kl.KLControllerState)
        self.assertIsInstance(ctrl, kl.KLController)


class BadInputTest(parameterized.TestCase):
    def test_errors_name_the_argument(self):
        x = jnp.zeros((2, 3))
        with pytest.raises(ValueError, match="kl_k3: argument `logp_ref`"):
            kl.kl_k3(x, jnp.zeros((2, 4)))
        with pytest.raises(TypeError, match="kl_k1: argument `logp`"):
            kl.kl_k1(x.astype(jnp.int32), x)
        with pytest.raises(ValueError, match="kl_k3: argument `log_ratio_clamp`"):
            kl.kl_k3(x, x, log_ratio_clamp=-1.0)
        with pytest.raises(ValueError, match="kl_k2: argument `value_clamp`"):
            kl.kl_k2(x, x, value_clamp=0.0)
        with pytest.raises(TypeError, match="kl_in_reward: argument `mask_bgt`"):
            kl.kl_in_reward(x, x, x, beta=0.1)
        with pytest.raises(ValueError, match="kl_in_reward: argument `beta`"):
            kl.kl_in_reward(x, x, x > 0, beta=-0.1)
        with pytest.raises(ValueError, match="kl_in_reward: argument `kl_bgt`"):
            kl.kl_in_reward(x, jnp.zeros(3), x > 0, beta=0.1)
        with pytest.raises(ValueError, match="mean_sequence_kl: argument `mask_bgt`"):
            kl.mean_sequence_kl(x, jnp.ones((3, 2), bool))
        with pytest.raises(ValueError, match="adaptive_kl_controller: argument `target`"):
            kl.adaptive_kl_controller(0.1, target=0.0, horizon=10)
        with pytest.raises(ValueError, match="adaptive_kl_controller: argument `horizon`"):
            kl.adaptive_kl_controller(0.1, target=0.1, horizon=-1)
        with pytest.raises(ValueError, match="fixed_kl_controller: argument `beta`"):
            kl.fixed_kl_controller(-0.1)
