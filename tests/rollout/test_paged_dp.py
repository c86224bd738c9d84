"""Data-parallel paged engines (rollout/paged_dp.py) on the 8 fake CPU devices: one engine per
data shard gives the one-device engine's tokens (greedy and sampled with the same key) and
log-probs, with ragged prompts, per-sample budgets and uneven shards; every shard's pool gets
its pages back; a second call compiles nothing; two processes (slow) give one process's rows, with
the paged engine and with the static one."""

import dataclasses
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm import rollout
from jaxrl_llm.models import sharding
from jaxrl_llm.rollout import paged, paged_dp
from tests.rollout.test_generate import prompts
from tests.rollout.test_paged import BUDGETS, LENGTHS, SMALL, CompileCounter, G, T, assert_same

# B = 5 prompts (one of 23 tokens: a chunked prefill), so no mesh below divides the batch:
# data=8 runs 5 engines of one prompt (3 shards idle), data=2 runs 3 + 2, data·fsdp=4 2+1+1+1.
MESHES = {
    "data8": dict(data=8),
    "data2_tensor4": dict(data=2, tensor=4),
    "fsdp2_tensor2_data2": dict(data=2, fsdp=2, tensor=2),
}
KW = dict(max_new_tokens=T, num_samples=G, max_new_tokens_bg=BUDGETS, engine="paged")


@pytest.fixture(scope="module")
def model(tiny_pair):
    return tiny_pair("llama3")[1]


@pytest.fixture(scope="module")
def one_device(model):
    """The one-device engine's greedy and sampled outputs (the references)."""
    ids, mask = prompts(seed=8, lengths=LENGTHS)
    greedy = rollout.generate(
        model, ids, mask, rng=jax.random.key(0), temperature=0.0, paged_options=SMALL, **KW
    )
    sampled = rollout.generate(
        model, ids, mask, rng=jax.random.key(5), temperature=1.0, paged_options=SMALL, **KW
    )
    return ids, mask, greedy, sampled


def on_mesh(model, sizes):
    graphdef, state = nnx.split(model)
    mesh = sharding.make_mesh(**sizes)
    params = jax.device_put(nnx.to_pure_dict(state), sharding.param_shardings(state, mesh))
    return mesh, (graphdef, params)


@pytest.mark.parametrize(
    "name",
    [
        "data2_tensor4",
        # 5 and 4 engines, each compiling its own programs (one compile per device set): ~15 s
        # each on 2 loaded cores.
        pytest.param("data8", marks=pytest.mark.slow),
        pytest.param("fsdp2_tensor2_data2", marks=pytest.mark.slow),
    ],
)
def test_data_parallel_engines_give_the_one_device_tokens(model, one_device, name):
    ids, mask, greedy, sampled = one_device
    assert len(jax.devices()) == 8
    mesh, sharded = on_mesh(model, MESHES[name])
    d = sharding.data_parallel_size(mesh)
    out = rollout.generate(
        sharded, ids, mask, rng=jax.random.key(0), temperature=0.0, paged_options=SMALL, **KW
    )
    assert_same(greedy, out)
    out, stats = rollout.generate(
        sharded,
        ids,
        mask,
        rng=jax.random.key(5),
        temperature=1.0,
        paged_options=SMALL,
        return_stats=True,
        **KW,
    )
    assert_same(sampled, out)
    assert (np.asarray(out.mask).sum(-1) <= BUDGETS).all()
    # One engine per data shard that got prompts (contiguous, the first B mod D one more).
    assert isinstance(stats, paged_dp.DataParallelStats) and len(stats.shards) == d
    rows = paged_dp.split_rows(len(LENGTHS), d)
    ran = [s for s in stats.shards if s is not None]
    assert [s is not None for s in stats.shards] == [r.stop > r.start for r in rows]
    assert len(ran) == min(len(LENGTHS), d)
    assert all(s.pages_in_use_at_end == 0 and s.peak_pages > 0 for s in ran)
    assert stats.pages_in_use_at_end == 0
    assert stats.peak_pages == sum(s.peak_pages for s in ran)
    assert stats.peak_kv_bytes == sum(s.peak_kv_bytes for s in ran)
    assert stats.decode_dispatches == sum(s.decode_dispatches for s in ran)
    # Other prompts of the same lengths and another key: every engine reuses its programs.
    ids2, mask2 = prompts(seed=9, lengths=LENGTHS)
    with CompileCounter() as compiles:
        again = rollout.generate(
            sharded, ids2, mask2, rng=jax.random.key(6), temperature=1.0, paged_options=SMALL, **KW
        )
        jax.block_until_ready(again)
    assert compiles.count == 0
    assert not np.array_equal(np.asarray(again.tokens), np.asarray(out.tokens))


