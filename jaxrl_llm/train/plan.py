"""``jaxrl-llm plan``: will this run fit on that pod? Compiled for the target, nothing allocated.

The run's models and state are built as abstract shapes only (``nnx.eval_shape`` /
``jax.eval_shape``, :class:`jax.ShapeDtypeStruct` leaves carrying the mesh's
``NamedSharding``): the model's shapes come from its ``config.json`` or GGUF metadata, no weight
is read and no buffer allocated, so a 70B config plans on a laptop. The programs a run
executes are then lowered and compiled for the target's devices:

    rollout       the sampler of the engine the run resolves (:func:`rollout_engine`): the
                  paged engine's largest prefill and decode calls over its page pool
                  (:func:`plan_paged_rollout`, :mod:`jaxrl_llm.rollout.paged`), or the static
                  engine's one jit (prefill + ``T - 1`` decode steps over a KV cache of
                  ``P + T`` slots for ``B·G`` rows; :mod:`jaxrl_llm.rollout.engine`)
    update        the fused RL step (π_old / π_ref / V forward passes, the advantage chain, the
                  epochs × minibatches × micro-batches update; :func:`~jaxrl_llm.train.step.
                  make_rl_step`)
    eval rollout  the held-out evaluation's sampler, when the run has held-out prompts
    DPO           offline recipes: the reference's log-prob pass over the pairs and
                  :func:`~jaxrl_llm.train.update.make_dpo_step`'s update (no rollout)

Under ``model.lora`` the run is split as :func:`jaxrl_llm.train.models.adapt` splits it: the
train state holds the adapters (and their optimizer state), the frozen base (quantised with
``quantize``) is ``Models.frozen`` and is the reference.

With ``placement.mode: split`` the target's devices are carved as the run carves them
(:func:`jaxrl_llm.train.placement.carve_devices`, per host) and each side is planned where it
runs: the update (and the evaluation sampler) on the train mesh over the train devices, with
the train state, reference and critic resident; the rollout on the rollout mesh over the
rollout devices, with only the rollout's copy of the policy resident (:class:`RolloutSide`:
the parameters on the rollout shardings, under LoRA the adapters + the frozen base's copy +
the merged copy). The run fits when both sides do.

and XLA's own figures are read back: ``compiled.memory_analysis()`` (per-device argument,
output, alias and temporary bytes) and ``compiled.cost_analysis()["flops"]``. A program's
footprint on one device is

    program = arguments + outputs − aliased (donated) + temporaries

and, since the train state and the reference stay resident while the sampler runs,

    peak = max(update program, resident state + rollout temporaries + rollout outputs, ...)

compared with the chip's HBM: FITS when ``peak ≤ HBM``, with the margin ``HBM − peak``.

Targets. TPU slices by name (``v5e-16``, ``v5p-128``, ``v6e-32``; v5e/v6e count chips, v5p
counts TensorCores, two per chip, as Google's slice names do) or in libtpu's form
(``v5e:4x4``) compile for the real topology on any machine with ``libtpu`` installed
(``pip install -e ".[tpu-plan]"``; :func:`jax.experimental.topologies.get_topology_desc`,
as MaxText's ``train_compile.py``). GPUs by model and count (``h200-8``, ``h100-16``: hosts
of 8) compile the same way with XLA:GPU through JAX's CUDA plugin (``pip install -e
".[gpu-plan]"``; no GPU needed), from the chip's ``GpuTargetConfig`` (:class:`Gpu`). Without
the plugin, ``--devices N --device-memory 141GiB`` compiles for ``N`` CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=N``, in a subprocess when this process
has fewer) and the figures are an *estimate* (XLA:CPU's buffer assignment and fusion differ
from XLA:GPU's: BENCHMARKS.md, "Deviceless XLA:GPU compiles").

What is not measured here: the figures are XLA's static buffer assignment, not a measured
``device.memory_stats()`` peak (CPU devices report none; ``scripts/bench_accelerator.py``
measures one on a device, docs/plan.md). XLA's cost analysis counts a loop body
once (the layers' scan, the micro-batch loop, the sampler's decode ``while_loop``), so FLOPs per
step are computed analytically as well, with Kaplan et al. (2020, eq. 2.1; the attention term
left out) per token of ``N`` parameters: a forward pass ``2N``, a training pass ``6N`` (``8N``
with remat: the forward runs twice):

    rollout = 2N · B · (P + G·T)
    update  = (P + T) · B·G · (2N · forward passes (π_ref, π_old, V) + (6N or 8N) · epochs)

(LoRA: ``4N`` / ``6N`` per training pass, no gradient of the frozen weights.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

GiB = 1024**3


class PlanError(ValueError):
    """A plan's input is wrong: an unknown topology, a mesh that does not fit it, a model path
    that does not exist. The message names the flag or key and what was expected."""


# ---------------------------------------------------------------------------------------------
# Targets.


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator chip as a plan sees it.

    Attributes:
      family: the slice-name prefix (``v5e``).
      device_kind: what libtpu calls its devices (``TPU v5 lite``).
      hbm_bytes: high-bandwidth memory per chip (one JAX device).
      source: where that figure comes from.
      cores_per_chip: TensorCores per chip (slice names of v5p count cores).
    """

    family: str
    device_kind: str
    hbm_bytes: int
    source: str
    cores_per_chip: int = 1


#: Per-chip HBM, from Google Cloud's TPU system-architecture pages. The nominal capacity: XLA
#: keeps a little of it for itself, so a plan within ~2% of HBM is tight.
CHIPS: dict[str, Chip] = {
    "v5e": Chip(
        "v5e",
        "TPU v5 lite",
        16 * GiB,
        "cloud.google.com/tpu/docs/v5e: 16 GiB HBM2 per chip",
    ),
    "v5p": Chip(
        "v5p",
        "TPU v5",
        95 * GiB,
        "cloud.google.com/tpu/docs/v5p: 95 GiB HBM2e per chip",
        cores_per_chip=2,
    ),
    "v6e": Chip(
        "v6e",
        "TPU v6 lite",
        32 * GiB,
        "cloud.google.com/tpu/docs/v6e: 32 GiB HBM per chip",
    ),
}

