"""Test configuration shared by the whole suite.

Eight fake CPU devices are requested before JAX is imported, so sharding tests can build
meshes; computations that are not sharded still run on device 0 only. Silent rank promotion
is an error, as in rlax's tests, so an accidental broadcast fails instead of passing.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # torch next to JAX on 2 cores

import jax
from hypothesis import HealthCheck, settings

jax.config.update("jax_numpy_rank_promotion", "raise")

settings.register_profile(
    "default",
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