def test_work_stealing_moves_prompts_that_wait_and_keeps_the_tokens(model):
    """Two engines of one prompt at a time (num_slots = G); the first share is 4 prompts of
    47 decode steps each, the second 4 of one step. Split, engine 0 decodes 188 steps while
    engine 1 idles after 4; with work stealing engine 1 takes engine 0's last waiting prompts
    (the call's critical path in decode steps, what an accelerator's time follows, at most
    3/4 of the split's: one long prompt moved). The tokens are the split run's."""
    _, sharded = on_mesh(model, dict(data=2, devices=jax.devices()[:2]))
    ids, mask = prompts(seed=3, lengths=(5, 7, 6, 8, 5, 6, 7, 9))
    budgets = np.repeat(np.array([48] * 4 + [2] * 4, np.int32)[:, None], 2, axis=1)
    kw = dict(
        rng=jax.random.key(1), temperature=1.0, max_new_tokens=48, num_samples=2,
        max_new_tokens_bg=budgets, stop_token_ids=(), engine="paged", return_stats=True,
    )  # fmt: skip
    base = paged.PagedOptions(page_size=4, num_slots=2, steps_per_dispatch=4, prefill_chunk=16)
    split, split_stats = rollout.generate(
        sharded, ids, mask, paged_options=dataclasses.replace(base, work_stealing=False), **kw
    )
    assert [s.decode_steps for s in split_stats.shards] == [4 * 47, 4 * 1]
    assert split_stats.prompts_stolen == 0
    out, stats = rollout.generate(sharded, ids, mask, paged_options=base, **kw)
    assert_same(split, out)
    assert stats.prompts_stolen >= 1 and stats.shards[1].prompts_stolen == stats.prompts_stolen
    assert max(s.decode_steps for s in stats.shards) <= 3 * 47
    assert sum(s.decode_steps for s in stats.shards) == 4 * 47 + 4
    assert all(s.pages_in_use_at_end == 0 for s in stats.shards)


def test_split_rows_rule():
    assert paged_dp.split_rows(5, 2) == [slice(0, 3), slice(3, 5)]
    assert paged_dp.split_rows(5, 4) == [slice(0, 2), slice(2, 3), slice(3, 4), slice(4, 5)]
    assert [r.stop - r.start for r in paged_dp.split_rows(3, 8)] == [1, 1, 1, 0, 0, 0, 0, 0]
    assert paged_dp.split_rows(8, 4) == [slice(2 * i, 2 * i + 2) for i in range(4)]