#: Chips -> the topology libtpu compiles for (2D tori for v5e/v6e, 3D for v5p), as in
#: Google's slice tables.
_TOPOLOGIES_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16"}
_TOPOLOGIES_2D |= {256: "16x16"}
_TOPOLOGIES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8"}
_TOPOLOGIES_3D |= {256: "4x8x8", 512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16"}


@dataclasses.dataclass(frozen=True)
class Gpu:
    """One GPU model as XLA:GPU compiles for it without the device (its ``GpuTargetConfig``:
    the figures XLA's fusion, tiling and scheduling decisions read).

    Attributes:
      family: the target-name prefix (``h200``).
      device_kind: what the CUDA plugin calls the device (``NVIDIA H200``).
      memory_bytes: device memory (what ``cudaMemGetInfo`` reports as total).
      source: where the figures come from.
      sm_count, clock_ghz: streaming multiprocessors and their boost clock.
      memory_bandwidth: HBM bytes per second.
      l2_bytes: L2 cache.
      shared_memory_per_sm, shared_memory_per_block_optin: shared memory per SM, and the
        most one block may opt in to.
      compute_capability: ``(major, minor)``.
    """

    family: str
    device_kind: str
    memory_bytes: int
    source: str
    sm_count: int
    clock_ghz: float
    memory_bandwidth: int
    l2_bytes: int
    shared_memory_per_sm: int
    shared_memory_per_block_optin: int
    compute_capability: tuple[int, int]

    def target_config(
        self, cuda: tuple[int, int] = (13, 0), cudnn: tuple[int, int] = (9, 10)
    ) -> str:
        """XLA's ``GpuTargetConfigProto`` in text form, for a CUDA runtime and cuDNN of these
        versions (the plugin's)."""
        major, minor = self.compute_capability
        info = {
            "threads_per_block_limit": 1024,
            "threads_per_warp": 32,
            "shared_memory_per_block": 48 * 1024,
            "shared_memory_per_core": self.shared_memory_per_sm,
            "threads_per_core_limit": 2048,
            "core_count": self.sm_count,
            "fpus_per_core": 128,
            "block_dim_limit_x": 2**31 - 1,
            "block_dim_limit_y": 65535,
            "block_dim_limit_z": 65535,
            "memory_bandwidth": self.memory_bandwidth,
            "l2_cache_size": self.l2_bytes,
            "clock_rate_ghz": self.clock_ghz,
            "device_memory_size": self.memory_bytes,
            "shared_memory_per_block_optin": self.shared_memory_per_block_optin,
            "registers_per_core_limit": 65536,
            "registers_per_block_limit": 65536,
        }
        lines = ["gpu_device_info {"]
        lines += [f"  {k}: {v}" for k, v in info.items()]
        lines += [f"  cuda_compute_capability {{ major: {major} minor: {minor} }}", "}"]
        lines += [
            'platform_name: "CUDA"',
            f"dnn_version_info {{ major: {cudnn[0]} minor: {cudnn[1]} }}",
            f"runtime_version {{ major: {cuda[0]} minor: {cuda[1]} }}",
            f'device_description_str: "{self.device_kind}"',
        ]
        return "\n".join(lines) + "\n"


_H100 = Gpu(
    "h100",
    "NVIDIA H100 80GB HBM3",
    80995 * 2**20,
    "an H100 SXM's 80,995 MiB reported (NVIDIA data sheet: 80 GB HBM3, 3.35 TB/s)",
    sm_count=132,
    clock_ghz=1.98,
    memory_bandwidth=3_350_000_000_000,
    l2_bytes=50 * 2**20,
    shared_memory_per_sm=228 * 1024,
    shared_memory_per_block_optin=227 * 1024,
    compute_capability=(9, 0),
)

#: GPUs a plan compiles for without one (``--topology h200-8``): NVIDIA's data sheets for the
#: SXM parts, the memory as the devices report it. Hosts of 8 (HGX boards). The H200 is the
#: H100's chip with more and faster memory.
GPUS: dict[str, Gpu] = {
    "h100": _H100,
    "h200": dataclasses.replace(
        _H100,
        family="h200",
        device_kind="NVIDIA H200",
        memory_bytes=143771 * 2**20,
        source="the H200's 143,771 MiB reported (BENCHMARKS.md, Accelerator runs; NVIDIA data "
        "sheet: 141 GB HBM3e, 4.8 TB/s)",
        memory_bandwidth=4_800_000_000_000,
    ),
}
GPUS_PER_HOST = 8
_GPU_COUNTS = (1, 2, 4, 8)  # within one host; past it, whole hosts of GPUS_PER_HOST


def gpu_memory_fraction() -> float:
    """The fraction of a GPU's memory JAX's allocator may use: ``XLA_PYTHON_CLIENT_MEM_FRACTION``
    (default 0.75, JAX's), what a run's ``memory_stats()["bytes_limit"]`` reports."""
    text = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")
    try:
        fraction = float(text)
    except ValueError:
        fraction = -1.0
    if not 0 < fraction <= 1:
        raise PlanError(f"XLA_PYTHON_CLIENT_MEM_FRACTION = {text!r}: expected a number in (0, 1]")
    return fraction


def gpu_names() -> list[str]:
    """GPU target names :func:`parse_target` accepts, up to 8 hosts (``h200-1`` ... ``h200-64``;
    any multiple of 8 is accepted)."""
    counts = [*_GPU_COUNTS, *(GPUS_PER_HOST * h for h in (2, 4, 8))]
    return [f"{family}-{n}" for family in GPUS for n in counts]


def _gpu_target(name: str, family: str, n: int) -> Target:
    gpu = GPUS[family]
    if n not in _GPU_COUNTS and n % GPUS_PER_HOST:
        raise PlanError(
            f"--topology {name!r}: {n} GPUs is neither 1, 2, 4 or 8 (one host) nor a multiple "
            f"of {GPUS_PER_HOST} (whole hosts of {GPUS_PER_HOST})"
        )
    hosts, per_host = (1, n) if n <= GPUS_PER_HOST else (n // GPUS_PER_HOST, GPUS_PER_HOST)
    fraction = gpu_memory_fraction()
    source = (
        f"{fraction:g} of the memory (XLA_PYTHON_CLIENT_MEM_FRACTION, JAX's allocator) of "
        + gpu.source
    )
    hbm = int(gpu.memory_bytes * fraction)
    return Target(name, "gpu", n, hbm, source, f"1x{hosts}x{per_host}", gpu.device_kind)


def slice_names() -> list[str]:
    """Every slice name :func:`parse_target` accepts (``v5e-16``, ``v5p-128``, ...)."""
    names = []
    for family, chip in CHIPS.items():
        table = _TOPOLOGIES_3D if family == "v5p" else _TOPOLOGIES_2D
        names += [f"{family}-{n * chip.cores_per_chip}" for n in table]
    return names


@dataclasses.dataclass(frozen=True)
class Target:
    """What a plan compiles for.

    Attributes:
      name: as given (``v5e-16``, ``v5e:4x4``, ``8 devices``).
      platform: ``"tpu"`` or ``"gpu"`` (a real deviceless compile: libtpu's, or XLA:GPU's
        through JAX's CUDA plugin), ``"cpu"`` (an estimate on CPU devices) or ``"local"``
        (this process's own devices, :func:`local_target`).
      num_devices: JAX devices (chips).
      hbm_bytes: memory per device; None when unknown (no FITS verdict then).
      hbm_source: where ``hbm_bytes`` comes from.
      topology: libtpu's topology name, or the CUDA plugin's ``slices x hosts x GPUs per
        host`` (``1x2x8``).
      device_kind: the chip's name.
    """

    name: str
    platform: str
    num_devices: int
    hbm_bytes: int | None
    hbm_source: str
    topology: str | None = None
    device_kind: str = "cpu"

    @property
    def estimate(self) -> bool:
        """True when the figures come from a CPU compile standing in for the real devices."""
        return self.platform == "cpu"

    @property
    def accelerator(self) -> bool:
        """The run's defaults are an accelerator's (bf16 compute and KV cache for ``auto``)."""
        if self.platform == "local":
            return jax.default_backend() != "cpu"
        return self.platform in ("tpu", "gpu") or self.hbm_bytes is not None


def local_target(num_devices: int | None = None) -> Target:
    """This process's own first ``num_devices`` devices (default all), HBM from their
    ``memory_stats()["bytes_limit"]`` when they report it (GPU, TPU; not CPU): for comparing a
    plan with a measured peak on the same devices (scripts/bench_accelerator.py)."""
    devices = jax.devices()[: num_devices or jax.device_count()]
    stats = devices[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    source = "memory_stats()['bytes_limit']" if limit else "not reported by the device"
    kind = devices[0].device_kind
    return Target(f"local {kind}", "local", len(devices), limit, source, device_kind=kind)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str, *, where: str = "--device-memory") -> int:
    """``"141GiB"``, ``"80GB"``, ``"16 GiB"``, ``"1e9"`` -> bytes (GB = 10⁹, GiB = 2³⁰)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise PlanError(
            f"{where} = {text!r}: expected a positive size such as 141GiB, 80GB or 16GiB "
            f"(units: {', '.join(u for u in _UNITS if u)}, case-insensitive)"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_target(
    topology: str | None = None, *, devices: int | None = None, device_memory: str | None = None
) -> Target:
    """The target of ``--topology`` (a TPU slice name or libtpu's ``v5e:4x4``; GPUs by model
    and count, ``h200-8``, ``h100-16``), or of ``--devices N [--device-memory SIZE]`` (N GPUs,
    estimated on N CPU devices).

    Raises:
      PlanError: an unknown slice, GPU or family (listing the valid ones), both or neither
        given.
    """
    if (topology is None) == (devices is None):
        raise PlanError(
            "give either --topology (a TPU slice such as v5e-16, v5p-128, v6e-32, or libtpu's "
            "v5e:4x4; GPUs such as h200-8, h100-16) or --devices N --device-memory SIZE (GPUs, "
            "estimated on N CPU devices)"
        )
    if devices is not None:
        if devices < 1:
            raise PlanError(f"--devices = {devices}: expected at least 1")
        hbm = None if device_memory is None else parse_bytes(device_memory)
        source = "--device-memory" if hbm is not None else "not given (no FITS verdict)"
        return Target(f"{devices}x GPU (CPU estimate)", "cpu", devices, hbm, source)
    if device_memory is not None:
        raise PlanError("--device-memory goes with --devices; a TPU slice's HBM is known")
    name = topology.strip()
    m = re.fullmatch(r"([a-z][0-9]+)-([0-9]+)", name.lower())
    if m and m.group(1) in GPUS and int(m.group(2)) >= 1:
        return _gpu_target(name, m.group(1), int(m.group(2)))
    family_names = ", ".join(CHIPS)
    if ":" in name:  # libtpu's own form
        family, _, dims = name.partition(":")
        chip = CHIPS.get(family)
        if chip is None or not re.fullmatch(r"[0-9]+(x[0-9]+){1,2}", dims):
            raise PlanError(
                f"--topology {name!r}: expected FAMILY:DIMS with FAMILY one of {family_names} "
                "and DIMS like 2x2, 4x8 (v5e, v6e) or 2x2x1, 4x4x4 (v5p)"
            )
        n = math.prod(int(d) for d in dims.split("x"))
        return Target(name, "tpu", n, chip.hbm_bytes, chip.source, name, chip.device_kind)
    m = re.fullmatch(r"(v[0-9][a-z]*)-([0-9]+)", name)
    chip = CHIPS.get(m.group(1)) if m else None
    if chip is None:
        raise PlanError(
            f"--topology {name!r}: unknown TPU slice; valid: {', '.join(slice_names())}, or "
            f"libtpu's FAMILY:DIMS form (e.g. v5e:4x4) with FAMILY one of {family_names}; or "
            f"GPUs as MODEL-COUNT with MODEL one of {', '.join(GPUS)} (e.g. h200-8, h100-16)"
        )
    cores = int(m.group(2))
    table = _TOPOLOGIES_3D if chip.family == "v5p" else _TOPOLOGIES_2D
    n = cores // chip.cores_per_chip
    if cores % chip.cores_per_chip or n not in table:
        valid = ", ".join(s for s in slice_names() if s.startswith(chip.family + "-"))
        raise PlanError(f"--topology {name!r}: no such {chip.family} slice; valid: {valid}")
    topo = f"{chip.family}:{table[n]}"
    return Target(name, "tpu", n, chip.hbm_bytes, chip.source, topo, chip.device_kind)


def target_devices(target: Target) -> list[Any]:
    """The target's devices: libtpu's or the CUDA plugin's deviceless ones, or this process's
    first CPU devices.

    Raises:
      PlanError: libtpu (the CUDA plugin) is not installed, or this process has too few CPU
        devices.
    """
    if target.platform == "local":
        return jax.devices()[: target.num_devices]
    if target.platform == "gpu":
        return _gpu_devices(target)
    if target.platform == "tpu":
        try:
            import libtpu  # noqa: F401
        except ImportError:
            raise PlanError(
                f"--topology {target.name}: compiling for TPU needs libtpu "
                '(pip install -e ".[tpu-plan]"); without it, plan on CPU devices with '
                "--devices N --device-memory SIZE (an estimate)"
            ) from None
        from jax.experimental import topologies

        if not _tpu_device_files():  # no TPU to guard: let plans run side by side
            os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        with _quiet_stderr() as said:
            try:
                desc = topologies.get_topology_desc(platform="tpu", topology_name=target.topology)
            except Exception as e:
                raise PlanError(
                    f"--topology {target.name}: libtpu refused topology {target.topology!r} "
                    f"({type(e).__name__}: {e}) {said()}".strip()
                ) from None
        return list(desc.devices)
    cpus = jax.devices("cpu")
    if len(cpus) < target.num_devices:
        raise PlanError(
            f"{target.num_devices} CPU devices needed, this process has {len(cpus)}: set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={target.num_devices} before jax "
            "starts (plan_in_subprocess does)"
        )
    return cpus[: target.num_devices]


def _cuda_plugin() -> tuple[int, int] | None:
    """The CUDA release of the installed JAX CUDA plugin (``jax-cuda13-plugin``: ``(13, 0)``;
    ``jax-cuda12-plugin``: ``(12, 8)``), None when there is none."""
    import importlib.util

    for name, release in (("xla_cuda13", (13, 0)), ("xla_cuda12", (12, 8))):
        with contextlib.suppress(ImportError, ValueError):
            if importlib.util.find_spec(f"jax_plugins.{name}") is not None:
                return release
    return None


def _cudnn_release(cuda: tuple[int, int]) -> tuple[int, int]:
    """The installed cuDNN wheel's ``(major, minor)`` for the plugin's CUDA (9.10 without one:
    a cuDNN attention then cannot compile, and says so)."""
    import importlib.metadata

    with contextlib.suppress(importlib.metadata.PackageNotFoundError, ValueError):
        version = importlib.metadata.version(f"nvidia-cudnn-cu{cuda[0]}")
        major, minor = version.split(".")[:2]
        return int(major), int(minor)
    return 9, 10


def skip_cuda_library_check() -> None:
    """Lets JAX's CUDA plugin start on a machine without CUDA's libraries or a GPU: its version
    check of cuBLAS, cuDNN, ... (``JAX_SKIP_CUDA_CONSTRAINTS_CHECK``) guards running programs,
    not compiling them. Must come before JAX starts its backends (the first device query)."""
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


def _gpu_devices(target: Target) -> list[Any]:
    """The deviceless devices of ``target`` (a GPU model and count) from JAX's CUDA plugin."""
    cuda = _cuda_plugin()
    if cuda is None:
        raise PlanError(
            f"--topology {target.name}: compiling for GPUs needs JAX's CUDA plugin "
            '(pip install -e ".[gpu-plan]", or jax[cuda13] on a GPU machine); without it, plan '
            "on CPU devices with --devices N --device-memory SIZE (an estimate)"
        )
    skip_cuda_library_check()
    from jax.experimental import topologies

    gpu = next(g for g in GPUS.values() if g.device_kind == target.device_kind)
    config = gpu.target_config(cuda=cuda, cudnn=_cudnn_release(cuda))
    with _quiet_stderr() as said:
        try:
            desc = topologies.get_topology_desc(
                platform="cuda", target_config=config, topology=target.topology
            )
        except Exception as e:
            raise PlanError(
                f"--topology {target.name}: JAX's CUDA plugin refused topology "
                f"{target.topology!r} ({type(e).__name__}: {e}). If the plugin failed to start "
                "(its check of the CUDA libraries runs when JAX starts its backends, before "
                "JAX_SKIP_CUDA_CONSTRAINTS_CHECK was set here), set "
                f"JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 before Python starts. {said()}".strip()
            ) from None
    return list(desc.devices)


@contextlib.contextmanager
def _quiet_stderr() -> Any:
    """Holds back what C++ code writes to file descriptor 2 (libtpu's initialisation warnings
    about TPU_ACCELERATOR_TYPE / TPU_WORKER_HOSTNAMES on a machine without TPUs, which do not
    matter for a deviceless compile); yields a function returning the text held back."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as held:
        os.dup2(held.fileno(), 2)
        try:
            yield lambda: (held.seek(0), held.read().decode(errors="replace"))[1]
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _tpu_device_files() -> bool:
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def quiet_cpu_platform() -> bool:
    """Pins this process to CPU when ``libtpu`` is installed but the machine has no TPU
    (no ``/dev/accel*`` or ``/dev/vfio/N``) and no JAX GPU plugin, and ``JAX_PLATFORMS`` is
    unset: jax would otherwise try libtpu first, print its initialisation warnings and fall
    back to CPU anyway. Only the ``jaxrl-llm`` CLI calls this (before any backend starts);
    deviceless TPU compiles (:func:`target_devices`) still work. Returns whether it did.
    """
    import importlib.util

    if os.environ.get("JAX_PLATFORMS") or importlib.util.find_spec("libtpu") is None:
        return False
    gpu = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin")
    if _tpu_device_files() or any(importlib.util.find_spec(m) for m in gpu):
        return False
    os.environ["JAX_PLATFORMS"] = "cpu"  # for subprocesses
    jax.config.update("jax_platforms", "cpu")
    return True


# ---------------------------------------------------------------------------------------------
# The run's model config, from config.json or GGUF metadata only.


def model_config(model: Any, *, accelerator: bool) -> Any:
    """The policy's :class:`~jaxrl_llm.models.ModelConfig` of a ``model:`` config section, read
    from ``config.json`` / GGUF metadata (no weights), with its dtype, remat and attention.

    ``dtype: auto`` is bfloat16 for an accelerator target, float32 otherwise, and the log-prob
    pass's logits blocks are the target's size (``logits_block_rows``): the trainer's rules,
    applied to the target instead of this machine.

    Raises:
      PlanError: ``model.path`` does not exist.
    """
    from jaxrl_llm.models import logprobs

    cfg = _model_config(model, accelerator=accelerator)
    rows = logprobs.block_rows(cfg.vocab_size, accelerator=accelerator)
    return cfg.replace(logits_block_rows=rows)


def _model_config(model: Any, *, accelerator: bool) -> Any:
    from jaxrl_llm import models
    from jaxrl_llm.models import hub
    from jaxrl_llm.models.config import ModelConfig
    from jaxrl_llm.train import models as train_models

    dtype = model.dtype if model.dtype != "auto" else ("bfloat16" if accelerator else "float32")
    policy = dict(
        dtype=jnp.dtype(dtype),
        param_dtype=jnp.dtype(model.param_dtype),
        remat=model.remat,
        attention_impl=model.attention,
    )
    if model.path == models.TINY_RANDOM:
        return models.tiny_random_config(**policy)
    path = Path(train_models.resolve_model_path(model.path)).expanduser()
    if not path.exists():
        raise PlanError(
            f"model.path = {model.path!r}: no such folder or file ({path}); expected an HF "
            "folder with config.json (weights are not read), a .gguf file, 'default' or "
            "'tiny-random'"
        )
    folder, gguf_file = hub._resolve(path, None)  # the loader's own path rules
    if gguf_file is None:
        raw = hub.read_config_json(folder)
    else:
        raw = hub._read_hf_config(folder, gguf_file).to_dict()  # GGUF header metadata only
    try:
        return ModelConfig.from_hf(raw, **policy)
    except (KeyError, TypeError, ZeroDivisionError) as e:
        raise PlanError(
            f"model.path = {model.path!r}: its config lacks or mistypes a field "
            f"({type(e).__name__}: {e}); expected vocab_size, hidden_size, intermediate_size, "
            "num_hidden_layers and num_attention_heads as integers"
        ) from None


# ---------------------------------------------------------------------------------------------
# Abstract state.


def _with_sharding(abstract: Any, shardings: Any) -> Any:
    """``ShapeDtypeStruct``s of ``abstract`` carrying the matching ``shardings``."""
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )


def _shape_only(tree: Any) -> Any:
    """Abstract leaves (``nnx.to_pure_dict`` of an ``nnx.eval_shape`` module) as plain
    ``ShapeDtypeStruct``s."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


@dataclasses.dataclass(frozen=True, eq=False)
class AbstractRun:
    """The run as shapes: the :class:`~jaxrl_llm.train.setup.Models` (its reference and frozen
    parameters abstract), the train state and the step's groups, every leaf a sharded
    ShapeDtypeStruct; ``sampler`` is the ``(graphdef, parameters)`` the rollout runs (under
    LoRA the base joined with its adapters, or their merged copy)."""

    models: Any
    state: Any
    groups: Any
    model_config: Any
    prompt_width: int
    sampler: tuple[Any, Any] | None = None
    num_parameters: int = 0
    num_critic_parameters: int = 0


@dataclasses.dataclass(frozen=True, eq=False)
class _Split:
    """A model's abstract parameters split as the trainer splits them."""

    graphdef: Any
    params: Any
    sharding: Any
    base_graphdef: Any = None
    frozen: Any = None
    frozen_sharding: Any = None
    num_parameters: int = 0  # the model's own (float) parameters, adapters not counted


def _abstract_split(
    build: Any, lora_section: Any, mesh: jax.sharding.Mesh, rules: Any, *, seed: int, extra: Any
) -> _Split:
    """``build()`` (a model constructor) as shapes, split like the trainer does: all
    parameters trainable, or under ``lora_section`` (:func:`jaxrl_llm.train.models.adapt`)
    the base quantised (``quantize``) and frozen, the adapters (``B = 0``, seeded by
    ``seed + 2``; plus the module ``extra`` of a critic) trainable."""
    from jaxrl_llm.models import lora
    from jaxrl_llm.models import sharding as shd
    from jaxrl_llm.train import models as train_models
    from jaxrl_llm.train import state as st

    if lora_section is None:
        model = nnx.eval_shape(build)
        graphdef, params = st.split_params(model)
        sharding = shd.param_shardings(nnx.state(model, nnx.Param), mesh, rules)
        return _Split(graphdef, _shape_only(params), sharding, num_parameters=_count(params))
    lora_cfg = train_models.lora_config(lora_section)

    def base() -> Any:
        model = build()
        if lora_section.quantize != "none":
            from jaxrl_llm.models import quant

            quant.quantize_model(model, lora_section.quantize)
        return model

    def adapted() -> Any:  # a PEFT adapter (lora.adapter) has these shapes too (checked)
        return lora.apply_lora(base(), lora_cfg, rngs=nnx.Rngs(seed + 2))

    base_graphdef = nnx.graphdef(nnx.eval_shape(base))
    num_parameters = _count(nnx.state(nnx.eval_shape(build), nnx.Param))
    model = nnx.eval_shape(adapted)
    trainable = lora.trainable_filter(extra)
    graphdef, frozen, params = lora.split(model, trainable)
    frozen_state, trainable_state = lora.split_states(model, trainable)
    return _Split(
        graphdef,
        _shape_only(params),
        shd.param_shardings(trainable_state, mesh, rules),
        base_graphdef,
        _with_sharding(_shape_only(frozen), shd.param_shardings(frozen_state, mesh, rules)),
        shd.param_shardings(frozen_state, mesh, rules),
        num_parameters,
    )


def _count(tree: Any) -> int:
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(tree)))


