"""Split placement and the verified weight sync (jaxrl_llm.train.placement; issue 16).

Carving (2 rollout + 6 train of the suite's 8 fake CPU devices, and per process with fake
process counts), every config error, and :class:`RolloutWeights`: after a sync the rollout copy
equals the trainer's parameters bit for bit on the rollout devices only; a corrupted copy, a
skipped transfer, or a version that does not advance raise WeightSyncError; LoRA moves only
the adapters; the tokens sampled from the rollout copy equal those of the train parameters.
Two processes (2 CPU devices each, 1 rollout + 1 train per process) sync, verify and
generate the tokens of one process.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.config import ConfigError, check_devices
from jaxrl_llm.data import BatchIterator
from jaxrl_llm.models import sharding as shd
from jaxrl_llm.train import collect as C
from jaxrl_llm.train import placement as pl
from jaxrl_llm.train import setup as S
from tests.train import helpers as H

SPLIT = ("placement.mode=split", "mesh.data=-1", "rollout.prompts_per_step=6")


def _config(*overrides: str):
    return H.config("tiny.yaml", *SPLIT, *overrides)


@pytest.fixture(scope="module")
def split_setup():
    """tiny-random, split 2 + 6: the train mesh data=6 on devices 2..7, the rollout data=2."""
    return S.resolve(_config("data.eval_size=4"))


@pytest.fixture(scope="module")
def lora_setup():
    return S.resolve(_config("data.eval_size=4", "model.lora={rank: 4, alpha: 8}"))


def _ids(devices) -> list[int]:
    return sorted(d.id for d in devices)


def _host(tree):
    return jax.tree.map(np.asarray, tree)


def _assert_bitwise_equal(a, b):
    la, lb = jax.tree.leaves(_host(a)), jax.tree.leaves(_host(b))
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


# ---------------------------------------------------------------------------------------------
# Carving.


def test_carve_two_rollout_and_six_train_devices_of_eight():
    devices = jax.devices()
    rollout, train = pl.carve_devices(devices, 0.25, process_count=1)
    assert _ids(rollout) == [0, 1] and _ids(train) == [2, 3, 4, 5, 6, 7]
    assert [d.id for d in rollout + train] == [d.id for d in devices]  # order kept


@pytest.mark.parametrize(
    "processes, fraction, rollout_ids",
    [
        (2, 0.25, [0, 4]),
        (2, 0.5, [0, 1, 4, 5]),
        (4, 0.5, [0, 2, 4, 6]),
        (2, 0.75, [0, 1, 2, 4, 5, 6]),
    ],
)
def test_carve_takes_the_first_devices_of_every_process(processes, fraction, rollout_ids):
    rollout, train = pl.carve_devices(jax.devices(), fraction, process_count=processes)
    assert [d.id for d in rollout] == rollout_ids  # process order: both sides span every process
    assert [d.id for d in train] == [i for i in range(8) if i not in rollout_ids]


@pytest.mark.parametrize(
    "processes, fraction, message",
    [
        (1, 0.3, r"fraction = 0.3 of 8 devices per process is 2.4"),
        (8, 0.5, r"of 1 devices per process is 0.5"),
        (3, 0.5, r"cannot be split into 3 processes"),
        (1, 1.0, r"expected 0 < fraction < 1"),
        (4, 0.25, r"is 0.5: expected a whole number of rollout devices in \[1, 1\]"),
    ],
)
def test_carve_refuses_shares_that_are_not_whole(processes, fraction, message):
    with pytest.raises(ValueError, match=message):
        pl.carve_devices(jax.devices(), fraction, process_count=processes)


# ---------------------------------------------------------------------------------------------
# Config.


def test_colocated_is_the_default_and_needs_nothing():
    config = H.config("tiny.yaml")
    assert config.placement.mode == "colocated" and config.train.max_staleness == 0
    mesh, rules = S.make_mesh(config)
    placement = S.make_placement(config, mesh, rules)
    assert not placement.split and placement.rollout_mesh is mesh
    assert placement.train_devices == placement.rollout_devices == (jax.devices()[0],)


def test_split_meshes_from_the_config():
    config = _config("placement.rollout_mesh={preset: fsdp, data: 1, fsdp: -1}")
    assert check_devices(config, 8) == {"data": 6, "fsdp": 1, "tensor": 1}
    mesh, rules = S.make_mesh(config)
    placement = S.make_placement(config, mesh, rules)
    assert placement.split and _ids(mesh.devices.flat) == [2, 3, 4, 5, 6, 7]
    assert _ids(placement.rollout_mesh.devices.flat) == [0, 1]
    assert dict(placement.rollout_mesh.shape) == {"data": 1, "fsdp": 2, "tensor": 1}
    assert placement.rollout_rules == shd.FSDP_RULES


@pytest.mark.parametrize(
    "overrides, devices, processes, key, message",
    [
        (["placement.rollout_fraction=1.0"], 8, 1, "placement.rollout_fraction", r"> 0 and < 1"),
        (["placement.rollout_fraction=0"], 8, 1, "placement.rollout_fraction", r"> 0 and < 1"),
        ([], 1, 1, "placement.mode", r"on 1 devices: expected at least 2 devices per process"),
        ([], 2, 2, "placement.mode", r"1 devices of each of the 2 processes: expected at least 2"),
        (
            ["placement.rollout_fraction=0.3"],
            8,
            1,
            "placement.rollout_fraction",
            r"= 0.3: 2.4 of the 8 devices; expected a whole number of rollout devices in \[1, 7\]",
        ),
        (
            [],
            4,
            2,
            "placement.rollout_fraction",
            r"= 0.25: 0.5 of the 2 devices of each of the 2 processes",
        ),
        (
            ["mesh.data=4"],
            8,
            1,
            "mesh",
            r"mesh = \(data=4.*does not divide the 6 train devices \(of 8; 2 go to the rollout\)",
        ),
        (
            ["placement.rollout_mesh.data=4"],
            8,
            1,
            "placement.rollout_mesh",
            r"placement.rollout_mesh = \(data=4.*does not divide the 2 rollout devices \(of 8\)",
        ),
        (
            ["rollout.prompts_per_step=2"],
            8,
            1,
            "mesh",
            r"the batch of 4 .* data-parallel size 6 .* on 6 train devices",
        ),
    ],
)
def test_device_errors_name_the_key(overrides, devices, processes, key, message):
    with pytest.raises(ConfigError, match=message) as info:
        check_devices(_config(*overrides), devices, process_count=processes)
    assert info.value.key == key


@pytest.mark.parametrize(
    "overrides, name, key, message",
    [
        (
            ["placement.mode=split"],
            "algorithms/dpo.yaml",
            "placement.mode",
            r"dpo trains offline .* expected placement.mode = 'colocated'",
        ),
        (
            [*SPLIT, "placement.rollout_mesh.fsdp=2"],
            "tiny.yaml",
            "placement.rollout_mesh.preset",
            r"placement.rollout_mesh.preset = 'dp': expected 'fsdp' or 'fsdp_tp'",
        ),
        (
            [*SPLIT, "placement.rollout_mesh={data: -1, fsdp: -1}"],
            "tiny.yaml",
            "placement.rollout_mesh",
            r"at most one axis may be -1",
        ),
        (["placement.mode=apart"], "tiny.yaml", "placement.mode", r"'colocated', 'split'"),
        (["train.max_staleness=-1"], "tiny.yaml", "train.max_staleness", r">= 0|≥ 0"),
    ],
)
def test_config_errors_name_the_key(overrides, name, key, message):
    with pytest.raises(ConfigError, match=message) as info:
        H.config(name, *overrides)
    assert info.value.key == key


def test_a_train_mesh_on_rollout_devices_is_refused():
    config = _config()
    mesh = shd.make_mesh(data=2, devices=jax.devices()[:2])
    with pytest.raises(ConfigError, match=r"train mesh holds devices \[0, 1\].*rollout's"):
        S.make_placement(config, mesh, shd.DP_RULES)


# ---------------------------------------------------------------------------------------------
# The sync.


def test_setup_exposes_the_split_placement(split_setup):
    p = split_setup.placement
    assert p.split and _ids(p.rollout_devices) == [0, 1]
    assert _ids(split_setup.models.mesh.devices.flat) == _ids(p.train_devices) == list(range(2, 8))


def test_sync_copies_the_params_bit_for_bit_onto_the_rollout_devices(split_setup):
    models, params = split_setup.models, split_setup.state.params
    weights = pl.RolloutWeights.build(models, split_setup.placement)
    assert weights.version == pl.NO_VERSION and weights.params is None
    with pytest.raises(pl.WeightSyncError, match="no weights synced yet"):
        weights.sampling_policy()
    report = weights.sync(params, 0)
    leaves = jax.tree.leaves(params)
    assert report.version == weights.version == 0
    assert report.num_arrays == len(leaves) and report.bytes == sum(x.nbytes for x in leaves)
    assert report.seconds > 0
    _assert_bitwise_equal(weights.params, params)
    for x in jax.tree.leaves(weights.params):
        assert _ids(x.sharding.device_set) == [0, 1]  # the rollout's devices only
    with jax.set_mesh(models.mesh):  # also from inside the train mesh's context
        assert weights.sync(params, 3).version == 3  # versions may skip, never repeat
    graphdef, policy_params = weights.sampling_policy()
    assert graphdef is models.graphdef and policy_params is weights.params


@pytest.mark.parametrize("version", [3, 2])
def test_a_version_that_does_not_advance_is_an_error(split_setup, version):
    weights = pl.RolloutWeights.build(split_setup.models, split_setup.placement)
    weights.sync(split_setup.state.params, 3)
    with pytest.raises(pl.WeightSyncError, match=f"version {version}: expected a version above"):
        weights.sync(split_setup.state.params, version)
    with pytest.raises(TypeError, match="version must be an int"):
        weights.sync(split_setup.state.params, 4.0)
    assert weights.version == 3


def test_a_corrupted_copy_is_an_error_naming_the_array(split_setup, monkeypatch):
    models, params = split_setup.models, split_setup.state.params
    weights = pl.RolloutWeights.build(models, split_setup.placement)
    weights.sync(params, 0)
    kept = weights.params
    real = pl.transfer

    def flip_one_element(tree, shardings):
        out = real(tree, shardings)
        emb = out["model"]["embed_tokens"]["embedding"]
        out["model"]["embed_tokens"]["embedding"] = emb.at[3, 5].add(1e-3)  # stays on its mesh
        return out

    monkeypatch.setattr(pl, "transfer", flip_one_element)
    with pytest.raises(pl.WeightSyncError, match=r"1 of 11 arrays differ.*embed_tokens/embedding"):
        weights.sync(params, 1)
    assert weights.version == 0 and weights.params is kept  # the old copy stays


def test_a_skipped_transfer_is_an_error(split_setup, monkeypatch):
    weights = pl.RolloutWeights.build(split_setup.models, split_setup.placement)
    monkeypatch.setattr(pl, "transfer", lambda tree, shardings: tree)  # nothing moved
    with pytest.raises(pl.WeightSyncError, match=r"11 of 11 arrays are not copies on the rollout"):
        weights.sync(split_setup.state.params, 0)
    assert weights.version == pl.NO_VERSION and weights.params is None


def test_the_checksums_see_one_changed_element_anywhere():
    x = jnp.arange(24.0).reshape(4, 6)
    sharded = jax.device_put(
        x, shd.batch_sharding(shd.make_mesh(data=2, devices=jax.devices()[:2]))
    )
    assert pl.tree_checksums({"x": x}) == pl.tree_checksums({"x": sharded})  # any layout
    for i, j in [(0, 0), (3, 5), (2, 1)]:
        assert pl.tree_checksums({"x": x.at[i, j].add(1.0)}) != pl.tree_checksums({"x": x})


def test_an_fsdp_rollout_mesh_is_a_real_reshard(split_setup):
    models, params = split_setup.models, split_setup.state.params
    placement = pl.split_placement(
        jax.devices(),
        fraction=0.25,
        rollout_sizes={"data": 1, "fsdp": 2, "tensor": 1},
        rollout_rules=shd.FSDP_RULES,
    )
    weights = pl.RolloutWeights.split(models, placement, params)
    assert weights.shardings is not None  # from the shapes, before any sync
    weights.sync(params, 0)
    _assert_bitwise_equal(weights.params, params)
    emb = weights.params["model"]["embed_tokens"]["embedding"]  # [V, D], D over fsdp
    assert emb.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
    assert {s.data.shape for s in emb.addressable_shards} == {(emb.shape[0], emb.shape[1] // 2)}


def test_colocated_sync_copies_into_buffers_of_its_own(split_setup, monkeypatch):
    models = split_setup.models
    params = jax.tree.map(jnp.copy, split_setup.state.params)  # ours to donate
    expected = _host(params)
    weights = pl.RolloutWeights.colocated(models)
    assert weights.mesh is models.mesh
    report = weights.sync(params, 0)
    assert report.num_arrays == len(jax.tree.leaves(params))
    for a, b in zip(jax.tree.leaves(weights.params), jax.tree.leaves(params), strict=True):
        assert a.sharding == b.sharding
    # The update donates its input: the rollout's copy must survive its buffers' end.
    for x in jax.tree.leaves(params):
        x.delete()
    _assert_bitwise_equal(weights.params, expected)
    monkeypatch.setattr(pl, "_copy", lambda tree: tree)  # a "copy" that aliases
    fresh = jax.tree.map(jnp.copy, split_setup.state.params)
    with pytest.raises(pl.WeightSyncError, match=r"not copies on the rollout's devices"):
        weights.sync(fresh, 1)


def _batch(setup, n: int = 6):
    it = BatchIterator(setup.data.train, n, seed=0, shuffle=False, pad_multiple=8)
    return it.next_batch()


def test_the_rollout_copy_samples_the_tokens_of_the_train_params(split_setup):
    s = split_setup
    weights = pl.RolloutWeights.build(s.models, s.placement)
    weights.sync(s.state.params, 0)
    batch = _batch(s)
    # The static engine: one program over the whole batch on either mesh, so the draws are
    # bit-equal. The paged engine's data-parallel shards (6 vs 2 devices) run other batch
    # shapes, whose float rounding can flip a sampled token.
    static = dataclasses.replace(s.sampler, engine="static")
    for sampler in (static, static.greedy()):
        args = (sampler, batch.prompt_ids_bt, batch.prompt_mask_bt, jax.random.key(7))
        train_side = C.sample_completions(s.models, s.state.params, *args)  # 6 train devices
        rollout_side = C.sample_completions(
            s.models, None, *args, policy=weights.sampling_policy()
        )  # 2 rollout devices
        np.testing.assert_array_equal(rollout_side.tokens, train_side.tokens)
        np.testing.assert_array_equal(rollout_side.mask, train_side.mask)
        np.testing.assert_allclose(rollout_side.logprobs, train_side.logprobs, atol=1e-5)
    # collect(policy=...) gives the groups of collect() itself (host arrays as always).
    it = lambda: BatchIterator(s.data.train, 6, seed=0, shuffle=False, pad_multiple=8)
    key = jax.random.key(3)
    ref, _ = C.collect(s, s.state.params, it(), key)
    got, metrics = C.collect(s, s.state.params, it(), key, policy=weights.sampling_policy())
    assert isinstance(got.tokens_bgt, np.ndarray)
    np.testing.assert_array_equal(got.tokens_bgt, ref.tokens_bgt)
    np.testing.assert_array_equal(got.reward_bg, ref.reward_bg)
    assert metrics["perf/generated_tokens"] > 0


def test_remax_samples_its_greedy_baseline_from_the_rollout_copy_too(split_setup, monkeypatch):
    s = dataclasses.replace(split_setup, recipe=H.recipe("remax"))
    weights = pl.RolloutWeights.build(s.models, s.placement)
    weights.sync(s.state.params, 0)
    policy = weights.sampling_policy()
    seen, real = [], C.sample_completions

    def spy(*args, policy=None, **kwargs):
        seen.append(policy)
        return real(*args, policy=policy, **kwargs)

    monkeypatch.setattr(C, "sample_completions", spy)
    it = BatchIterator(s.data.train, 6, seed=0, shuffle=False, pad_multiple=8)
    groups, _ = C.collect(s, s.state.params, it, jax.random.key(0), policy=policy)
    assert len(seen) == 2 and all(p is policy for p in seen)  # the G samples and the greedy one
    assert groups.baseline_b is not None and groups.baseline_b.shape == (6,)


def test_lora_moves_only_the_adapters(lora_setup):
    s = lora_setup
    models, adapters = s.models, s.state.params
    assert models.frozen is not None
    weights = pl.RolloutWeights.build(models, s.placement, adapters)
    frozen_leaves = jax.tree.leaves(models.frozen)
    base = weights.frozen_report  # the base moved once, at construction, verified
    assert base.num_arrays == len(frozen_leaves)
    assert base.bytes == sum(x.nbytes for x in frozen_leaves)
    _assert_bitwise_equal(weights.frozen, models.frozen)
    assert all(_ids(x.sharding.device_set) == [0, 1] for x in jax.tree.leaves(weights.frozen))
    frozen_copy = weights.frozen
    for version in (0, 1):
        report = weights.sync(adapters, version)
        leaves = jax.tree.leaves(adapters)
        assert report.num_arrays == len(leaves) == 14  # A and B of 7 projections (stacked)
        assert report.bytes == sum(x.nbytes for x in leaves) < base.bytes / 10
    assert weights.frozen is frozen_copy  # not moved again
    _assert_bitwise_equal(weights.params, adapters)
    graphdef, full = weights.sampling_policy()
    ref_graphdef, ref_full = models.sampling_policy(adapters)
    assert graphdef is ref_graphdef
    _assert_bitwise_equal(full, ref_full)
    assert all(_ids(x.sharding.device_set) == [0, 1] for x in jax.tree.leaves(full))
    batch = _batch(s)
    args = (s.sampler, batch.prompt_ids_bt, batch.prompt_mask_bt, jax.random.key(5))
    train_side = C.sample_completions(models, adapters, *args)
    rollout_side = C.sample_completions(models, None, *args, policy=(graphdef, full))
    np.testing.assert_array_equal(rollout_side.tokens, train_side.tokens)


def test_lora_merged_sampling_merges_on_the_rollout_mesh(lora_setup):
    s = lora_setup
    models = dataclasses.replace(s.models, merge_for_sampling=True)
    # B = 0 at init would make the merge a no-op: give the adapters a value.
    adapters = jax.tree.map(lambda x: x + 0.01, s.state.params)
    weights = pl.RolloutWeights.build(models, s.placement, adapters)
    weights.sync(adapters, 0)
    graphdef, merged = weights.sampling_policy()
    assert graphdef is models.ref_graphdef
    assert weights.sampling_policy()[1] is merged  # merged once per version
    _, expected = models.sampling_policy(adapters)
    la, lb = jax.tree.leaves(_host(merged)), jax.tree.leaves(_host(expected))
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
    assert all(_ids(x.sharding.device_set) == [0, 1] for x in jax.tree.leaves(merged))
    weights.sync(adapters, 1)
    assert weights.sampling_policy()[1] is not merged


# ---------------------------------------------------------------------------------------------
# Two processes: 2 CPU devices each, 1 rollout + 1 train per process.

REPO = Path(__file__).resolve().parents[2]
MP_OVERRIDES = [
    "placement.mode=split",
    "placement.rollout_fraction=0.5",
    "mesh.data=-1",
    "rollout.prompts_per_step=2",
    "data.eval_size=4",
]

CHILD = """\
import sys
import numpy as np