@pytest.mark.parametrize("stealing", [False, True])
def test_each_engine_gets_its_rows_global_ids_own_defaults_and_devices(
    model, monkeypatch, stealing
):
    """What ``paged.run`` is called with per shard (a stand-in records it: nothing compiles).
    Without work stealing each engine gets its rows; with it, every row and a queue holding
    its rows (the stand-in runs its own queue only, as an engine that has room for all)."""
    calls = []

    def fake_run(graphdef, mesh, params, prompts_, budgets_bg, *, rng, options, queue, **kw):
        leaf = jax.tree.leaves(params)[0]
        ran = list(range(len(prompts_)))
        if queue is not None:
            with queue.lock:
                ran = [queue.popleft() for _ in range(len(queue))]
            queue.done(ran)
        calls.append(
            dict(
                mesh=mesh,
                seen=len(prompts_),
                names=[int(prompts_[b][0]) for b in ran],
                budgets=budgets_bg[ran],
                ids=kw["seq_ids_bg"][ran],
                options=options,
                devices=(rng.sharding.device_set, leaf.sharding.device_set),
            )
        )
        g = budgets_bg.shape[1]
        name_b = np.asarray([int(prompts_[b][0]) for b in ran], np.int32)
        out = np.broadcast_to(name_b[:, None, None], (len(ran), g, kw["max_new_tokens"]))
        arrays = (out, out > 0, out.astype(np.float32), np.zeros((len(ran), g), bool))
        return arrays, paged.PagedStats(len(ran), 8, 1, 1, 0)

    monkeypatch.setattr(paged, "run", fake_run)
    ids, mask = prompts(seed=0, lengths=LENGTHS)
    for b in range(len(LENGTHS)):  # each prompt's first token names it
        ids[b, np.argmax(mask[b])] = 10 + b
    mesh, sharded = on_mesh(model, dict(data=2, tensor=2, devices=jax.devices()[:4]))
    options = paged.PagedOptions(work_stealing=stealing)
    out, stats = rollout.generate(
        sharded, ids, mask, rng=jax.random.key(0), return_stats=True, paged_options=options, **KW
    )
    by_shard = sorted(calls, key=lambda c: c["names"][0])
    assert [c["names"] for c in by_shard] == [[10, 11, 12], [13, 14]]
    assert [c["seen"] for c in by_shard] == ([5, 5] if stealing else [3, 2])
    np.testing.assert_array_equal(by_shard[1]["ids"], [[6, 7], [8, 9]])  # global b·G + g
    np.testing.assert_array_equal(by_shard[1]["budgets"], BUDGETS[3:])
    # Default sizes per engine: 6 and 4 sequences -> 8 and 4 slots.
    assert [c["options"].num_slots for c in by_shard] == [8, 4]
    for c, sub in zip(by_shard, paged_dp.data_shard_meshes(mesh), strict=True):
        assert c["mesh"] == sub
        assert c["devices"] == (set(sub.devices.flat),) * 2  # the key and weights on the shard
    # The outputs in prompt order; the stats summed.
    np.testing.assert_array_equal(np.asarray(out.tokens)[:, 0, 0], np.arange(10, 15))
    assert stats.peak_pages == 5 and stats.page_bytes == 8 and stats.decode_dispatches == 2


def test_engines_get_per_layer_slices_and_never_the_stacked_weights(model, monkeypatch):
    """generate slices (and casts) the stacked layers once, each slice keeping its leaf's FSDP
    sharding less the layer axis (nothing gathered yet), and each data shard's engine gets
    those slices and the other weights, gathered onto its devices, but no stacked layer: one
    copy of the weights per device while it runs, where a gathered stacked copy and its
    slices made two (docs/plan.md, the capacity rows)."""
    _, (graphdef, params) = on_mesh(model, dict(fsdp=4, devices=jax.devices()[:4]))
    stacked = params["model"]["layers"]
    ep = paged.engine_params(params, jnp.bfloat16)
    assert isinstance(ep, paged.EngineParams) and "layers" not in ep.rest["model"]
    assert len(ep.layers) == model.config.num_layers
    for x, one in zip(jax.tree.leaves(stacked), jax.tree.leaves(ep.layers[1]), strict=True):
        assert one.shape == x.shape[1:] and one.dtype == jnp.bfloat16
        assert one.sharding.spec == jax.sharding.PartitionSpec(*x.sharding.spec[1:])
    np.testing.assert_array_equal(
        np.asarray(ep.layers[1]["mlp"]["down_proj"]["kernel"]),
        np.asarray(stacked["mlp"]["down_proj"]["kernel"][1].astype(jnp.bfloat16)),
    )
    seen = []

    def fake_run(graphdef, mesh, params, prompts_, budgets_bg, *, rng, options, **kw):
        seen.append(params)
        n, g = budgets_bg.shape
        out = np.zeros((n, g, kw["max_new_tokens"]), np.int32)
        arrays = (out, out > 0, out.astype(np.float32), np.zeros((n, g), bool))
        return arrays, paged.PagedStats(n, 8, 1, 1, 0)

    monkeypatch.setattr(paged, "run", fake_run)
    ids, mask = prompts(seed=0, lengths=LENGTHS)
    split = paged.PagedOptions(work_stealing=False)  # each stand-in runs its rows
    rollout.generate(
        (graphdef, params), ids, mask, rng=jax.random.key(0), paged_options=split, **KW
    )
    assert len(seen) == 4
    for got in seen:
        assert isinstance(got, paged.EngineParams) and "layers" not in got.rest["model"]
        leaves = jax.tree.leaves(got.layers)
        (devices,) = {frozenset(x.sharding.device_set) for x in leaves}
        assert len(devices) == 1  # gathered onto the engine's one device
        assert all(
            x.ndim == y.ndim - 1
            for x, y in zip(jax.tree.leaves(got.layers[0]), jax.tree.leaves(stacked), strict=True)
        )


