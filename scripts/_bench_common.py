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