from jaxrl_llm import distributed as dist

port, pid, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
overrides = sys.argv[4:]
dist.initialize(f"127.0.0.1:{port}", 2, pid)
from tests.train.multiprocess_cli import refuse_process_allgather

refuse_process_allgather()  # what jaxrl_llm must not use (see that module)

import jax

from jaxrl_llm.config import load_config
from jaxrl_llm.data import BatchIterator
from jaxrl_llm.train import collect as C
from jaxrl_llm.train import placement as pl
from jaxrl_llm.train import setup as S

s = S.resolve(load_config("configs/tiny.yaml", overrides))
p = s.placement
print("train", [d.id for d in p.train_devices], "rollout", [d.id for d in p.rollout_devices])
weights = pl.RolloutWeights.build(s.models, p)
report = weights.sync(s.state.params, 0)
print(f"sync {report.num_arrays} arrays {report.bytes} bytes {report.seconds:.3f} s")
local = [x for x in jax.tree.leaves(weights.params)]
assert all({d.process_index for d in x.sharding.device_set} == {0, 1} for x in local)
assert all(set(x.sharding.device_set) <= set(p.rollout_devices) for x in local)
real = pl.transfer
pl.transfer = lambda tree, sh: jax.tree.map(lambda x: x.at[(0,) * x.ndim].add(1), real(tree, sh))
try:
    weights.sync(s.state.params, 1)
    print("corruption NOT caught")