def test_sub_meshes_keep_the_tensor_axis_and_drop_the_batch_axes(model):
    mesh, (_, params) = on_mesh(model, dict(data=2, fsdp=2, tensor=2))
    subs = paged_dp.data_shard_meshes(mesh)
    grid = mesh.devices  # [data, fsdp, tensor]
    assert [list(s.devices.flat) for s in subs] == [
        list(grid[i, j]) for i in (0, 1) for j in (0, 1)
    ]
    assert all(dict(s.shape) == {"data": 1, "fsdp": 1, "tensor": 2} for s in subs)
    local = paged_dp.shard_params(params, mesh, subs)
    q = params["model"]["layers"]["self_attn"]["q_proj"]["kernel"]
    assert "fsdp" in str(q.sharding.spec) and "tensor" in str(q.sharding.spec)
    for sub, p in zip(subs, local, strict=True):
        x = p["model"]["layers"]["self_attn"]["q_proj"]["kernel"]
        assert x.sharding.mesh == sub and x.sharding.device_set == set(sub.devices.flat)
        assert "fsdp" not in str(x.sharding.spec) and "tensor" in str(x.sharding.spec)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(q))
    # Replicated over the batch axes (dp): each shard's arrays are the original buffers.
    mesh, (_, params) = on_mesh(model, dict(data=8))
    subs = paged_dp.data_shard_meshes(mesh)
    q = params["model"]["layers"]["self_attn"]["q_proj"]["kernel"]
    x = paged_dp.shard_params(params, mesh, subs[3:4])[0]["model"]["layers"]["self_attn"]["q_proj"]
    (piece,) = x["kernel"].addressable_shards
    original = {s.device: s.data.unsafe_buffer_pointer() for s in q.addressable_shards}
    assert piece.data.unsafe_buffer_pointer() == original[piece.device]


@pytest.mark.parametrize("stealing", [False, True])
def test_a_shards_error_names_the_shard(model, stealing):
    """Without stealing a shard numbers the prompts of its share (the note says how); with it,
    every engine checks every prompt of the call, numbered as the call's."""
    _, sharded = on_mesh(model, dict(data=2, devices=jax.devices()[:2]))
    ids, mask = prompts(seed=0, lengths=(4, 4, 9))  # shards [0, 1] and [2]
    # 3 pages: too few for 9 + 8 tokens
    options = paged.PagedOptions(page_size=4, num_pages=4, work_stealing=stealing)
    number = 2 if stealing else 0
    with pytest.raises(ValueError, match=rf"prompt {number} \(9 tokens.*raise num_pages") as e:
        rollout.generate(
            sharded, ids, mask, rng=jax.random.key(0), max_new_tokens=8, engine="paged",
            paged_options=options,
        )  # fmt: skip
    where = "numbered as the call's" if stealing else "data shard 1 of 2"
    assert any(where in n and "data shard" in n for n in e.value.__notes__)
    if not stealing:
        assert any("prompt 2 + i" in n for n in e.value.__notes__)


# ---------------------------------------------------------------------------------------------
# Two processes (jax.distributed on CPU, gloo), two devices each: each process passes its own
# rows of the global batch (3 and 2: uneven) and gets the one-device engine's tokens for them.

