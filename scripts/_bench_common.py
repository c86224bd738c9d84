"""What every benchmark records about the machine it ran on (imported by scripts/bench_*.py)."""

from __future__ import annotations

import os
import platform

import jax


def machine_info() -> dict:
    """Backend, device, cores, processor, jax version and the load average before the run."""
    return {
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0]),
        "cpu_count": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "jax": jax.__version__,
        "load_avg_before": os.getloadavg(),
    }


def matmul_peak_gflops(n: int = 2048, repeats: int = 10) -> dict[str, float]:
    """This machine's fp32 matmul throughput (best of ``repeats`` ``n``³ products) in JAX and,
    when installed, torch: the peak that model FLOP/s are compared with on a CPU."""
    import time

    import jax.numpy as jnp
    import numpy as np

    a = np.random.RandomState(0).standard_normal((n, n)).astype(np.float32)
    ja = jnp.asarray(a)
    mm = jax.jit(lambda x: x @ x)
    cases = {"jax_fp32": lambda: mm(ja).block_until_ready()}
    try:
        import torch

        ta = torch.from_numpy(a)
        cases["torch_fp32"] = lambda: ta @ ta
    except ImportError:
        pass
    out = {}
    for name, fn in cases.items():
        fn()
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        out[name] = round(2 * n**3 / best / 1e9, 1)
    return out