except pl.WeightSyncError as e:
    print("corruption caught:", str(e)[:80])
pl.transfer = real
report = weights.sync(s.state.params, 2)
print(f"sync again {report.seconds:.3f} s")
# Reshards between other layouts of the two meshes (staged on the train mesh when needed).
from jax.sharding import NamedSharding, PartitionSpec as P
x = np.arange(48, dtype=np.float32).reshape(4, 12)
for src, dst in ((P("data"), P()), (P(), P("data")), (P("data"), P(None, "data"))):
    a = jax.make_array_from_callback(x.shape, NamedSharding(s.models.mesh, src), lambda i: x[i])
    target = {"a": NamedSharding(p.rollout_mesh, dst)}
    pl.verify_copy({"a": a}, pl.transfer({"a": a}, target), target, what=f"{src} -> {dst}")
print("reshards ok")
tokens = {}
for name, key in (("sampled", 7), ("greedy", 8)):
    it = BatchIterator(s.data.train, 2, seed=0, shuffle=False, pad_multiple=8)
    sampler = s.sampler if name == "sampled" else s.sampler.greedy()
    setup = S.dataclasses.replace(s, sampler=sampler)
    policy = weights.sampling_policy()
    groups, _ = C.collect(setup, s.state.params, it, jax.random.key(key), policy=policy)
    tokens[name] = groups.tokens_bgt