CHILD = """\
import dataclasses
import sys

from jaxrl_llm import distributed as dist

port, pid, model_dir, batch, out = sys.argv[1], int(sys.argv[2]), *sys.argv[3:]
dist.initialize(f"127.0.0.1:{port}", 2, pid)
from tests.train.multiprocess_cli import refuse_process_allgather

refuse_process_allgather()  # what jaxrl_llm must not use (see that module)

import jax
import numpy as np

from jaxrl_llm import models, rollout
from jaxrl_llm.models import sharding
from jaxrl_llm.rollout import paged

assert jax.process_count() == 2 and len(jax.local_devices()) == 2
data = np.load(batch)
rows = slice(0, 3) if pid == 0 else slice(3, None)
options = paged.PagedOptions(page_size=4, num_slots=4, steps_per_dispatch=4, prefill_chunk=16)
results = {}
# data2_tensor2: a shard per process, tensor-parallel on its two devices; fsdp4: two one-device
# shards per process (two threads), the weights' embed axis split across the processes;
# fsdp4_tp2: the same mesh regrouped into one two-device engine per process
# (tensor_parallel=2: the weights moved from FSDP across processes to heads within each).
layouts = (
    ("data2_tensor2", dict(data=2, tensor=2), 0),
    ("fsdp4", dict(fsdp=4), 0),
    ("fsdp4_tp2", dict(fsdp=4), 2),
)
for name, sizes, tp in layouts:
    mesh = sharding.make_mesh(**sizes)
    model = models.from_pretrained(model_dir, mesh=mesh)
    for mode, temperature, key in (("greedy", 0.0, 0), ("sampled", 1.0, 5)):
        out_, stats = rollout.generate(
            model, data["ids"][rows], data["mask"][rows], rng=jax.random.key(key),
            temperature=temperature, max_new_tokens=int(data["T"]), num_samples=int(data["G"]),
            max_new_tokens_bg=data["budgets"][rows], engine="paged",
            paged_options=dataclasses.replace(options, tensor_parallel=tp), return_stats=True,
        )
        for field in ("tokens", "mask", "logprobs", "truncated"):
            results[f"{name}/{mode}/{field}"] = np.asarray(getattr(out_, field))
        results[f"{name}/{mode}/engines"] = sum(s is not None for s in stats.shards)
        results[f"{name}/{mode}/pages_at_end"] = stats.pages_in_use_at_end
# The static engine across the processes (its weights from paged.engine_params on the global
# mesh): B / processes rows each, here the first 4 prompts.
model = models.from_pretrained(model_dir, mesh=sharding.make_mesh(data=2, tensor=2))
half = slice(0, 2) if pid == 0 else slice(2, 4)
for mode, temperature, key in (("greedy", 0.0, 0), ("sampled", 1.0, 5)):
    out_ = rollout.generate(
        model, data["ids"][half], data["mask"][half], rng=jax.random.key(key),
        temperature=temperature, max_new_tokens=int(data["T"]), num_samples=int(data["G"]),
        engine="static",
    )
    for field in ("tokens", "mask", "logprobs", "truncated"):
        results[f"static/{mode}/{field}"] = np.asarray(getattr(out_, field))
# Work stealing across the processes: one engine per process, one prompt at a time (2 slots,
# G = 2); process 0's 4 prompts decode 47 steps each, process 1's one step each.
small = paged.PagedOptions(page_size=4, num_slots=2, steps_per_dispatch=4, prefill_chunk=16)
half = slice(0, 4) if pid == 0 else slice(4, 8)
for mode, stealing in (("split", False), ("stealing", True)):
    out_, stats = rollout.generate(
        model, data["steal_ids"][half], data["steal_mask"][half], rng=jax.random.key(1),
        temperature=1.0, max_new_tokens=48, num_samples=2, stop_token_ids=(),
        max_new_tokens_bg=data["steal_budgets"][half], engine="paged", return_stats=True,
        paged_options=dataclasses.replace(small, work_stealing=stealing),
    )
    for field in ("tokens", "mask", "logprobs", "truncated"):
        results[f"lending/{mode}/{field}"] = np.asarray(getattr(out_, field))
    results[f"lending/{mode}/stolen"] = stats.prompts_stolen
    results[f"lending/{mode}/decode_steps"] = stats.decode_steps
    results[f"lending/{mode}/pages_at_end"] = stats.pages_in_use_at_end
try:  # each process its own key: both see the mismatch in the same gather, neither hangs
    rollout.generate(model, data["ids"][rows], data["mask"][rows], rng=jax.random.key(pid),
                     max_new_tokens=2, engine="paged")
except ValueError as e:
    results["different_keys"] = str(e)
d = jax.devices()  # process 0's two devices, then process 1's
mesh = sharding.make_mesh(data=2, tensor=2, devices=[d[0], d[2], d[1], d[3]])
model = models.from_pretrained(model_dir, mesh=mesh)
try:
    rollout.generate(model, data["ids"][rows], data["mask"][rows], rng=jax.random.key(0),
                     max_new_tokens=2, engine="paged")
except ValueError as e:
    results["refused"] = str(e)
np.savez(out, **results)
print("done", flush=True)
"""


