"""What every benchmark records about the machine it ran on (imported by scripts/bench_*.py).

Importing it pins JAX to the CPU as the ``jaxrl-llm`` CLI does when ``libtpu`` is installed on a
machine without a TPU (``quiet_cpu_platform``): no libtpu initialisation warnings, and no
libtpu memory in the scripts' resident-set figures. It changes nothing on a TPU or GPU machine.
"""

from __future__ import annotations

import os
import platform
import socket

import jax

from jaxrl_llm.train.plan import quiet_cpu_platform

quiet_cpu_platform()

# The instruction-set extensions that move a CPU's matmul peak (XLA:CPU and torch pick their
# kernels by them): recorded beside every figure, as `lscpu`'s flags.
_ISA_PREFIXES = ("avx", "amx", "fma", "f16c")


def free_port() -> int:
    """A free TCP port on the loopback interface (the coordinator of a multi-process run the
    script starts on this host)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_info(path: str = "/proc/cpuinfo") -> dict:
    """The CPU's model name, family and model numbers (``lscpu``'s "Model name", "CPU family",
    "Model") and its vector/matrix extensions (``avx*``, ``amx*``, ``fma``, ``f16c`` of its
    flags), from the first processor of ``/proc/cpuinfo``; empty where there is none."""
    fields: dict[str, str] = {}
    try:
        with open(path) as f:
            for line in f:
                if not line.strip():
                    break  # the end of the first processor's block
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        return {}
    flags = fields.get("flags", "").split()
    return {
        "model_name": fields.get("model name"),
        "family": fields.get("cpu family"),
        "model": fields.get("model"),
        "isa": sorted(f for f in flags if f.startswith(_ISA_PREFIXES)),
    }


def machine_info() -> dict:
    """Backend, device, cores, the CPU (:func:`cpu_info`), jax version and the load average
    before the run."""
    return {
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0]),
        "cpu_count": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "cpu": cpu_info(),
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