def _merged_for_sampling(models_: Any, adapters: Any, sharding: Any = None) -> Any:
    """The merged parameters' shapes (``W + s·A B`` folded in, :func:`jaxrl_llm.models.lora.
    merged_params`), sharded like the frozen base they replace (``sharding``: the frozen
    base's shardings on another mesh, the rollout's under split placement)."""
    from jaxrl_llm.models import lora

    def merged(frozen: Any, adapters: Any) -> Any:
        module = lora.merge_into_base(nnx.merge(models_.graphdef, lora.combine(frozen, adapters)))
        return nnx.to_pure_dict(nnx.state(module, nnx.Param))

    shapes = jax.eval_shape(merged, _shape_only(models_.frozen), _shape_only(adapters))
    return _with_sharding(_shape_only(shapes), sharding or models_.frozen_sharding)


def abstract_run(config: Any, recipe: Any, mesh: jax.sharding.Mesh, model_cfg: Any) -> AbstractRun:
    """:func:`jaxrl_llm.train.setup.build_models`, with shapes instead of arrays.

    The same optimizer, shardings (:func:`jaxrl_llm.train.state.state_shardings`), reference
    dtype and critic as the trainer builds; under ``model.lora`` the TrainState's parameters
    are the adapters only (and the optimizer's state theirs), the frozen base (quantised with
    ``quantize``: codes and block scales) is ``Models.frozen`` and is the reference (no copy).
    The groups are the step's worst case (every prompt ``data.max_prompt_length`` tokens padded
    to the trainer's multiple, every completion ``rollout.max_new_tokens``).
    """
    from jaxrl_llm import models
    from jaxrl_llm.models import sharding as shd
    from jaxrl_llm.recipe import REFERENCE_LOGPROBS
    from jaxrl_llm.train import models as train_models
    from jaxrl_llm.train import setup as su
    from jaxrl_llm.train import state as st
    from jaxrl_llm.train.step import Groups

    rules = shd.PRESETS[config.mesh.preset]
    seed = config.train.seed
    n_updates = su.update_shape(config).updates_per_step
    lora_section = config.model.lora
    policy = _abstract_split(
        lambda: models.CausalLM(model_cfg, rngs=nnx.Rngs(seed)),
        lora_section,
        mesh,
        rules,
        seed=seed,
        extra=None,
    )
    graphdef, params, param_sh = policy.graphdef, policy.params, policy.sharding
    tx, schedule = su.make_optimizer(
        config.optim, max_steps=config.train.max_steps, updates_per_step=n_updates
    )
    ref = None
    if REFERENCE_LOGPROBS in recipe.requires:
        if policy.frozen is not None:  # the frozen base is the reference: no copy
            ref = policy.frozen
        else:
            dtype = jnp.dtype(config.kl.reference_param_dtype)
            ref = _with_sharding(
                jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, dtype), params), param_sh
            )
    critic_graphdef = critic_params = critic_sh = critic_tx = critic_schedule = None
    critic = None
    if getattr(recipe, "critic", None) is not None:  # preference recipes have none
        critic_cfg = model_cfg
        if config.critic.path is not None:
            critic_model = dataclasses.replace(config.model, path=config.critic.path)
            critic_cfg = model_config(critic_model, accelerator=False).replace(
                dtype=model_cfg.dtype  # the policy's compute dtype, "auto" resolved for the target
            )
        critic = _abstract_split(
            lambda: models.ValueModel(critic_cfg, rngs=nnx.Rngs(seed + 1)),
            config.critic.lora,
            mesh,
            rules,
            seed=seed + 3,
            extra="score",
        )
        critic_graphdef, critic_params, critic_sh = critic.graphdef, critic.params, critic.sharding
        critic_tx, critic_schedule = su.make_critic_optimizer(
            config.critic,
            config.optim,
            max_steps=config.train.max_steps,
            updates_per_step=n_updates,
        )
    state = jax.eval_shape(
        lambda p, cp: st.init_train_state(
            p, tx, recipe=recipe, seed=seed, critic_params=cp, critic_tx=critic_tx
        ),
        params,
        critic_params,
    )
    sharding = st.state_shardings(
        state,
        mesh,
        param_sharding=param_sh,
        tx=tx,
        critic_param_sharding=critic_sh,
        critic_tx=critic_tx,
    )
    state = _with_sharding(state, sharding)
    run_models = su.Models(
        mesh=mesh,
        rules=rules,
        graphdef=graphdef,
        tx=tx,
        schedule=schedule,
        state_sharding=sharding,
        ref_params=ref,
        critic_graphdef=critic_graphdef,
        critic_tx=critic_tx,
        critic_schedule=critic_schedule,
        ref_graphdef=policy.base_graphdef,
        frozen=policy.frozen,
        frozen_sharding=policy.frozen_sharding,
        critic_frozen=None if critic is None else critic.frozen,
        critic_frozen_sharding=None if critic is None else critic.frozen_sharding,
        lora=train_models.lora_config(lora_section),
        merge_for_sampling=lora_section is not None and lora_section.merge_for_sampling,
    )
    if run_models.frozen is None:
        sampler = (graphdef, state.params)
    elif run_models.merge_for_sampling:
        sampler = (run_models.ref_graphdef, _merged_for_sampling(run_models, state.params))
    else:
        sampler = (graphdef, run_models.full_params(state.params))
    p = -(-config.data.max_prompt_length // su.PAD_MULTIPLE) * su.PAD_MULTIPLE
    n_critic = 0 if critic is None else critic.num_parameters
    if config.rollout is None:  # offline (DPO): the pairs are planned by _plan_offline
        return AbstractRun(
            run_models, state, None, model_cfg, p, sampler, policy.num_parameters, n_critic
        )
    b = config.rollout.prompts_per_step
    g = config.update_batch_size // b  # PODS: the update sees m of the G answers
    t = config.rollout.max_new_tokens
    dp = shd.data_parallel_size(mesh)
    split = b % dp == 0

    def leaf(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
        sh = run_models.batch_sharding(len(shape)) if split else st.replicated(mesh)
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sh)

    def mask(shape: tuple[int, ...]) -> Any:  # host arrays with packing: the plan reads them
        return np.ones(shape, bool) if su.update_shape(config).packing else leaf(shape, bool)

    groups = Groups(
        prompt_ids_bp=leaf((b, p), jnp.int32),
        prompt_mask_bp=mask((b, p)),
        tokens_bgt=leaf((b, g, t), jnp.int32),
        mask_bgt=mask((b, g, t)),
        logp_sampler_bgt=leaf((b, g, t), jnp.float32),
        reward_bg=leaf((b, g), jnp.float32),
        member_bg=leaf((b, g), bool),
    )
    return AbstractRun(
        run_models, state, groups, model_cfg, p, sampler, policy.num_parameters, n_critic
    )


# ---------------------------------------------------------------------------------------------
# Bytes of sharded shapes.


def _leaf_bytes(x: Any) -> tuple[int, int, int]:
    """(global bytes, bytes on one device, bytes replicated on every device) of one leaf."""
    if x is None or not hasattr(x, "shape"):
        return 0, 0, 0
    size = np.dtype(x.dtype).itemsize if not jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else 8
    total = math.prod(x.shape) * size
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        return total, total, total
    shard = math.prod(sharding.shard_shape(tuple(x.shape))) * size
    replicated = shard if sharding.is_fully_replicated and len(sharding.device_set) > 1 else 0
    return total, shard, replicated


def _kept_bytes(params: Any, rest: Any) -> int:
    """The bytes on one device of an engine's weight argument that are the run's own buffers:
    of the non-layer leaves (``rest`` of :func:`~jaxrl_llm.rollout.paged.engine_params`), those
    neither cast nor resharded; the per-layer slices are always copies."""
    from jaxrl_llm.rollout import paged

    own = jax.tree.leaves(paged.without_layers(params))
    return int(
        sum(
            _leaf_bytes(a)[1]
            for x, a in zip(own, jax.tree.leaves(rest), strict=True)
            if x.dtype == a.dtype and _leaf_bytes(x)[1] == _leaf_bytes(a)[1]
        )
    )


@dataclasses.dataclass(frozen=True)
class Bytes:
    """A tree's bytes: ``total`` over the mesh, ``per_device`` on one device, of which
    ``replicated`` is held whole by every device (leaves not split: scalars, dimensions that
    do not divide their mesh axes, the dp preset's parameters)."""

    total: int = 0
    per_device: int = 0
    replicated: int = 0


def tree_bytes(tree: Any) -> Bytes:
    """:class:`Bytes` of a pytree of sharded arrays or ``ShapeDtypeStruct``s (the largest
    shard's, i.e. device 0's, for uneven splits)."""
    parts = [_leaf_bytes(x) for x in jax.tree.leaves(tree)]
    return Bytes(*(int(sum(p[i] for p in parts)) for i in range(3)))


def kv_cache_bytes(
    model_cfg: Any, rows: int, slots: int, dtype: Any, mesh: jax.sharding.Mesh
) -> Bytes:
    """The sampler's decode cache: keys and values of every layer, ``[N, K, Dh, S]`` each,
    ``2 · L · N · K · Dh · S`` elements, split over the batch axes (rows) and, when the KV
    heads divide it, ``tensor`` (:func:`jaxrl_llm.rollout.decode.constrain`)."""
    from jaxrl_llm.models import sharding as shd

    c = model_cfg
    total = 2 * c.num_layers * rows * c.num_kv_heads * c.head_dim * slots
    total *= jnp.dtype(dtype).itemsize
    dp = shd.data_parallel_size(mesh)
    tensor = dict(mesh.shape).get("tensor", 1)
    split = (dp if rows % dp == 0 else 1) * (tensor if c.num_kv_heads % tensor == 0 else 1)
    return Bytes(total, total // split, 0 if split > 1 or mesh.size == 1 else total // split)


# ---------------------------------------------------------------------------------------------
# Compiling.


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled program's per-device figures (XLA's ``memory_analysis``/``cost_analysis``).

    ``bytes = arguments + outputs − aliased + temporaries`` is what it needs on one device while
    it runs; ``flops`` as XLA counts them (a loop body once; None where the compiler reports no
    cost analysis, as XLA:GPU's deviceless compiles do). ``resident``: the bytes of its
    arguments that belong to the resident train state (set for the extra programs), less the
    bytes it holds that are not its arguments (the paged engine's stacked layer weights).
    ``shared``: argument bytes XLA counts twice that are one buffer at run time (LoRA's frozen
    base, passed to the RL step as the reference and as the base), left out of ``bytes``.
    ``refused``: the compiler's reason when it would not compile the program for the target's
    memory (a TPU's compiler checks a program's buffers against the chip's HBM); the figures
    are then a lower bound, ``temporaries`` the bytes it reported needing (see
    :func:`_refused_bytes`).
    """

    name: str
    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    code: int
    flops: float | None
    compile_s: float
    resident: int = 0
    shared: int = 0
    refused: str | None = None

    @property
    def bytes(self) -> int:
        return self.arguments - self.shared + self.outputs - self.aliased + self.temporaries


_UNIT = {"B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_REFUSALS = (
    # XLA:TPU, when a program's temporaries alone exceed the chip's HBM
    re.compile(r"memory required for HLO temporaries \(([\d.]+)([BKMGT])\) exceeds available HBM"),
    # XLA:TPU, when its whole buffer assignment does
    re.compile(r"Ran out of memory in memory space hbm\. Used ([\d.]+)([BKMGT]) of"),
)


def _refused_bytes(message: str) -> int | None:
    """The bytes a compiler that refused a program for lack of device memory said it needs
    (``None``: the error is something else). The TPU compiler's figures are binary units."""
    for pattern in _REFUSALS:
        m = pattern.search(message)
        if m:
            return int(float(m.group(1)) * _UNIT[m.group(2)])
    return None


def _program(name: str, lowered: Any, resident: int = 0, shared: int = 0) -> Program:
    t0 = time.perf_counter()
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        need = _refused_bytes(str(e))
        if need is None:
            raise
        # Not compiled: the bytes it reported needing stand for the whole program (a lower
        # bound: its other arguments and outputs are not known), over its resident arguments.
        reason = next((line for line in str(e).splitlines() if "memory" in line), str(e))
        return Program(
            name=name,
            arguments=resident,
            outputs=0,
            aliased=0,
            temporaries=need,
            code=0,
            flops=0.0,
            compile_s=time.perf_counter() - t0,
            resident=resident,
            shared=shared,
            refused=reason.strip(),
        )
    seconds = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    if isinstance(cost, Sequence):  # older jax: one dict per program
        cost = cost[0] if cost else {}
    return Program(
        name=name,
        arguments=int(mem.argument_size_in_bytes),
        outputs=int(mem.output_size_in_bytes),
        aliased=int(mem.alias_size_in_bytes),
        temporaries=int(mem.temp_size_in_bytes),
        code=int(getattr(mem, "generated_code_size_in_bytes", 0)),
        flops=None if not cost else float(cost.get("flops", 0.0)),
        compile_s=seconds,
        resident=resident,
        shared=shared,
    )


def _cache_dtype(cache_dtype: str, model_cfg: Any, target: Target) -> jnp.dtype:
    """The sampler's KV-cache dtype (``rollout.cache_dtype``) on the target (engine's rule for
    ``auto``, for the target's backend rather than this machine's)."""
    if cache_dtype != "auto":
        return jnp.dtype(cache_dtype)
    if not target.accelerator:
        return jnp.dtype(jnp.promote_types(model_cfg.dtype, jnp.float32))
    return jnp.dtype(model_cfg.dtype)


_GREEDY_ROLLOUT = types.SimpleNamespace(  # DPO's evaluation sampler (setup._eval_plan)
    prompts_per_step=1,
    num_samples=1,
    max_new_tokens=1,
    temperature=0.0,
    top_k=0,
    top_p=1.0,
    cache_dtype="auto",
)


def lower_rollout(
    run: AbstractRun,
    config: Any,
    target: Target,
    *,
    prompts: int | None = None,
    num_samples: int | None = None,
    max_new_tokens: int | None = None,
    greedy: bool | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> tuple[Any, Bytes, int]:
    """The static engine's program (:func:`jaxrl_llm.rollout.engine.generate`'s jit) lowered
    for the run's B prompts of width P, G samples, T new tokens (``rollout.*``, or the
    evaluation's ``prompts`` / ``num_samples`` / ``max_new_tokens`` / ``greedy`` given), on the
    weights as ``generate`` passes them (:func:`~jaxrl_llm.rollout.paged.engine_params`: the
    layers sliced into per-layer copies, wider weights cast); its KV cache's bytes; and the
    bytes of its weight argument that are the run's own buffers (:func:`_kept_bytes`).
    ``mesh``: where it runs (default the train mesh; split placement: the rollout mesh, with
    ``run.sampler`` on it, :func:`rollout_copy`)."""
    from jaxrl_llm.models import sharding as shd
    from jaxrl_llm.rollout import engine, paged
    from jaxrl_llm.train import state as st

    r = config.rollout or _GREEDY_ROLLOUT  # DPO: greedy, the cache in the default dtype
    mesh, cfg = mesh or run.models.mesh, run.model_config
    b, p = prompts or r.prompts_per_step, run.prompt_width
    g, t = num_samples or r.num_samples, max_new_tokens or r.max_new_tokens
    greedy = r.temperature == 0.0 if greedy is None else greedy
    rep = st.replicated(mesh)
    batch = shd.batch_sharding(mesh, 2) if b % shd.data_parallel_size(mesh) == 0 else rep
    cache_dtype = _cache_dtype(r.cache_dtype, cfg, target)
    static = engine._Static(  # the sampler's own static settings (engine.generate)
        max_new_tokens=t,
        num_samples=g,
        greedy=greedy,
        top_k=0 if greedy or r.top_k >= cfg.vocab_size else r.top_k,
        use_top_p=not greedy and r.top_p < 1.0,
        pad_token_id=engine._pad_id(cfg),
        cache_dtype=cache_dtype.name,
    )
    key = jax.eval_shape(lambda: jax.random.key(0))
    graphdef, params = run.sampler
    weights = paged.abstract_engine_params(params, cfg.dtype)
    args = (
        weights,
        jax.ShapeDtypeStruct((b, p), jnp.int32, sharding=batch),
        jax.ShapeDtypeStruct((b, p), bool, sharding=batch),
        jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=rep),
        jax.ShapeDtypeStruct((), jnp.float32, sharding=rep),
        jax.ShapeDtypeStruct((), jnp.float32, sharding=rep),
        jax.ShapeDtypeStruct((8,), jnp.int32, sharding=rep),
    )
    with jax.set_mesh(mesh):
        lowered = engine._rollout.lower(graphdef, *args, static=static)
    kv = kv_cache_bytes(cfg, b * g, p + t, cache_dtype, mesh)
    return lowered, kv, _kept_bytes(params, weights.rest)


def rollout_engine(config: Any, processes: int = 1) -> str:
    """The engine the run's rollout (and its evaluation) samples with: ``rollout.engine``, with
    ``auto`` resolved as the trainer resolves it (:func:`jaxrl_llm.train.setup.rollout_engine`:
    paged when completions can stop early, i.e. unless ``rollout.stop_token_ids: []``, the
    EOS of ``null`` assumed to exist; or for partial rollouts over ``processes > 1``). DPO (no
    ``rollout``): the static engine."""
    from jaxrl_llm.train import setup

    r = config.rollout
    if r is None:
        return "static"
    stop = r.stop_token_ids  # None: the model's EOS
    return setup.rollout_engine(
        config, can_stop_early=stop is None or len(stop) > 0, processes=processes
    )


@dataclasses.dataclass(frozen=True)
class PagedRollout:
    """The paged engine as planned (:func:`plan_paged_rollout`), per engine.

    Attributes:
      engines: paged engines, one per data shard of the mesh (``paged_dp``; 1 without data
        parallelism), each with its own pool on its own devices.
      prompts: prompts of the largest shard (its engine is the one planned).
      options: the :class:`~jaxrl_llm.rollout.paged.PagedOptions` that engine resolves
        (``num_slots``, ``num_pages``, ``page_size``, ...).
      attention: the attention backend compiled (``reference``, ``ragged_tpu``, ...).
      pool: the preallocated page pool's bytes (per device: one engine's pool on one of its
        devices, split by KV head over a ``tensor`` axis that divides them, else whole;
        ``total``: the ``engines`` pools).
      prefill: the largest prefill call, ``prefill_rows`` rows × ``prefill_tokens`` tokens over
        a ``prefill_table_pages``-page table.
      decode: the largest decode dispatch, ``decode_rows`` slots × ``steps_per_dispatch`` steps
        over a ``decode_table_pages``-page table.
    """

    engines: int
    prompts: int
    options: Any
    attention: str
    pool: Bytes
    prefill: Program
    decode: Program
    prefill_rows: int
    prefill_tokens: int
    prefill_table_pages: int
    decode_rows: int
    decode_table_pages: int

    @property
    def program(self) -> Program:
        """The larger of the two (by its bytes less its resident arguments; the decode on a
        tie): the one the plan's rollout peak is of."""
        d, p = self.decode, self.prefill
        return p if p.bytes - p.resident > d.bytes - d.resident else d

    def describe(self) -> str:
        """``paged engine (decode 64 slots, 129 pages of 16 tokens, ...)`` for the table."""
        o = self.options
        t = getattr(o, "tensor_parallel", 0)
        each = f" of {t} devices" if t > 1 else ""
        per = f" per engine, {self.engines} engines{each}" if self.engines > 1 or t > 1 else ""
        if self.engines > 1 and not t:
            per += " (one per data shard)"
        return (
            f"paged engine (decode {self.decode_rows} slots over {self.decode_table_pages}-page "
            f"tables, prefill {self.prefill_rows}x{self.prefill_tokens} tokens; a pool "
            f"of {o.num_pages} pages of {o.page_size} tokens{per}; {self.attention} attention; "
            f"planned: the {'decode' if self.program is self.decode else 'prefill'})"
        )


def plan_paged_rollout(
    run: AbstractRun,
    config: Any,
    target: Target,
    *,
    name: str = "rollout",
    prompts: int | None = None,
    num_samples: int | None = None,
    max_new_tokens: int | None = None,
    greedy: bool | None = None,
    mesh: jax.sharding.Mesh | None = None,
    resident: bool = True,
    full_logprobs: bool = False,
    num_pages: int | None = None,
) -> tuple[PagedRollout, tuple[str, ...]]:
    """The paged engine's programs (:mod:`jaxrl_llm.rollout.paged`) for the run's B prompts,
    G samples, T new tokens (``rollout.*`` or the evaluation's, as :func:`lower_rollout`),
    compiled for the target: its page pool and its largest ``_prefill`` and ``_decode`` calls
    (:func:`~jaxrl_llm.rollout.paged.worst_case_programs`), as ``generate(engine="paged")``
    runs them in the trainer (``collect.sample_completions``):

    - with ``rollout.tensor_parallel`` t, the mesh first regrouped into engines of t devices
      and the parameters split over each (:func:`~jaxrl_llm.rollout.paged_dp.regroup_mesh`,
      :func:`~jaxrl_llm.rollout.paged_dp.abstract_regroup`; on a TPU one engine's programs
      compile on the lowest-numbered chips, :func:`_on_lowest_ids`);
    - on a mesh whose ``data`` × ``fsdp`` size D is > 1, one engine per data shard
      (:mod:`~jaxrl_llm.rollout.paged_dp`): the largest shard's ``⌈B / D⌉`` prompts, on its
      sub-mesh, the parameters resharded without the batch axes
      (:func:`~jaxrl_llm.rollout.paged_dp.abstract_shard_params`: a gathered copy under FSDP);
      else one engine on the mesh;
    - the options :func:`~jaxrl_llm.rollout.paged.resolve_options` gives for the engine's
      ``prompts · G`` sequences, the longest prompt ``data.max_prompt_length`` tokens (the
      engine takes prompts unpadded; longer ones are dropped by the data pipeline) and
      ``rollout.paged_attention``;
    - the attention of :func:`~jaxrl_llm.rollout.paged.attention_kernel` for the target's
      platform (TPU: ``ragged_tpu`` under ``auto`` on a one-device engine; CPU estimates of
      GPUs: the reference, noted);
    - the parameters as ``generate`` passes them (:func:`~jaxrl_llm.rollout.paged.
      engine_params`: the stacked layers sliced into per-layer copies, wider weights cast to
      the compute dtype), the pool and the rest replicated over the engine's devices, the pool
      donated;
      ``full_logprobs``: ``rollout.full_logprobs`` (the training rollout's; not evaluation's).
    - ``num_pages``: the pool's pages in place of the resolved default (:func:`fit_paged`).

    Each program's ``resident``: the bytes of its parameter argument that are the run's own
    buffers (of the non-layer parameters, neither cast nor resharded; 0 with
    ``resident=False``, a merged LoRA copy); the per-layer copies are always counted. Not
    counted: under FSDP, the sharded per-layer slices that ``generate`` holds while the
    gathered ones run (``1/D`` of them).
    Returns the :class:`PagedRollout` and notes for the table.

    Raises:
      PlanError: the paged options the run would resolve are refused (the engine's message).
    """
    from jaxrl_llm.models import sharding as shd
    from jaxrl_llm.rollout import engine, paged, paged_dp
    from jaxrl_llm.rollout import pages as pages_lib

    r = config.rollout
    mesh, cfg = mesh or run.models.mesh, run.model_config
    b = prompts or r.prompts_per_step
    g, t = num_samples or r.num_samples, max_new_tokens or r.max_new_tokens
    greedy = r.temperature == 0.0 if greedy is None else greedy
    top_k, top_p = (0, 1.0) if greedy else (r.top_k, r.top_p)  # Sampler.greedy()
    longest = config.data.max_prompt_length
    cache_dtype = _cache_dtype(r.cache_dtype, cfg, target)
    graphdef, params = run.sampler
    # What generate passes (paged.engine_params): the layers sliced (and cast) per layer, the
    # rest cast; with rollout.tensor_parallel t, moved onto engines of t devices each
    # (paged_dp.regroup); with data-parallel engines each gathers its copy (shard_params).
    args = paged.abstract_engine_params(params, cfg.dtype)
    if r.tensor_parallel:
        try:
            mesh = paged_dp.regroup_mesh(mesh, r.tensor_parallel)
        except ValueError as e:
            raise PlanError(f"rollout (paged engine): {e}") from None
        args = paged_dp.abstract_regroup(graphdef, args, mesh)
    dp = shd.data_parallel_size(mesh)
    engines, on, per_engine = 1, mesh, b
    if dp > 1:
        on = paged_dp.data_shard_meshes(mesh)[0]
        rows = paged_dp.split_rows(b, dp)
        per_engine, engines = rows[0].stop - rows[0].start, sum(s.stop > s.start for s in rows)
        args = paged_dp.abstract_shard_params(args, mesh, on)
    if target.platform == "tpu" and 1 < on.size < mesh.size:
        on, args = _on_lowest_ids(on, mesh, args)
    kept = _kept_bytes(params, args.rest) if resident else 0
    try:
        from jaxrl_llm.train import setup as su

        options = paged.resolve_options(
            su.paged_options(
                r.paged_attention,
                r.paged_kernel_tuning,
                r.tensor_parallel,
                r.max_num_seqs,
                r.max_total_tokens,
                longest,
                r.memory_utilization,
                r.prefix_sharing,
                r.work_stealing,
            ),
            num_seqs=per_engine * g,
            num_samples=g,
            longest_prompt=longest,
            max_new_tokens=t,
        )
        if num_pages is not None:
            options = dataclasses.replace(options, num_pages=num_pages, memory_utilization=None)
        platform = jax.default_backend() if target.platform == "local" else target.platform
        kernel = paged.attention_kernel(cfg, options, cache_dtype, mesh=on, platform=platform)
    except ValueError as e:
        raise PlanError(f"rollout (paged engine): {e}") from None
    notes: tuple[str, ...] = ()
    if target.estimate and target.accelerator:
        windows = tuple(cfg.window(i) for i in range(cfg.num_layers))
        on_gpu = "reference"
        with contextlib.suppress(ValueError):
            on_gpu = pages_lib.resolve_attention(
                options.attention,
                platform="gpu",
                num_heads=cfg.num_heads,
                num_kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim,
                windows=windows,
                cache_dtype=cache_dtype,
            )
        if on_gpu != "reference" and on.size == 1:
            notes = (
                "the paged engine's programs are compiled with the reference attention on CPU; "
                f"on the GPUs they would run {on_gpu} (the same pool bytes; its temporaries "
                "are not estimated)",
            )
    rep = jax.sharding.NamedSharding(on, jax.sharding.PartitionSpec())
    stand_in = cache_dtype
    if target.estimate and target.accelerator and kernel is None and cache_dtype.itemsize == 2:
        # XLA:CPU runs a scatter into a bf16 buffer in f32 (its float normalisation): each
        # write into the pool or the dense context converts the whole buffer and back, 2x the
        # pool in temporaries that grow with it, which a GPU does not hold (nor a TPU: its
        # compiles show none). The estimate compiles the reference path's cache as its bits,
        # uint16: the same bytes, written as they are (BENCHMARKS.md, "The paged pool's
        # temporaries").
        stand_in = jnp.dtype(jnp.uint16)
    worst = paged.worst_case_programs(
        cfg,
        args,
        options,
        kernel,
        num_prompts=per_engine,
        num_samples=g,
        longest_prompt=longest,
        max_new_tokens=t,
        greedy=greedy,
        top_k=0 if top_k >= cfg.vocab_size else top_k,
        top_p=top_p,
        pad_token_id=engine._pad_id(cfg),
        cache_dtype=stand_in,
        num_stop_ids=engine._stop_ids(tuple(r.stop_token_ids or ()), cfg).shape[0],
        full_logprobs=full_logprobs,
        sharding=rep,
    )
    # The programs take the per-layer copies and the rest, not the stacked layers: a run holds
    # the resident state (with its stacked layers), the copies and what is not kept.
    compiled = {}
    for which, call in (("prefill", worst.prefill), ("decode", worst.decode)):
        with jax.set_mesh(on):
            lowered = call.fn.lower(graphdef, *call.args, static=call.static)
        compiled[which] = _program(name, lowered, resident=kept)
    pool = tree_bytes(worst.pool)  # one engine's; split by KV head over a tensor axis
    return (
        PagedRollout(
            engines=engines,
            prompts=per_engine,
            options=options,
            attention="reference" if kernel is None else kernel.name,
            pool=Bytes(pool.total * engines, pool.per_device, pool.replicated),
            prefill=compiled["prefill"],
            decode=compiled["decode"],
            prefill_rows=worst.prefill.rows,
            prefill_tokens=worst.prefill.tokens,
            prefill_table_pages=worst.prefill.table_pages,
            decode_rows=worst.decode.rows,
            decode_table_pages=worst.decode.table_pages,
        ),
        notes,
    )


def fit_paged(
    planned: tuple[PagedRollout, tuple[str, ...]],
    replan: Any,
    *,
    base: int,
    config: Any,
    target: Target,
    max_new_tokens: int | None = None,
    num_samples: int | None = None,
) -> tuple[PagedRollout, tuple[str, ...]]:
    """The paged engine's pool as a run on the target's devices sizes it
    (:func:`~jaxrl_llm.rollout.paged.fit_pool_to_memory`): with ``rollout.memory_utilization``
    u, no ``rollout.max_total_tokens`` and a known HBM per device, the pool's pages are

        ⌊(u · HBM − base − (program − resident − pool)) / page bytes⌋,

    at most every live sequence's worst case (``min(num_slots, prompts · G)`` of them):
    ``base`` what is resident while sampling (the state, or the rollout copy), the rest the
    planned program's bytes other than the pool and the state's own buffers
    (:attr:`PagedRollout.program`), the engine's reserve. The engine's own search finds the
    pages (:func:`~jaxrl_llm.rollout.paged.largest_pool`), on reserves planned here:
    ``planned`` is the default pool's plan, ``replan(num_pages)`` plans again with another
    pool (a pool that may preempt plans a larger recompute prefill). A pool below one
    sequence's worst case is planned at that size with a note: the run would stop with the
    engine's error."""
    paged, notes = planned
    r = config.rollout
    if r.memory_utilization is None or r.max_total_tokens or target.hbm_bytes is None:
        return planned
    from jaxrl_llm.rollout.paged import largest_pool, pool_pages

    o = paged.options
    t = max_new_tokens or r.max_new_tokens
    live = min(o.num_slots, paged.prompts * (num_samples or r.num_samples))
    minimum = pool_pages(1, config.data.max_prompt_length, t, o)  # one sequence and the trash
    cap = pool_pages(live, config.data.max_prompt_length, t, o)  # every live sequence
    per_seq = minimum - 1
    page = paged.pool.per_device // o.num_pages
    plans = {o.num_pages: planned}

    def plan_at(num_pages: int) -> tuple[PagedRollout, tuple[str, ...]]:
        if num_pages not in plans:
            plans[num_pages] = replan(num_pages)
        return plans[num_pages]

    def reserve_at(num_pages: int) -> int:
        p = plan_at(num_pages)[0]
        return p.program.bytes - p.program.resident - p.pool.per_device

    free = int(r.memory_utilization * target.hbm_bytes) - base
    pages, _ = largest_pool(reserve_at, free, page, minimum, cap)
    short = None
    if pages < minimum:
        short, pages = max(pages, 0), minimum
    paged, said = plan_at(int(pages))
    notes += tuple(n for n in said if n not in notes)
    if short is None and paged.options.num_pages < cap:
        held = (paged.options.num_pages - 1) // per_seq
        notes += (
            f"rollout.memory_utilization={r.memory_utilization} leaves a paged pool of "
            f"{paged.options.num_pages} pages per engine: {held} of its {live} live sequences' "
            "worst case at once; the engine admits by live tokens and preempts (recomputes) "
            "above that",
        )
    if short is not None:
        notes += (
            f"rollout.memory_utilization={r.memory_utilization} leaves {short} pages of "
            f"{page} bytes per device for the paged pool, less than one sequence's worst case "
            f"({per_seq} pages) and the trash page: the run would stop with the engine's "
            "error; planned with that minimum",
        )
    return paged, notes


def _on_lowest_ids(on: Any, mesh: Any, args: Any) -> tuple[Any, Any]:
    """One engine's sub-mesh ``on`` of ``mesh``, moved onto the ``mesh``'s devices of lowest
    ids (the same shape), with ``args`` re-homed to it: libtpu's deviceless compile refuses a
    program over a subset of a topology's chips whose ids are not ``0 .. n-1`` (an
    all-reduce's replica group over chips 0, 1, 4, 5 of a v5e:4x4 host: "Unexpected device_id
    4 ... target has 4 device_id"). The per-chip bytes are the same on any chips."""
    from jax.sharding import Mesh, NamedSharding

    lowest = sorted(mesh.devices.flat, key=lambda d: d.id)[: on.size]
    grid = np.array(lowest).reshape(on.devices.shape)
    moved = Mesh(grid, on.axis_names, axis_types=on.axis_types)

    def rehome(x: Any) -> Any:
        spec = x.sharding.spec if isinstance(x.sharding, NamedSharding) else None
        sharding = NamedSharding(moved, spec if spec is not None else jax.P())
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return moved, jax.tree.map(rehome, args)


@contextlib.contextmanager
def _attention_fallbacks() -> Any:
    """Yields a list that collects the attention module's warnings logged inside the block: an
    ``auto`` kernel that could not be traced here and fell back to the reference
    (:func:`~jaxrl_llm.models.attention.attention`)."""
    import logging

    caught: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            caught.append(record.getMessage())

    log = logging.getLogger("jaxrl_llm.models.attention")
    handler = Catch(logging.WARNING)
    log.addHandler(handler)
    try:
        yield caught
    finally:
        log.removeHandler(handler)


def _gpu_update_attention(model_cfg: Any) -> str:
    """The attention a GPU's update runs: the configured kernel, or the reference where
    ``auto``'s cuDNN cannot take the model (float32, an odd head size)."""
    from jaxrl_llm.models import attention

    q = jax.ShapeDtypeStruct((1, 2, model_cfg.num_heads, model_cfg.head_dim), model_cfg.jnp_dtype)
    return attention.implementation_for(model_cfg.attention_impl, q, q, backend="gpu")


def lower_step(
    run: AbstractRun,
    config: Any,
    recipe: Any,
    *,
    platform: str | None = None,
    lowering_platforms: tuple[str, ...] | None = None,
    emulated: bool = False,
) -> Any:
    """The fused RL step (:func:`jaxrl_llm.train.step.make_rl_step`) lowered for the run's
    abstract state and worst-case groups. ``platform``: the target's (``"tpu"``, ``"gpu"``),
    whose attention is a kernel: ``train.shared_prompts: auto`` does not share there, and
    packed rows are as wide as splash needs on TPU (the trainer decides both by the backend it
    runs on, :func:`~jaxrl_llm.train.setup.shares_prompts`). The step is traced for that
    platform (:func:`~jaxrl_llm.models.attention.for_platform`): ``model.attention: auto`` is
    its kernel (splash on a TPU, compiled by Mosaic; cuDNN on a GPU where cuDNN can be traced),
    as in the trainer on that platform, not this machine's reference attention.
    ``lowering_platforms``: lower for these rather than the devices' own (``("cuda",)``
    without a GPU: tests/test_gpu_lowering.py). ``emulated``: compiled for this machine's CPU
    standing in for ``platform`` (a GPU plan's estimate), the kernels in CPU stand-ins
    (:func:`~jaxrl_llm.models.attention.for_platform`)."""
    from jaxrl_llm.models import attention
    from jaxrl_llm.models import sharding as shd
    from jaxrl_llm.train import setup as su
    from jaxrl_llm.train import step as rl_step

    # as the trainer's (setup.py): the packed budget per device, the packing plan's attention
    dp = shd.data_parallel_size(run.models.mesh)
    update = su.update_shape(config, dp, run.model_config)
    if platform in ("tpu", "gpu"):
        update = dataclasses.replace(
            update,
            shared_prompts=update.shared_prompts and config.train.shared_prompts is True,
            width_multiple=su.packed_width_multiple(config, platform),
        )
    step = rl_step.make_rl_step(
        recipe,
        run.models,
        update,
        temperature=config.rollout.temperature or 1.0,
        old_logprobs=su.OldLogprobs(config.old_logprobs.source, config.old_logprobs.tis_cap),
    )
    on = platform if platform in ("tpu", "gpu") else None
    with attention.for_platform(on, emulated=emulated):
        return step.lower(run.state, run.groups, platforms=lowering_platforms)


# ---------------------------------------------------------------------------------------------
# Split placement: the rollout devices' copy of the policy.


@dataclasses.dataclass(frozen=True)
class RolloutSide:
    """``placement.mode: split``: what the rollout devices hold, per rollout device.

    The sampler's copy of the policy (:class:`jaxrl_llm.train.placement.RolloutWeights`): the
    TrainState's parameters on the rollout shardings (the adapters under LoRA), the frozen
    base's one copy (LoRA) and the merged copy (``merge_for_sampling``); no optimizer state,
    reference or critic (those stay on the train devices). The rollout program's KV cache,
    prompts, outputs and temporaries are the plan's ``rollout`` :class:`Program`, compiled on
    the rollout mesh.

    Attributes:
      devices: rollout devices (``placement.rollout_fraction`` of each process's).
      train_devices: the other devices (the train mesh takes the first of them).
      hosts: processes the devices were carved over (per process, as the run does).
      mesh: the rollout mesh's axis sizes (``placement.rollout_mesh``).
      preset: its rules' preset.
      parameters: the copy of the TrainState's parameters (adapters under LoRA).
      frozen: LoRA: the frozen base's copy.
      merged_copy: LoRA with ``merge_for_sampling``: ``W + s·A B``, what the sampler runs.
    """

    devices: int
    train_devices: int
    hosts: int
    mesh: dict[str, int]
    preset: str
    parameters: Bytes
    frozen: Bytes = Bytes()
    merged_copy: Bytes = Bytes()

    @property
    def copy(self) -> int:
        """Resident on a rollout device between rollouts: the copy's bytes."""
        return self.parameters.per_device + self.frozen.per_device + self.merged_copy.per_device


def rollout_copy(run: AbstractRun, placement: Any) -> tuple[Any, Any, Any, tuple[Any, Any]]:
    """The rollout's copy of ``run``'s policy on a split ``placement``'s rollout mesh, as
    shapes: ``(params, frozen, merged, (graphdef, sampler_params))`` with the shardings
    :func:`jaxrl_llm.train.placement.rollout_shardings` gives (the same logical axes, mapped by
    ``placement.rollout_rules``; what :meth:`~jaxrl_llm.train.placement.RolloutWeights.sync`
    transfers to); ``frozen`` / ``merged`` None without LoRA / ``merge_for_sampling``."""
    from jaxrl_llm.models import lora
    from jaxrl_llm.train import placement as pl

    m = run.models
    params_sh, frozen_sh = pl.rollout_shardings(
        m, run.state.params, placement.rollout_mesh, placement.rollout_rules
    )
    params = _with_sharding(_shape_only(run.state.params), params_sh)
    if m.frozen is None:
        return params, None, None, (m.graphdef, params)
    frozen = _with_sharding(_shape_only(m.frozen), frozen_sh)
    if not m.merge_for_sampling:
        return params, frozen, None, (m.graphdef, lora.combine(frozen, params))
    merged = _merged_for_sampling(m, params, frozen_sh)
    return params, frozen, merged, (m.ref_graphdef, merged)


#: Under split placement, the programs that run on the rollout devices (the rest run on the
#: train devices: the update, the evaluation sampler, which samples from the train state).
ROLLOUT_SIDE = ("rollout", "weight sync")


# ---------------------------------------------------------------------------------------------
# The plan.


@dataclasses.dataclass(frozen=True)
class Plan:
    """A run planned for a target (see the module docstring); bytes are per device.

    Split placement (``split`` set): ``parameters`` ... ``batch``, ``update`` and ``programs``
    are the train devices', ``kv_cache``, ``rollout`` and ``split`` the rollout devices'
    (:meth:`side`, :attr:`side_peaks`, :attr:`peak_side`)."""

    target: Target
    mesh: dict[str, int]
    preset: str
    model: dict[str, Any]
    parameters: Bytes
    optimizer: Bytes
    reference: Bytes
    critic: Bytes
    batch: Bytes
    kv_cache: Bytes
    rollout: Program
    update: Program
    rollout_flops_analytic: float
    update_flops_analytic: float
    seconds: float
    frozen: Bytes = Bytes()
    merged_copy: Bytes = Bytes()
    programs: tuple[Program, ...] = ()
    notes: tuple[str, ...] = ()
    split: RolloutSide | None = None
    paged: PagedRollout | None = None
    eval_paged: PagedRollout | None = None

    @property
    def rollout_engine(self) -> str:
        """``"paged"`` or ``"static"``: the engine whose programs the rollout is (``paged``:
        :class:`PagedRollout`, ``rollout`` its larger program, ``kv_cache`` its pool)."""
        return "paged" if self.paged is not None else "static"

    @property
    def state(self) -> int:
        """Resident between programs: policy (+ the frozen base under LoRA) + optimizer +
        critic (+ its optimizer and frozen trunk) + reference (none under LoRA: the base)."""
        return (
            self.parameters.per_device
            + self.frozen.per_device
            + self.optimizer.per_device
            + self.critic.per_device
            + self.reference.per_device
        )

    @property
    def rollout_peak(self) -> int:
        """The resident state plus the sampler's temporaries and outputs (its parameters are
        the state's, unless it samples from a merged copy, which is counted; its other
        inputs, the prompts, are counted too). Split placement: on a rollout device, the
        rollout's copy (:class:`RolloutSide`) in place of the train state.

        ``state + arguments − resident + outputs − aliased + temporaries`` of its program (the
        paged engine's larger one, :attr:`PagedRollout.program`), its ``resident`` the parameter
        bytes that are the state's (or the rollout copy's) own buffers: both engines run on
        :func:`~jaxrl_llm.rollout.paged.engine_params`' per-layer copies, which count; the
        paged engine's page pool is an argument donated to its output."""
        base = self.split.copy if self.split is not None else self.state
        return base + self.rollout.bytes - self.rollout.resident

    @property
    def update_peak(self) -> int:
        return self.update.bytes

    def program_peak(self, program: Program) -> int:
        """Another program's footprint on one device while the state stays resident (the
        evaluation sampler, DPO's reference pass): ``state + program.bytes − resident``, its
        ``resident`` arguments being the state's own buffers."""
        return self.state + program.bytes - program.resident

    @property
    def peaks(self) -> dict[str, int]:
        """Each program's per-device peak with the resident state (see :meth:`program_peak`)."""
        out = {"update": self.update_peak}
        if self.kv_cache.total:  # online: the rollout first (it wins ties)
            out = {"rollout": self.rollout_peak, **out}
        if self.split is not None:  # the previous version is held while the next one arrives
            out = {**out, "weight sync": self.split.copy + self.split.parameters.per_device}
        for prog in self.programs:
            out[prog.name] = self.program_peak(prog)
        return out

    def side(self, program: str) -> str | None:
        """Split placement: ``"rollout"`` or ``"train"``, the devices ``program`` runs on
        (:data:`ROLLOUT_SIDE`); None when colocated (one mesh for all)."""
        if self.split is None:
            return None
        return "rollout" if program in ROLLOUT_SIDE else "train"

    @property
    def side_peaks(self) -> dict[str, int]:
        """Split placement: the peak per device of each side, ``{"rollout": ..., "train":
        ...}`` (each the largest of its programs' :attr:`peaks`); empty when colocated."""
        out: dict[str, int] = {}
        for name, peak in self.peaks.items():
            side = self.side(name)
            if side is not None:
                out[side] = max(out.get(side, 0), peak)
        return out

    @property
    def peak_side(self) -> str | None:
        """Split placement: the side of the peak program (the tighter one: the devices are
        the same chips, so FITS needs both, and the margin is the tighter side's)."""
        return self.side(self.peak_program)

    @property
    def peak(self) -> int:
        return max(self.peaks.values())

    @property
    def peak_program(self) -> str:
        peaks = self.peaks
        return max(peaks, key=peaks.get)

    @property
    def fits(self) -> bool | None:
        return None if self.target.hbm_bytes is None else self.peak <= self.target.hbm_bytes

    @property
    def margin(self) -> int | None:
        return None if self.target.hbm_bytes is None else self.target.hbm_bytes - self.peak

    @property
    def flops_per_step(self) -> float:
        """Per device, analytic: the rollout's and the update's (see the module docstring;
        split placement: a rollout device's and a train device's)."""
        return self.update_flops_analytic + self.rollout_flops_analytic

    def to_dict(self) -> dict[str, Any]:
        """Everything as JSON-ready values (``--json``)."""

        def b(x: Bytes) -> dict[str, int]:
            return dataclasses.asdict(x)

        def prog(p: Program) -> dict[str, Any]:
            return {**dataclasses.asdict(p), "bytes": p.bytes}

        placement: dict[str, Any] = {"mode": "colocated"}
        if self.split is not None:
            sp, peaks = self.split, self.peaks
            placement = {
                "mode": "split",
                "hosts": sp.hosts,
                "peak_side": self.peak_side,
                "rollout": {
                    "devices": sp.devices,
                    "mesh": sp.mesh,
                    "preset": sp.preset,
                    "per_device_bytes": {
                        "parameters": b(sp.parameters),
                        "frozen": b(sp.frozen),
                        "merged_copy": b(sp.merged_copy),
                        "kv_cache": b(self.kv_cache),
                        "copy": sp.copy,
                        "peaks": {k: v for k, v in peaks.items() if self.side(k) == "rollout"},
                        "peak": self.side_peaks["rollout"],
                    },
                },
                "train": {
                    "devices": sp.train_devices,
                    "mesh_devices": math.prod(self.mesh.values()),
                    "mesh": self.mesh,
                    "preset": self.preset,
                    "per_device_bytes": {
                        "parameters": b(self.parameters),
                        "frozen": b(self.frozen),
                        "optimizer": b(self.optimizer),
                        "reference": b(self.reference),
                        "critic": b(self.critic),
                        "batch": b(self.batch),
                        "state": self.state,
                        "peaks": {k: v for k, v in peaks.items() if self.side(k) == "train"},
                        "peak": self.side_peaks["train"],
                    },
                },
            }
        return {
            "target": {**dataclasses.asdict(self.target), "estimate": self.target.estimate},
            "placement": placement,
            "mesh": self.mesh,
            "preset": self.preset,
            "model": self.model,
            "per_device_bytes": {
                "parameters": b(self.parameters),
                "frozen": b(self.frozen),
                "merged_copy": b(self.merged_copy),
                "optimizer": b(self.optimizer),
                "reference": b(self.reference),
                "critic": b(self.critic),
                "batch": b(self.batch),
                "kv_cache": b(self.kv_cache),
                "state": self.state,
                "rollout_peak": self.rollout_peak,
                "update_peak": self.update_peak,
                "peaks": self.peaks,
                "peak": self.peak,
            },
            "programs": {
                "rollout": prog(self.rollout),
                "update": prog(self.update),
                **{p.name: prog(p) for p in self.programs},
            },
            "peak_program": self.peak_program,
            "rollout_engine": self.rollout_engine,
            "paged": None if self.paged is None else _paged_dict(self.paged),
            "eval_paged": None if self.eval_paged is None else _paged_dict(self.eval_paged),
            "flops_per_step": {
                "update_xla_loop_bodies_once": self.update.flops,
                "rollout_xla_loop_bodies_once": self.rollout.flops,
                "rollout_analytic": self.rollout_flops_analytic,
                "update_analytic": self.update_flops_analytic,
                "total": self.flops_per_step,
            },
            "hbm_bytes": self.target.hbm_bytes,
            "fits": self.fits,
            "margin_bytes": self.margin,
            "seconds": self.seconds,
            "notes": list(self.notes),
        }


def _paged_dict(paged: PagedRollout) -> dict[str, Any]:
    out = dataclasses.asdict(paged)
    for which in ("prefill", "decode"):
        out[which]["bytes"] = getattr(paged, which).bytes
    out["planned"] = "decode" if paged.program is paged.decode else "prefill"
    return out


def _mib(n: int) -> str:
    if abs(n) >= GiB:
        return f"{n / GiB:,.2f} GiB"
    return f"{n / 2**20:,.1f} MiB"


def _flops(program: Program) -> str:
    return "not reported" if program.flops is None else f"{program.flops:.3e}"


def format_plan(plan: Plan) -> str:
    """The plan as the table ``jaxrl-llm plan`` prints."""
    t = plan.target
    m = plan.model
    kind = "estimate: compiled for CPU devices" if t.estimate else t.device_kind
    kind += f", {t.topology}" if t.topology else ""
    lines = [
        f"plan for {t.name} ({t.num_devices} devices; {kind})",
        f"model {m['path']}: {m['parameters']:,} parameters, {m['layers']} layers, "
        f"dtype {m['dtype']}, params {m['param_dtype']}, remat {m['remat']}"
        + (
            f"; LoRA rank {m['lora']['rank']} ({m['trainable_parameters']:,} trainable), "
            f"base {m['lora']['quantize'] if m['lora']['quantize'] != 'none' else 'frozen'}"
            if m.get("lora")
            else ""
        ),
        "mesh " + ", ".join(f"{k}={v}" for k, v in plan.mesh.items()) + f" (preset {plan.preset})",
        *_engine_lines(plan),
        "",
        f"{'per device':<34}{'bytes':>14}{'of which replicated':>22}",
    ]
    sp = plan.split
    if sp is not None:  # two meshes, two blocks
        hosts = f"{sp.hosts} host{'s' if sp.hosts > 1 else ''}"
        lines[2:] = [
            f"placement split: {sp.devices} rollout + {sp.train_devices} train devices "
            f"(carved per process, {hosts})",
            "train mesh "
            + ", ".join(f"{k}={v}" for k, v in plan.mesh.items())
            + f" (preset {plan.preset}) on {math.prod(plan.mesh.values())} of the "
            f"{sp.train_devices} train devices",
            "rollout mesh "
            + ", ".join(f"{k}={v}" for k, v in sp.mesh.items())
            + f" (preset {sp.preset}) on {math.prod(sp.mesh.values())} of the {sp.devices} "
            "rollout devices",
            *_engine_lines(plan),
            "",
            f"{'train devices, per device':<34}{'bytes':>14}{'of which replicated':>22}",
        ]

    def row(label: str, x: Bytes | int) -> None:
        if isinstance(x, Bytes):
            rep = _mib(x.replicated) if x.replicated else ""
            lines.append(f"{label:<34}{_mib(x.per_device):>14}{rep:>22}")
        else:
            lines.append(f"{label:<34}{_mib(x):>14}")

    if sp is not None:
        _split_rows(plan, lines, row)
    else:
        _colocated_rows(plan, row)
    compiled = " + ".join(
        f"{p.compile_s:.1f} s ({p.name})"
        for p in (plan.rollout, plan.update, *plan.programs)
        if p.name in plan.peaks
    )
    flops = (
        f"FLOPs per step per device: {plan.flops_per_step:.3e} = update "
        f"{plan.update_flops_analytic:.3e} + rollout {plan.rollout_flops_analytic:.3e} "
    )
    peak = f"peak program: {plan.peak_program}, {_mib(plan.peak)} per device"
    if sp is not None:
        sides = plan.side_peaks
        flops = (
            f"FLOPs per step: update {plan.update_flops_analytic:.3e} per train device, rollout "
            f"{plan.rollout_flops_analytic:.3e} per rollout device "
        )
        peak = (
            f"peak program: {plan.peak_program} on the {plan.peak_side} devices, "
            f"{_mib(plan.peak)} per device (rollout devices {_mib(sides['rollout'])}, train "
            f"devices {_mib(sides['train'])})"
        )
    lines += [
        "",
        peak,
        flops + f"(6N/2N per token; XLA, counting loop bodies once: {_flops(plan.update)} + "
        f"{_flops(plan.rollout)})",
        f"compiled in {compiled}; plan took {plan.seconds:.1f} s",
    ]
    if t.hbm_bytes is None:
        lines.append("no device memory given (--device-memory): no FITS verdict")
    else:
        verdict = "FITS" if plan.fits else "DOES NOT FIT"
        margin = plan.margin
        both = f" (both sides; the {plan.peak_side} devices are the tighter)" if sp else ""
        lines.append(
            f"{verdict}{both}: peak {_mib(plan.peak)} of {_mib(t.hbm_bytes)} HBM "
            f"({t.hbm_source}); margin {_mib(margin)} ({100 * margin / t.hbm_bytes:+.1f}%)"
        )
    if t.estimate:
        lines.append(
            "(an estimate: XLA:CPU's buffer assignment stands in for the GPU's; --topology "
            "h200-8 / h100-8 compiles with XLA:GPU itself, with JAX's CUDA plugin installed)"
        )
    for p in (plan.rollout, plan.update, *plan.programs):
        if p.refused is not None:
            lines.append(
                f"note: the target's compiler refused the {p.name} program for lack of memory "
                f"({p.refused}); its figures are a lower bound: the {_mib(p.temporaries)} it "
                "reported needing"
            )
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def _engine_lines(plan: Plan) -> list[str]:
    """Which rollout engine was planned (online runs), and the evaluation's if paged."""
    if not plan.kv_cache.total:
        return []
    if plan.paged is None:
        return ["rollout: static engine (one dense batch, P + T KV slots per row)"]
    lines = [f"rollout: {plan.paged.describe()}"]
    if plan.eval_paged is not None:
        lines.append(f"eval rollout: {plan.eval_paged.describe()}")
    return lines


def _kv_label(plan: Plan) -> str:
    return "KV cache (paged pool)" if plan.paged is not None else "KV cache (rollout)"


def _state_rows(plan: Plan, row: Any) -> None:
    """The train state's rows: parameters (or adapters), the frozen base, the optimizer, the
    reference and the critic."""
    lora_info = plan.model.get("lora")
    row("adapters (LoRA)" if lora_info else "parameters", plan.parameters)
    if plan.frozen.total:
        q = lora_info["quantize"] if lora_info else "none"
        label = "frozen base" + ("" if q == "none" else f" ({q})")
        row(label + (" = reference" if lora_info.get("reference_is_base") else ""), plan.frozen)
    row("optimizer state", plan.optimizer)
    if plan.reference.total:
        row("reference model", plan.reference)
    if plan.critic.total:
        row("critic (+ its optimizer)", plan.critic)


def _split_rows(plan: Plan, lines: list[str], row: Any) -> None:
    """The two blocks of a split plan: the train devices', then the rollout devices'."""
    sp, lora_info = plan.split, plan.model.get("lora")
    _state_rows(plan, row)
    row("step batch (groups)", plan.batch)
    row("update temporaries (XLA)", plan.update.temporaries)
    for prog in plan.programs:
        row(f"{prog.name} temporaries (XLA)", prog.temporaries)
    row("update peak (args+out-alias+temp)", plan.update_peak)
    for prog in plan.programs:
        row(f"{prog.name} peak (state + it)", plan.program_peak(prog))
    lines += ["", f"{'rollout devices, per device':<34}{'bytes':>14}{'of which replicated':>22}"]
    row("adapters (rollout copy)" if lora_info else "parameters (rollout copy)", sp.parameters)
    if sp.frozen.total:
        row("frozen base (rollout copy)", sp.frozen)
    if sp.merged_copy.total:
        row("merged copy (sampled)", sp.merged_copy)
    row(_kv_label(plan), plan.kv_cache)
    row("rollout temporaries (XLA)", plan.rollout.temporaries)
    row("rollout peak (copy + rollout)", plan.rollout_peak)
    row("weight sync peak (old + new copy)", plan.peaks["weight sync"])


def _colocated_rows(plan: Plan, row: Any) -> None:
    """The one block of a colocated plan (every program on the one mesh)."""
    _state_rows(plan, row)
    if plan.merged_copy.total:
        row("merged copy (rollout)", plan.merged_copy)
    row("step batch" + (" (groups)" if plan.kv_cache.total else " (pairs)"), plan.batch)
    if plan.kv_cache.total:
        row(_kv_label(plan), plan.kv_cache)
    if plan.kv_cache.total:
        row("rollout temporaries (XLA)", plan.rollout.temporaries)
    row("update temporaries (XLA)", plan.update.temporaries)
    for prog in plan.programs:
        row(f"{prog.name} temporaries (XLA)", prog.temporaries)
    if plan.kv_cache.total:
        row("rollout peak (state + rollout)", plan.rollout_peak)
    row("update peak (args+out-alias+temp)", plan.update_peak)
    for prog in plan.programs:
        row(f"{prog.name} peak (state + it)", plan.program_peak(prog))


def _update_flops(config: Any, recipe: Any, run: AbstractRun) -> float:
    """The RL step's FLOPs over the mesh, analytically (see the module docstring). Under LoRA
    the backward pass computes no gradient of the frozen weights, so a training pass is
    ``4N`` (``6N`` with remat) rather than ``6N``; the adapters' own FLOPs are left out."""
    from jaxrl_llm.train import setup as su
    from jaxrl_llm.train.step import needs_old_logprob_pass

    n, critic = float(run.num_parameters), float(run.num_critic_parameters)
    b, g, t = run.groups.tokens_bgt.shape
    tokens = b * g * (run.prompt_width + t)
    update = su.update_shape(config)
    old = su.OldLogprobs(config.old_logprobs.source, config.old_logprobs.tis_cap)
    forwards = (
        2 * n * ((run.models.ref_params is not None) + needs_old_logprob_pass(recipe, update, old))
    )
    train = (6 if run.model_config.remat != "none" else 4) * update.epochs
    train_lora = train
    train += 2 * update.epochs  # the weights' own gradients (Kaplan's 6N = 2N + 4N)
    policy = (train_lora if run.models.frozen is not None else train) * n
    critic_train = (train_lora if run.models.critic_frozen is not None else train) * critic
    return tokens * (forwards + 2 * critic + policy + critic_train)


def plan_run(config: Any, target: Target) -> Plan:
    """Plans ``config`` (a :class:`~jaxrl_llm.config.TrainConfig`; an online recipe, or an
    offline one, :func:`_plan_offline`) for ``target`` in this process (which must have the
    target's devices; see :func:`plan_in_subprocess` for CPU estimates).

    With ``placement.mode: split`` the target's devices are carved as the run carves them
    (:func:`jaxrl_llm.train.placement.carve_devices`, per process: the target's hosts, from
    its devices' ``process_index``): the update (and the evaluation sampler) is planned on the
    train mesh over the train devices, with the train state, reference and critic resident;
    the rollout on the rollout mesh (``placement.rollout_mesh``) over the rollout devices, with
    the rollout's copy of the policy (:func:`rollout_copy`, :class:`RolloutSide`) resident.

    Raises:
      PlanError / ConfigError: a bad target, a mesh that does not divide the devices (split:
        the train or the rollout devices) or the batch, a missing model path.
    """
    from jaxrl_llm.config import ConfigError, build_recipe, check_devices, mesh_axis_sizes
    from jaxrl_llm.models import sharding as shd
    from jaxrl_llm.train import placement as pl

    t0 = time.perf_counter()
    split = config.placement.mode == "split"
    devices = target_devices(target)
    hosts = len({getattr(d, "process_index", 0) for d in devices})
    try:
        sizes = check_devices(config, target.num_devices, process_count=hosts)
        placement = None
        if split:
            r = config.placement.rollout_mesh
            fraction = config.placement.rollout_fraction
            rollout_devices, train_devices = pl.carve_devices(devices, fraction, hosts)
            placement = pl.split_placement(
                devices,
                fraction=fraction,
                rollout_sizes=mesh_axis_sizes(
                    r, len(rollout_devices), where="placement.rollout_mesh"
                ),
                rollout_rules=shd.PRESETS[r.preset],
                process_count=hosts,
            )
    except (ConfigError, ValueError) as e:
        raise PlanError(f"{e} (target {target.name})") from None
    recipe = build_recipe(config)
    model_cfg = model_config(config.model, accelerator=target.accelerator)
    on = placement.train_devices if split else devices
    notes: tuple[str, ...] = ()
    if split and target.platform == "tpu":
        placement, on, said = _tpu_stand_ins(
            placement, math.prod(sizes.values()), devices, target, fraction
        )
        notes += said
    mesh = shd.make_mesh(**sizes, devices=on[: math.prod(sizes.values())])
    if config.rollout is None:
        return _plan_offline(config, recipe, target, mesh, sizes, model_cfg, t0)
    run = abstract_run(config, recipe, mesh, model_cfg)
    side = None
    rollout_mesh = mesh
    if split:
        params, frozen, merged_copy, sampler = rollout_copy(run, placement)
        rollout_mesh = placement.rollout_mesh
        side = RolloutSide(
            devices=len(rollout_devices),
            train_devices=len(train_devices),
            hosts=hosts,
            mesh=dict(rollout_mesh.shape),
            preset=config.placement.rollout_mesh.preset,
            parameters=tree_bytes(params),
            frozen=tree_bytes(frozen),
            merged_copy=tree_bytes(merged_copy),
        )
        rollout_run = dataclasses.replace(run, sampler=sampler)
    else:
        rollout_run = run
    merged = run.models.merge_for_sampling and run.models.frozen is not None
    paged = paged_eval = None
    s = run.state
    state = dict(
        parameters=tree_bytes(s.params),
        optimizer=tree_bytes(s.opt_state),
        # under LoRA the reference is the frozen base (counted there), not a copy
        reference=tree_bytes(None if run.models.frozen is not None else run.models.ref_params),
        critic=tree_bytes((s.critic_params, s.critic_opt_state, run.models.critic_frozen)),
        frozen=tree_bytes(run.models.frozen),
    )
    held = sum(b.per_device for b in state.values())  # Plan.state, while sampling
    base = side.copy if side is not None else held  # split: the rollout copy's
    if rollout_engine(config, hosts) == "paged":

        def plan_rollout(num_pages: int | None = None) -> Any:
            return plan_paged_rollout(
                rollout_run,
                config,
                target,
                mesh=rollout_mesh,
                resident=split or not merged,  # split: the merged copy is the rollout copy's
                full_logprobs=config.rollout.full_logprobs,
                num_pages=num_pages,
            )

        paged, said = fit_paged(
            plan_rollout(), plan_rollout, base=base, config=config, target=target
        )
        rollout, kv = paged.program, paged.pool
        notes += said
    else:
        rollout_lowered, kv, kept = lower_rollout(rollout_run, config, target, mesh=rollout_mesh)
        # split: the merged copy is the rollout copy's (as for the paged engine)
        rollout = _program("rollout", rollout_lowered, resident=kept if split or not merged else 0)
    # LoRA: the frozen base is both the reference and the base argument, one buffer at run time
    lora_ref = run.models.frozen is not None and run.models.ref_params is run.models.frozen
    shared = tree_bytes(run.models.frozen).per_device if lora_ref else 0
    # GPUs (a CPU estimate): the step traced as on a GPU (no shared prompts under its kernels,
    # accelerator-sized logits blocks), its attention in a CPU stand-in, compiled by XLA:CPU
    gpu = target.estimate and target.accelerator
    platform = "gpu" if gpu else target.platform
    with _attention_fallbacks() as fell_back:
        lowered = lower_step(run, config, recipe, platform=platform, emulated=gpu)
    kernel = _gpu_update_attention(model_cfg) if gpu else "reference"
    if kernel == "cudnn":
        notes += (
            "the update's attention is cuDNN on the GPUs, estimated with the reference attention "
            "(its query blocks); cuDNN's dense [B, 1, T, S] mask of packed rows is not counted "
            "(model.attention: pallas_gpu has none)",
        )
    elif kernel == "pallas_gpu":
        notes += (
            "the update's attention is the Pallas GPU kernel, compiled interpreted on CPU (its "
            "blocks' buffers; Triton's own are not estimated)",
        )
    if fell_back:  # auto's cuDNN could not be traced here (no cuDNN library): not the GPUs'
        notes += (
            f"the update's attention was compiled as the reference attention ({fell_back[0]}); "
            'on the GPUs it is cuDNN (pip install -e ".[gpu-plan]" installs cuDNN; or plan '
            "model.attention=pallas_gpu)",
        )
    update = _program("update", lowered, shared=shared)
    programs = []
    evaluation = _eval_shape(config)
    if evaluation is not None and paged is not None:  # the evaluation samples as the rollout

        def plan_eval(num_pages: int | None = None) -> Any:
            return plan_paged_rollout(
                run,
                config,
                target,
                name="eval rollout",
                resident=not merged,
                num_pages=num_pages,
                **evaluation,
            )

        paged_eval, said = fit_paged(
            plan_eval(),
            plan_eval,
            base=held,
            config=config,
            target=target,
            max_new_tokens=evaluation.get("max_new_tokens"),
            num_samples=evaluation.get("num_samples"),
        )
        programs.append(paged_eval.program)
        notes += tuple(n for n in said if n not in notes)
    elif evaluation is not None:
        lowered, _, kept = lower_rollout(run, config, target, **evaluation)
        programs.append(_program("eval rollout", lowered, resident=0 if merged else kept))
    n_params = run.num_parameters
    r = config.rollout
    tokens = r.prompts_per_step * (run.prompt_width + r.num_samples * r.max_new_tokens)
    return Plan(
        target=target,
        mesh=dict(sizes),
        preset=config.mesh.preset,
        model=_model_info(config, model_cfg, n_params, s.params, run.models.ref_params is not None),
        **state,
        batch=tree_bytes(run.groups),
        kv_cache=kv,
        rollout=rollout,
        update=update,
        rollout_flops_analytic=2.0 * n_params * tokens / rollout_mesh.size,
        update_flops_analytic=_update_flops(config, recipe, run) / mesh.size,
        seconds=time.perf_counter() - t0,
        merged_copy=tree_bytes(run.sampler[1]) if merged and not split else Bytes(),
        programs=tuple(programs),
        notes=notes,
        split=side,
        paged=paged,
        eval_paged=paged_eval,
    )


def _tpu_stand_ins(
    placement: Any, train_size: int, devices: Sequence[Any], target: Target, fraction: float
) -> tuple[Any, Sequence[Any], tuple[str, ...]]:
    """Split placement on a TPU topology: ``(placement, train_devices, notes)`` with each side's
    mesh on devices libtpu's deviceless compiler accepts, the same mesh shape.

    Seen with libtpu 0.0.42.1 on ``v5e:4x4`` (4 hosts of 4 chips): a program over the carved
    rollout chips ``[0, 2, 8, 10]`` (one per host) fails ("RET_CHECK failure ... Unexpected
    device_id 8 ... target has 4 device_id"), one over 12 of the 16 chips aborts the process
    ("total_device_count % num_participants_per_group == 0"); over the topology's devices
    ``0 .. n-1`` with ``n`` dividing the chips, or over a slice of ``n`` chips of its own
    (``v5e:2x6`` for 12), they compile. So each side is compiled over the first ``n`` devices
    of the target's topology when ``n`` divides it, else on an ``n``-chip topology of the same
    family. The per-device bytes depend on the mesh's shape and the shardings, not on which
    chips hold them.

    Raises:
      PlanError: a side's chip count neither divides the topology nor makes a slice of its own
        (a multiple of 4 chips), naming ``placement.rollout_fraction``.
    """
    from jaxrl_llm.models import sharding as shd

    family = (target.topology or "").partition(":")[0]
    by_id = sorted(devices, key=lambda d: d.id)
    notes = []

    def compilable(side: str, carved: Sequence[Any]) -> Sequence[Any]:
        n = len(carved)
        ids = sorted(d.id for d in carved)
        if target.num_devices % n == 0:
            if ids == list(range(n)):
                return carved
            notes.append(f"the {side} mesh over the topology's devices 0..{n - 1}")
            return by_id[:n]
        if n % 4:
            raise PlanError(
                f"placement.rollout_fraction = {fraction!r}: the {side} side's {n} "
                f"chips of {target.topology} neither divide its {target.num_devices} chips nor "
                "make a TPU slice of their own (a multiple of 4 chips), which libtpu's "
                "deviceless compiler needs; choose a fraction that gives such counts, or plan "
                "with --devices N --device-memory SIZE (a CPU estimate)"
            )
        dims = f"2x2x{n // 4}" if family == "v5p" else f"2x{n // 2}"
        topology = f"{family}:{dims}"
        stand_in = dataclasses.replace(target, topology=topology, num_devices=n)
        notes.append(f"the {side} mesh on a {topology} slice of its own")
        return target_devices(stand_in)

    rollout = placement.rollout_mesh
    carved = list(rollout.devices.flat)
    on = compilable("rollout", carved)
    if on is not carved:
        stand_in = shd.make_mesh(**dict(rollout.shape), devices=on)
        placement = dataclasses.replace(placement, rollout_mesh=stand_in)
    train = compilable("train", list(placement.train_devices[:train_size]))
    if notes:
        notes = [
            "TPU, split: compiled (same mesh shapes) with "
            + " and ".join(notes)
            + ", as libtpu's deviceless compiler refuses the carved chips (plan._tpu_stand_ins)"
        ]
    return placement, train, tuple(notes)


def _plan_offline(
    config: Any,
    recipe: Any,
    target: Target,
    mesh: jax.sharding.Mesh,
    sizes: Mapping[str, int],
    model_cfg: Any,
    t0: float,
) -> Plan:
    """A preference (DPO-family) run: the reference's log-prob pass over the chosen and the
    rejected answers (:func:`jaxrl_llm.train.collect.dpo_batch`), the update
    (:func:`jaxrl_llm.train.update.make_dpo_step`) and, with held-out prompts, the greedy
    evaluation sampler; ``N = preference.pairs_per_step`` pairs of ``P + T`` tokens, ``T`` the
    longest answer padded to the trainer's multiple."""
    from jaxrl_llm.train import forward, hostmem
    from jaxrl_llm.train import setup as su
    from jaxrl_llm.train import state as st
    from jaxrl_llm.train import update as up

    run = abstract_run(config, recipe, mesh, model_cfg)
    models_ = run.models
    n, p = config.preference.pairs_per_step, run.prompt_width
    t = -(-config.preference.max_response_length // su.PAD_MULTIPLE) * su.PAD_MULTIPLE
    dp = _dp(mesh)
    sh = models_.batch_sharding(2) if n % dp == 0 else st.replicated(mesh)
    sh1 = models_.batch_sharding(1) if n % dp == 0 else st.replicated(mesh)
    tokens = jax.ShapeDtypeStruct((n, p + t), jnp.int32, sharding=sh)
    mask = jax.ShapeDtypeStruct((n, p + t), bool, sharding=sh)
    answer = jax.ShapeDtypeStruct((n, t), bool, sharding=sh)
    ref = models_.ref_params
    seq = None if ref is None else jax.ShapeDtypeStruct((n,), jnp.float32, sharding=sh1)
    batch = up.DPOBatch(tokens, mask, answer, tokens, mask, answer, seq, seq)
    update = su.update_shape(config)
    programs = []
    if ref is not None:
        logprob = forward.make_logprob_fn(
            models_.graphdef, micro_batch_size=update.micro_batch_size
        )
        fn = jax.jit(
            lambda r, x, m: logprob(r, x, m, completion_len=t, graphdef=models_.ref_graphdef)
        )
        with jax.set_mesh(mesh):
            lowered = fn.lower(ref, tokens, mask)
        programs.append(_program("reference pass", lowered, resident=tree_bytes(ref).per_device))

    # make_dpo_step jits through accumulate.jit_step, which runs the program at once; its
    # traceable step and arguments are taken here and jitted the same way (state donated, the
    # batch over the batch axes, LoRA's frozen base a non-donated argument) to be lowered.
    taken: dict[str, Any] = {}

    def take(step_fn: Any, *, consts: tuple = (), **_: Any) -> Any:
        taken.update(step_fn=step_fn, consts=consts)
        return step_fn

    from unittest import mock

    from jaxrl_llm.train import accumulate as acc

    with mock.patch.object(acc, "jit_step", take):
        up.make_dpo_step(
            recipe,
            models_.graphdef,
            models_.tx,
            schedule=models_.schedule,
            ppo_epochs=update.epochs,
            num_minibatches=update.num_minibatches,
            micro_batch_size=update.micro_batch_size,
            mesh=mesh,
            state_sharding=models_.state_sharding,
            rules=models_.rules,
            frozen=models_.frozen,
        )
    consts = taken["consts"]
    jitted = jax.jit(
        taken["step_fn"],
        in_shardings=(
            models_.state_sharding,
            jax.tree.map(lambda x: x.sharding, batch),
            *jax.tree.map(lambda x: x.sharding, consts),
        ),
        out_shardings=(models_.state_sharding, st.replicated(mesh)),
        donate_argnums=0,
        compiler_options=hostmem.update_compiler_options(mesh),
    )
    with jax.set_mesh(mesh):
        update_program = _program("update", jitted.lower(run.state, batch, *consts))
    evaluation = _eval_shape(config)
    if evaluation is not None:
        lowered, _, kept = lower_rollout(run, config, target, **evaluation)
        programs.append(_program("eval rollout", lowered, resident=kept))
    s = run.state
    train = 6 if run.model_config.remat != "none" else 4
    train += 0 if models_.frozen is not None else 2
    sequences = 2 * n * (p + t)
    flops = sequences * run.num_parameters * ((2 if ref is not None else 0) + train * update.epochs)
    none = Program("rollout", 0, 0, 0, 0, 0, 0.0, 0.0)
    return Plan(
        target=target,
        mesh=dict(sizes),
        preset=config.mesh.preset,
        model=_model_info(config, model_cfg, run.num_parameters, s.params, ref is not None),
        parameters=tree_bytes(s.params),
        optimizer=tree_bytes(s.opt_state),
        reference=tree_bytes(None if models_.frozen is not None else ref),
        critic=Bytes(),
        batch=tree_bytes(batch),
        kv_cache=Bytes(),
        rollout=none,
        update=update_program,
        rollout_flops_analytic=0.0,
        update_flops_analytic=flops / mesh.size,
        seconds=time.perf_counter() - t0,
        frozen=tree_bytes(models_.frozen),
        programs=tuple(programs),
    )


def _dp(mesh: jax.sharding.Mesh) -> int:
    from jaxrl_llm.models import sharding as shd

    return shd.data_parallel_size(mesh)


def _model_info(
    config: Any, model_cfg: Any, n_params: int, trainable: Any, reference: bool
) -> dict[str, Any]:
    lora_section = config.model.lora
    return {
        "path": config.model.path,
        "parameters": int(n_params),
        "trainable_parameters": _count(trainable),
        "layers": model_cfg.num_layers,
        "hidden_size": model_cfg.hidden_size,
        "heads": model_cfg.num_heads,
        "kv_heads": model_cfg.num_kv_heads,
        "vocab_size": model_cfg.vocab_size,
        "dtype": model_cfg.dtype,
        "param_dtype": model_cfg.param_dtype,
        "remat": model_cfg.remat,
        "lora": None
        if lora_section is None
        else {
            "rank": lora_section.rank,
            "quantize": lora_section.quantize,
            "reference_is_base": reference,
        },
    }


def _eval_shape(config: Any) -> dict[str, Any] | None:
    """The evaluation sampler's shape (:func:`jaxrl_llm.train.evaluation.evaluate`: at most 64
    prompts, ``64 // K`` with ``K = train.eval_num_samples``; greedy unless K > 1 or
    ``eval_mode: sampled``), or None when the run has no held-out prompts."""
    d, t = config.data, config.train
    if not d.eval_size and not d.eval_path:
        return None
    k = t.eval_num_samples
    prompts = max(1, min(d.eval_size or 64, 64 // max(1, k)))
    greedy = k == 1 and t.eval_mode == "greedy"
    max_new = t.eval_max_new_tokens or (
        config.rollout.max_new_tokens
        if config.rollout is not None
        else config.preference.max_response_length
    )
    return {"prompts": prompts, "num_samples": k, "max_new_tokens": max_new, "greedy": greedy}


LORA_RANK = 16
"""The adapters' rank :func:`candidates` suggests (PEFT's and TRL's examples use 8-64)."""


def candidates(config: Any, plan: Plan) -> list[tuple[str, list[str]]]:
    """Changes that lower a run's peak, as ``(what, overrides)``: FSDP over every device, full
    remat, a bfloat16 reference, tensor parallelism, where the paged rollout is the peak paged
    engines of several devices (:func:`_rollout_tensor_parallel`) and the static engine, half
    the micro-batch (down to one row per data-parallel device; with packing, half
    ``micro_batch_tokens`` down to the longest sequence), and all of those together. None
    changes the recipe's math (a bf16 reference rounds π_ref's parameters; remat and
    micro-batches are exact). Then, for a full fine-tuning run, LoRA and QLoRA (nf4) of rank
    :data:`LORA_RANK` on every projection, which do change what is trained (Hu et al. 2021;
    Dettmers et al. 2023)."""
    found: list[tuple[str, list[str]]] = []
    sizes, devices = plan.mesh, plan.target.num_devices
    if plan.split is not None:  # the train mesh's own devices (mesh.fsdp=-1 takes them all)
        devices = plan.split.train_devices
    if sizes["fsdp"] * sizes["tensor"] < devices:
        preset = "fsdp" if config.mesh.preset == "dp" else config.mesh.preset
        found.append(
            (
                f"FSDP over all {devices} devices",
                [f"mesh.preset={preset}", "mesh.data=1", "mesh.fsdp=-1"],
            )
        )
    if config.model.remat == "none":
        found.append(
            ("full remat (recompute activations in the backward pass)", ["model.remat=full"])
        )
    if plan.reference.total and config.kl.reference_param_dtype == "float32":
        found.append(("bfloat16 reference model", ["kl.reference_param_dtype=bfloat16"]))
    heads = plan.model["kv_heads"]
    tensor = next((k for k in (4, 2) if devices % k == 0 and heads % k == 0), 1)
    if config.mesh.preset != "fsdp_tp" and sizes["tensor"] == 1 and tensor > 1:
        found.append(
            (
                f"tensor parallelism {tensor} x FSDP {devices // tensor} (fewer gathered weights "
                "per device)",
                ["mesh.preset=fsdp_tp", "mesh.data=1", "mesh.fsdp=-1", f"mesh.tensor={tensor}"],
            )
        )
    dp = sizes["data"] * sizes["fsdp"]
    paged_peak = plan.rollout_engine == "paged" and plan.peak_program.endswith("rollout")
    t = _rollout_tensor_parallel(plan) if paged_peak and plan.split is None else 0
    if t and t > config.rollout.tensor_parallel:
        found.append(
            (
                f"paged engines of {t} devices each, the weights split over them (each of "
                f"the {dp} per-shard engines holds a gathered copy)",
                [f"rollout.tensor_parallel={t}"],
            )
        )
    if paged_peak and dp > 1:
        found.append(
            (
                "the static rollout engine (it samples on the sharded weights; each of the "
                f"paged engine's {dp} per-shard engines holds a gathered copy)",
                ["rollout.engine=static"],
            )
        )
    minibatch = config.update_batch_size // config.optim.num_minibatches
    micro = config.optim.micro_batch_size or minibatch
    half = (micro // 2) // dp * dp
    if not config.train.packing and half >= dp and minibatch % half == 0:
        found.append(
            (f"micro-batches of {half} rows (was {micro})", [f"optim.micro_batch_size={half}"])
        )
    tokens = config.optim.micro_batch_tokens
    packed = config.train.packing and config.rollout is not None and tokens is not None
    if packed and tokens // 2 >= config.data.max_prompt_length + config.rollout.max_new_tokens:
        found.append(
            (
                f"packed micro-batches of {tokens // 2} tokens per device (was {tokens})",
                [f"optim.micro_batch_tokens={tokens // 2}"],
            )
        )
    if len(found) > 1:
        merged = {}
        for _, overrides in found:
            merged.update(o.split("=", 1) for o in overrides)
        if "rollout.tensor_parallel" in merged:  # the two rollout changes are alternatives
            merged.pop("rollout.engine", None)
        found.append(("all of the above", [f"{k}={v}" for k, v in merged.items()]))
    if config.model.lora is None:  # changes what is trained: offered apart, last
        critic = bool(plan.critic.total)
        for quantize, what in (("none", "LoRA"), ("nf4", "QLoRA (nf4 base)")):
            lora = [f"model.lora.rank={LORA_RANK}", f"model.lora.quantize={quantize}"]
            if critic:
                lora += [f"critic.lora.rank={LORA_RANK}", f"critic.lora.quantize={quantize}"]
            found.append(
                (
                    f"{what} rank {LORA_RANK} on every projection (trains adapters, not the "
                    "model; the frozen base is the reference)",
                    lora,
                )
            )
    return found


def _rollout_tensor_parallel(plan: Plan) -> int:
    """The devices per paged engine :func:`candidates` suggests: the largest of 8, 4, 2 that
    divides each process's devices (an engine's devices belong to one host, as vLLM's
    tensor-parallel group does) and the query and KV heads; 0 (nothing to suggest) when none
    does: engines of one device are what the run has already."""
    devices = target_devices(plan.target)
    local = len(devices) // len({d.process_index for d in devices})
    heads = (plan.model["heads"], plan.model["kv_heads"])
    return next((t for t in (8, 4, 2) if local % t == 0 and all(h % t == 0 for h in heads)), 0)


def suggestions(config: Any, plan: Plan) -> list[dict[str, Any]]:
    """:func:`candidates` re-planned for the same target: each with its planned peak, whether
    it fits, and the overrides that make it (a candidate the config refuses is left out)."""
    from jaxrl_llm.config import ConfigError, apply_overrides

    out = []
    for what, overrides in candidates(config, plan):
        try:
            replanned = plan_run(apply_overrides(config, overrides), plan.target)
        except (PlanError, ConfigError) as e:
            out.append({"change": what, "overrides": overrides, "error": str(e)})
            continue
        out.append(
            {
                "change": what,
                "overrides": overrides,
                "peak": replanned.peak,
                "fits": replanned.fits,
                "margin_bytes": replanned.margin,
            }
        )
    return out


def format_suggestions(found: Sequence[Mapping[str, Any]]) -> str:
    """The suggestions as lines under the plan."""
    if not found:
        return (
            "\nno suggestion: FSDP over every device, remat, a bf16 reference, the smallest "
            "micro-batch and LoRA are already set; consider more devices or a smaller batch"
        )
    lines = ["", "suggestions (each re-planned for the same target):"]
    for s in found:
        if "error" in s:
            lines.append(f"  {s['change']}: not possible here ({s['error']})")
            continue
        verdict = "FITS" if s["fits"] else "does not fit"
        lines.append(
            f"  {s['change']}: peak {_mib(s['peak'])}, {verdict}  ({' '.join(s['overrides'])})"
        )
    return "\n".join(lines)


def plan_in_subprocess(
    config_path: str,
    overrides: Sequence[str],
    target: Target,
    *,
    suggest: bool = True,
    timeout: float | None = None,
    as_json: bool = True,
) -> dict[str, Any] | tuple[int, str]:
    """Runs the plan in a fresh Python with ``target.num_devices`` fake CPU devices (they must
    be requested before jax starts) and returns :meth:`Plan.to_dict` (``as_json=False``: its
    exit status and printed table).

    Raises:
      PlanError: the subprocess refused the input (its message) or failed.
    """
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "force_host_platform" not in f]
    flags.append(f"--xla_force_host_platform_device_count={target.num_devices}")
    env["XLA_FLAGS"] = " ".join(flags)
    env["JAX_PLATFORMS"] = "cpu"
    args = [sys.executable, "-m", "jaxrl_llm.train.plan", "--config", str(config_path)]
    args += ["--devices", str(target.num_devices)]
    if target.hbm_bytes is not None:
        args += ["--device-memory", str(target.hbm_bytes)]
    args += ["--json"] if as_json else []
    args += [] if suggest else ["--no-suggest"]
    args += ["--", *overrides]
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode not in (0, 1) or not out.stdout.strip():  # 1: planned, does not fit
        said = out.stderr.strip().splitlines()
        raise PlanError(said[-1].removeprefix("jaxrl-llm plan: ") if said else "plan failed")
    return json.loads(out.stdout) if as_json else (out.returncode, out.stdout)


def preflight(config: Any, *, log: Any = print) -> Plan:
    """``train.preflight``: plans ``config`` for this process's devices (the run's mesh over
    the first of them; shapes only, no weight read), logs the table and returns the plan.

    Devices that report no memory (CPU) give no verdict, and the run goes on.

    Raises:
      PlanError: the run's peak exceeds the devices' memory (the message gives the peak, the
        memory, the program and how to see re-planned suggestions), or its input is bad.
    """
    from jaxrl_llm.config import ConfigError, check_devices

    try:
        sizes = check_devices(config, jax.device_count(), process_count=jax.process_count())
    except (ConfigError, ValueError) as e:
        raise PlanError(str(e)) from None
    split = config.placement.mode == "split"  # carved from all the devices, as the run does
    plan = plan_run(config, local_target(None if split else math.prod(sizes.values())))
    log(format_plan(plan))
    if plan.fits is False:
        raise PlanError(
            f"train.preflight: the run does not fit its devices: peak {_mib(plan.peak)} per "
            f"device ({plan.peak_program}) of {_mib(plan.target.hbm_bytes)} "
            f"({plan.target.hbm_source}), {_mib(-plan.margin)} over; nothing was loaded. "
            "`jaxrl-llm plan --config ... --devices N --device-memory SIZE` re-plans suggested "
            "changes (FSDP, remat, micro-batches, LoRA"
            + (
                ", paged engines of several devices: rollout.tensor_parallel"
                if plan.rollout_engine == "paged" and plan.peak_program.endswith("rollout")
                else ""
            )
            + "); train.preflight=false skips this check"
        )
    return plan


# ---------------------------------------------------------------------------------------------
# Command line (also ``python -m jaxrl_llm.train.plan``, the subprocess of CPU estimates).


def add_arguments(parser: Any) -> None:
    """``plan``'s flags on an argparse parser."""
    parser.add_argument("--config", required=True, help="the run's config (file or shipped name)")
    parser.add_argument(
        "--topology",
        default=None,
        help=f"TPU slice ({', '.join(slice_names()[:6])}, ...) or libtpu's form, e.g. v5e:4x4; "
        f"or GPUs, MODEL-COUNT ({', '.join(GPUS)}; e.g. h200-8, h100-16), compiled by XLA:GPU",
    )
    parser.add_argument(
        "--devices", type=int, default=None, help="N GPUs (estimated on N CPU devices)"
    )
    parser.add_argument(
        "--device-memory", default=None, help="memory per GPU with --devices, e.g. 141GiB, 80GB"
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--no-suggest",
        dest="suggest",
        action="store_false",
        help="when the run does not fit, do not re-plan the suggested changes (each compiles)",
    )
    parser.add_argument("overrides", nargs="*", help="dotted.key=value config overrides")


def run_cli(args: Any) -> int:
    """``jaxrl-llm plan``: prints the plan; 0 when it fits (or no memory was given), 1 when it
    does not, 2 on bad input."""
    from jaxrl_llm.config import ConfigError, load_config
    from jaxrl_llm.models import ModelLoadError, UnsupportedModelError

    try:
        target = parse_target(args.topology, devices=args.devices, device_memory=args.device_memory)
        if target.platform == "gpu":
            skip_cuda_library_check()  # before anything starts JAX's backends
        config = load_config(args.config, args.overrides)
        if target.platform == "cpu" and jax.device_count("cpu") < target.num_devices:
            found = plan_in_subprocess(
                args.config, args.overrides, target, suggest=args.suggest, as_json=args.json
            )
            if not args.json:  # the subprocess printed the table
                code, text = found
                print(text, end="")
                return code
            result, text = found, None
        else:
            plan = plan_run(config, target)
            result, text = plan.to_dict(), format_plan(plan)
            if plan.fits is False and args.suggest:
                result["suggestions"] = suggestions(config, plan)
                text += format_suggestions(result["suggestions"])
    except (PlanError, ConfigError, ModelLoadError, UnsupportedModelError, FileNotFoundError) as e:
        print(f"jaxrl-llm plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else text)
    return 1 if result["fits"] is False else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m jaxrl_llm.train.plan`` (the same flags as ``jaxrl-llm plan``)."""
    import argparse

    parser = argparse.ArgumentParser(prog="jaxrl-llm plan", allow_abbrev=False)
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "CHIPS",
    "GPUS",
    "GPUS_PER_HOST",
    "AbstractRun",
    "Bytes",
    "Chip",
    "Gpu",
    "PagedRollout",
    "Plan",
    "PlanError",
    "Program",
    "RolloutSide",
    "Target",
    "abstract_run",
    "add_arguments",
    "candidates",
    "format_plan",
    "format_suggestions",
    "gpu_memory_fraction",
    "gpu_names",
    "kv_cache_bytes",
    "local_target",
    "lower_rollout",
    "lower_step",
    "model_config",
    "parse_bytes",
    "parse_target",
    "plan_in_subprocess",
    "plan_paged_rollout",
    "plan_run",
    "preflight",
    "quiet_cpu_platform",
    "rollout_copy",
    "rollout_engine",
    "run_cli",
    "skip_cuda_library_check",
    "slice_names",
    "suggestions",
    "target_devices",
    "tree_bytes",
]