def _child_env() -> dict[str, str]:
    from tests.train import test_multiprocess as MP

    env = MP._child_env()
    flags = [f for f in env["XLA_FLAGS"].split() if "force_host_platform" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, "--xla_force_host_platform_device_count=2"])
    return env


def run_two_processes(child: str, args: list[str], tmp_path, what: str, limit: int) -> list[dict]:
    """Runs ``python -c child PORT PID *args OUT`` as two processes of two CPU devices each and
    returns each one's ``np.savez`` at ``OUT`` (process order)."""
    from tests.train import test_multiprocess as MP

    port, children = MP._free_port(), []
    logs = [tmp_path / f"process{i}.log" for i in range(2)]
    outs = [tmp_path / f"out{i}.npz" for i in range(2)]
    t0 = time.monotonic()
    try:
        for i in range(2):
            cmd = [sys.executable, "-c", child, str(port), str(i), *args, str(outs[i])]
            with logs[i].open("w") as log:
                children.append(
                    subprocess.Popen(
                        cmd, cwd=MP.REPO, env=_child_env(), stdout=log, stderr=subprocess.STDOUT
                    )
                )
        MP._wait(children, logs, t0, what, limit=limit)
    finally:
        for child_process in children:
            if child_process.poll() is None:
                child_process.kill()
                child_process.wait(timeout=30)
    return [dict(np.load(o)) for o in outs]


@pytest.mark.slow
def test_two_processes_get_the_one_device_tokens_of_their_rows(
    tiny_pair, model, one_device, tmp_path
):
    """Each process passes its rows and gets the one-device tokens for them: the paged engine
    on three layouts (uneven rows), and the static engine (its multi-process program, even
    rows). Work stealing across the processes moves prompts that wait for room from the busy
    process to the idle one and keeps the tokens."""
    hf, _ = tiny_pair("llama3")
    ids, mask, greedy, sampled = one_device
    hf.save_pretrained(tmp_path / "model")
    steal_ids, steal_mask = prompts(seed=3, lengths=(5, 7, 6, 8, 5, 6, 7, 9))
    steal_budgets = np.repeat(np.array([48] * 4 + [2] * 4, np.int32)[:, None], 2, axis=1)
    np.savez(
        tmp_path / "batch.npz", ids=ids, mask=mask, budgets=BUDGETS, T=T, G=G,
        steal_ids=steal_ids, steal_mask=steal_mask, steal_budgets=steal_budgets,
    )  # fmt: skip
    args = [str(tmp_path / "model"), str(tmp_path / "batch.npz")]
    got = run_two_processes(CHILD, args, tmp_path, "paged data-parallel", limit=240)
    for name in ("data2_tensor2", "fsdp4", "fsdp4_tp2"):
        for mode, ref in (("greedy", greedy), ("sampled", sampled)):
            fields = ("tokens", "mask", "logprobs", "truncated")
            parts = {f: np.concatenate([g[f"{name}/{mode}/{f}"] for g in got]) for f in fields}
            assert_same(ref, rollout.Generation(**parts))
            engines = [int(g[f"{name}/{mode}/engines"]) for g in got]
            assert engines == ([2, 2] if name == "fsdp4" else [1, 1])
            assert all(int(g[f"{name}/{mode}/pages_at_end"]) == 0 for g in got)
    fields = ("tokens", "mask", "logprobs", "truncated")
    for mode, temperature, key in (("greedy", 0.0, 0), ("sampled", 1.0, 5)):
        ref = rollout.generate(
            model, ids[:4], mask[:4], rng=jax.random.key(key), temperature=temperature,
            max_new_tokens=T, num_samples=G, engine="static",
        )  # fmt: skip
        parts = {f: np.concatenate([g[f"static/{mode}/{f}"] for g in got]) for f in fields}
        assert_same(ref, rollout.Generation(**parts))
    # Across processes: process 1 takes process 0's lent prompts (their outputs go back to
    # process 0 through the store) and the tokens are the split run's.
    for g in got:
        for f in fields:
            np.testing.assert_array_equal(g[f"lending/split/{f}"], g[f"lending/stealing/{f}"])
        assert int(g["lending/split/stolen"]) == 0
        assert int(g["lending/stealing/pages_at_end"]) == 0
    assert [int(g["lending/split/decode_steps"]) for g in got] == [4 * 47, 4]
    steps = [int(g["lending/stealing/decode_steps"]) for g in got]
    assert max(steps) <= 3 * 47 and sum(steps) == 4 * 47 + 4, steps
    assert int(got[1]["lending/stealing/stolen"]) >= 1
    for g in got:
        assert "processes passed different rng keys" in str(g["different_keys"])
        assert "data shard 0 of the mesh spans processes [0, 1]" in str(g["refused"])