if pid == 0:
    np.savez(out, **tokens)
print("done", flush=True)
"""


@pytest.mark.slow
def test_two_processes_sync_verify_and_sample_the_tokens_of_one(tmp_path):
    # Two devices each, with the suite's XLA flags (it had XLA's defaults: slower compiles).
    from tests.train.test_multiprocess import _child_env, _free_port, _tail

    port, children = _free_port(), []
    logs = [tmp_path / f"process{i}.log" for i in range(2)]
    out = tmp_path / "tokens.npz"
    t0 = time.monotonic()
    try:
        for i, log in enumerate(logs):
            cmd = [sys.executable, "-c", CHILD, str(port), str(i), str(out), *MP_OVERRIDES]
            with log.open("w") as f:
                children.append(
                    subprocess.Popen(
                        cmd, cwd=REPO, env=_child_env(2), stdout=f, stderr=subprocess.STDOUT
                    )
                )
        # One process meanwhile: colocated on one device, the same prompts and keys.
        s = S.resolve(H.config("tiny.yaml", "rollout.prompts_per_step=2", "data.eval_size=4"))
        ref = {}
        for name, key in (("sampled", 7), ("greedy", 8)):
            it = BatchIterator(s.data.train, 2, seed=0, shuffle=False, pad_multiple=8)
            sampler = s.sampler if name == "sampled" else s.sampler.greedy()
            groups, _ = C.collect(
                dataclasses.replace(s, sampler=sampler), s.state.params, it, jax.random.key(key)
            )
            ref[name] = groups.tokens_bgt
        for i, child in enumerate(children):
            left = max(1.0, 240 - (time.monotonic() - t0))
            try:
                code = child.wait(timeout=left)
            except subprocess.TimeoutExpired:
                pytest.fail(f"process {i} still running after 240 s:\n{_tail(logs[i])}")
            assert code == 0, f"process {i} exited with {code}:\n{_tail(logs[i])}"
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait(timeout=30)
    for log in logs:
        text = _tail(log)
        # Global device ids: process 0 has 0, 1; process 1 has 2048, 2049 (CPU).
        assert "train [1, 2049] rollout [0, 2048]" in text, text
        assert "sync 11 arrays" in text and "corruption caught: weight sync to version 1" in text
        assert "reshards ok" in text
        assert text.rstrip().endswith("done"), text
    got = np.load(out)
    for name in ("sampled", "greedy"):
        np.testing.assert_array_equal(got[name], ref[name], err_msg=name)