def test_tensor_parallel_engines_on_an_fsdp_mesh_give_the_one_device_tokens(
    model, one_device, monkeypatch
):
    """``tensor_parallel=2`` on an FSDP-only mesh of 4: 2 engines of 2 devices each, every
    weight split over its engine's 2 devices where its heads / MLP / vocabulary divide (no
    engine holds a whole copy), each page pool split over them by KV head, in and out of every
    decode call, the one-device tokens (sampled with the same key)."""
    ids, mask, _, sampled = one_device
    pool_specs = []
    decode = paged._decode

    def recording(graphdef, params, layers_l, pool, *args, **kw):
        pool_specs.append(pool.k[0].addressable_shards[0].data.shape)
        out = decode(graphdef, params, layers_l, pool, *args, **kw)
        pool_specs.append(out[0].k[0].addressable_shards[0].data.shape)
        return out

    monkeypatch.setattr(paged, "_decode", recording)
    mesh, sharded = on_mesh(model, dict(fsdp=4, devices=jax.devices()[:4]))
    graphdef, params = sharded
    options = paged.PagedOptions(**{**vars(SMALL), "tensor_parallel": 2})
    rmesh, weights = paged_dp.regroup(
        graphdef, mesh, paged.engine_params(params), options.tensor_parallel
    )
    assert dict(rmesh.shape) == {"data": 2, "fsdp": 1, "tensor": 2}
    assert [list(s.devices.flat) for s in paged_dp.data_shard_meshes(rmesh)] == [
        list(mesh.devices.flat)[2 * d : 2 * d + 2] for d in range(2)
    ]
    q = weights.layers[0]["self_attn"]["q_proj"]["kernel"]  # [embed, q_heads, head_dim]
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "tensor", None)
    assert q.addressable_shards[0].data.shape == (q.shape[0], q.shape[1] // 2, q.shape[2])
    np.testing.assert_array_equal(
        np.asarray(q), np.asarray(params["model"]["layers"]["self_attn"]["q_proj"]["kernel"][0])
    )
    embed = weights.rest["model"]["embed_tokens"]["embedding"]  # [vocab, embed]
    assert embed.sharding.spec == jax.sharding.PartitionSpec("tensor", None)
    out, stats = rollout.generate(
        sharded, ids, mask, rng=jax.random.key(5), temperature=1.0, paged_options=options,
        return_stats=True, **KW,
    )  # fmt: skip
    assert_same(sampled, out)
    assert len(stats.shards) == 2 and stats.pages_in_use_at_end == 0
    # [pages, page_size, K, Dh], each device holding K / 2 heads.
    cfg = model.config
    assert cfg.num_kv_heads % 2 == 0 and pool_specs
    assert {s[2:] for s in pool_specs} == {(cfg.num_kv_heads // 2, cfg.head_dim)}


def test_a_tensor_parallel_decode_communicates_activations_only(model):
    """A two-device engine's decode program (regrouped from FSDP): its collectives are the
    Megatron pattern's, on ``[rows, hidden]`` activations (after each attention and MLP output
    projection), the embedding lookup and the vocabulary-split logits (gathered for
    sampling); none moves the page pool or a weight, which stay where they are split."""
    import re

    mesh, (graphdef, params) = on_mesh(model, dict(fsdp=8))
    rmesh, weights = paged_dp.regroup(graphdef, mesh, paged.engine_params(params), 2)
    sub = paged_dp.data_shard_meshes(rmesh)[0]
    local = paged_dp.shard_params(weights, rmesh, [sub])[0]
    cfg, rows = model.config, 8
    options = paged.resolve_options(
        SMALL, num_seqs=rows, num_samples=G, longest_prompt=12, max_new_tokens=T
    )
    worst = paged.worst_case_programs(
        cfg, local, options, None, num_prompts=rows // G, num_samples=G, longest_prompt=12,
        max_new_tokens=T, greedy=False, top_k=0, top_p=1.0, pad_token_id=0,
        cache_dtype=jnp.float32, num_stop_ids=8,
        sharding=jax.sharding.NamedSharding(sub, jax.P()),
    )  # fmt: skip
    with jax.set_mesh(sub):
        call = worst.decode
        text = call.fn.lower(graphdef, *call.args, static=call.static).compile().as_text()
    found = re.findall(
        r"= \w+\[([\d,]*)\]\S* (all-gather|all-reduce|reduce-scatter|all-to-all)\(", text
    )
    sizes = [int(np.prod([int(d) for d in shape.split(",") if d])) for shape, _ in found]
    reduced = [s for (shape, op), s in zip(found, sizes, strict=True) if op == "all-reduce"]
    n = call.rows  # the decode's row bucket (SMALL's 4 slots)
    assert reduced.count(n * cfg.hidden_size) >= 2 * cfg.num_layers  # o_proj, down_proj
    # The largest: the vocabulary-split logits gathered for sampling ([rows, vocab], padded).
    biggest = n * max(cfg.hidden_size, -(-cfg.vocab_size // 128) * 128)
    pool_layer = options.num_pages * options.page_size * cfg.num_kv_heads * cfg.head_dim
    too_big = [f for f, size in zip(found, sizes, strict=True) if size > biggest]
    assert not too_big and biggest < pool_layer, too_big


def test_heads_a_tensor_parallel_does_not_divide_are_replicated_with_one_warning(model):
    """t = 4 and the tiny model's 2 KV heads: the attention projections stay whole on each
    engine's devices (warned), the MLP still splits; nothing else is logged per leaf."""
    mesh, (graphdef, params) = on_mesh(model, dict(fsdp=8))
    with pytest.warns(UserWarning, match="does not divide the model's 4 query / 2 KV heads"):
        _, weights = paged_dp.regroup(graphdef, mesh, paged.engine_params(params), 4)
    layer = weights.layers[0]
    assert layer["self_attn"]["k_proj"]["kernel"].sharding.is_fully_replicated
    up = layer["mlp"]["up_proj"]["kernel"]  # [embed, mlp]
    assert up.addressable_shards[0].data.shape == (up.shape[0], up.shape[1] // 4)


@pytest.mark.parametrize(
    ("t", "match"),
    [(3, "dividing the parameters' mesh's 8 devices"), (0.5, "int >= 0"), (-1, "int >= 0")],
)
def test_a_bad_tensor_parallel_is_a_clear_error(model, t, match):
    _, sharded = on_mesh(model, dict(fsdp=8))
    ids, mask = prompts(seed=0, lengths=(4, 5))
    with pytest.raises(ValueError, match=match):
        rollout.generate(
            sharded, ids, mask, rng=jax.random.key(0), max_new_tokens=4, engine="paged",
            paged_options=paged.PagedOptions(tensor_parallel=t),
        )  # fmt: skip
    with pytest.raises(ValueError, match="needs the parameters on a mesh"):
        rollout.generate(
            model, ids, mask, rng=jax.random.key(0), max_new_tokens=4, engine="paged",
            paged_options=paged.PagedOptions(tensor_parallel=2),
        )  # fmt: skip
